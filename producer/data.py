"""Data sources: documents addressed by a stable global sample id.

Every source maps a sample id (0 .. len-1) to a :class:`Document` (token ids + loss mask) and
can re-read any id at random, which the producer needs to recompute batches on replay:

- ``chat``: conversations, one a record (OpenAI ``{"messages": [{"role", "content"}, ...]}`` and the record's
  ``tools``, ShareGPT, UltraChat, or keys the config names: ``ChatLayout``) in JSONL, Parquet or Arrow files or a
  Hugging Face dataset folder (producer/data_files.py), rendered with the target tokenizer's chat template; the loss
  mask covers the assistant turns only.
- ``tokenized``: JSONL or parquet rows with ``input_ids`` and an optional ``loss_mask``.
- ``synthetic``: a generator with learnable structure; sample i is a pure function of (seed, i).

For files, the sample id is the record index across the listed files in order (line i of a
JSONL file is one record, blank lines included, so ids never shift when a line is bad; row i of a table).
A bad record (invalid JSON, wrong types, empty, too long with the ``drop`` policy, no loss
tokens) is logged with its file and line, counted in :class:`DataStats` and skipped: ``get``
returns ``None``. It never stops the producer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.batch import Document
from common.config import DataConfig, RunConfig
from common.rundir import atomic_write_json, read_json
from producer.data_files import (
    BadRecord,
    DataError,
    FileRecords,
    JsonlRecords,
    RecordFiles,
    Records,
    entry_files,
    expand_paths,
    open_records,
)

log = logging.getLogger(__name__)


# Enough to diagnose a broken file without flooding the log of a long-lived producer.
_MAX_LOGGED_BAD_RECORDS = 100


@dataclass
class DataStats:
    """Counters of one source; each sample id counts at most once."""

    documents: int = 0
    """Distinct good documents read."""
    truncated: int = 0
    """Distinct documents cut to max_seq_len."""
    bad: Counter = field(default_factory=Counter)
    """Distinct bad records per reason."""
    first_bad: list[str] = field(default_factory=list)
    """``file:line reason`` of the first ``keep_first_bad`` bad records, for messages."""
    keep_first_bad: int = 3
    """How many bad records ``first_bad`` lists (``check`` lists every one it reads)."""
    cut: Counter = field(default_factory=Counter)
    """Distinct conversations the target wrote that end early (synthesize.turns = "all"), per reason."""

    def as_dict(self) -> dict[str, Any]:
        figures = {
            "documents": self.documents,
            "truncated": self.truncated,
            "bad_records": sum(self.bad.values()),
            "bad_by_reason": dict(self.bad),
        }
        if self.cut:
            figures.update(cut_conversations=sum(self.cut.values()), cut_by_reason=dict(self.cut))
        return figures


MISSING = object()
"""What ``DocumentCache.lookup`` returns for a document it does not keep (None is a kept bad record)."""


class DocumentCache:
    """Documents already made (bad records as None), kept for later epochs and replays up to a byte budget.

    It fills and never evicts: every epoch reads each record once, in a new order, so an evicting cache smaller
    than the data would almost never hit, while one that keeps the first records it saw hits on that share of
    every later epoch. Rendering a chat record (template and tokenizer) costs about a millisecond of the
    producer's one thread, more than a small target's forward of it.
    """

    _BYTES_PER_DOCUMENT = 200
    """Python's overhead of one kept document (the object, its two arrays, the dict entry), roughly."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.kept_bytes = 0
        self.hits = 0
        self.misses = 0
        self._documents: dict[int, Document | None] = {}

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._documents

    def lookup(self, sample_id: int) -> Document | None | object:
        """The kept document (None for a kept bad record), or ``MISSING``."""
        found = self._documents.get(sample_id, MISSING)
        if found is MISSING:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def keep(self, sample_id: int, document: Document | None) -> None:
        size = self._BYTES_PER_DOCUMENT + (document.input_ids.nbytes + document.loss_mask.nbytes if document else 0)
        if self.kept_bytes + size <= self.budget_bytes:
            self._documents[sample_id] = document
            self.kept_bytes += size

    def as_dict(self) -> dict[str, Any]:
        return {
            "cache_documents": len(self._documents),
            "cache_mb": round(self.kept_bytes / 2**20, 1),
            "cache_hit_rate": round(self.hits / max(self.hits + self.misses, 1), 3),
        }


class DataSource(ABC):
    """Random access to documents by global sample id, with validation and length policy."""

    def __init__(self, config: DataConfig):
        self.config = config
        self.stats = DataStats()
        self.cache = DocumentCache(config.cache_mb * 2**20)
        # Ids already counted, so re-reads (replay, later epochs) do not recount; a bitmap, not a
        # set, to stay small for data sets of many millions of records.
        self._seen: np.ndarray | None = None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Raw (input_ids, loss_mask) of a record; raises BadRecord."""

    @abstractmethod
    def location(self, sample_id: int) -> str:
        """Where a record lives, for messages (e.g. ``data/a.jsonl:17``)."""

    def prefetch(self, sample_ids: list[int]) -> None:
        """These ids are about to be read (a window of the batch plan): a source that makes its documents in
        batches (producer/regenerate.py) makes them now, together. Nothing to do for records read from files."""

    def get(self, sample_id: int) -> Document | None:
        """The document with this id, or None when the record is bad (logged and counted)."""
        if not 0 <= sample_id < len(self):
            raise IndexError(f"sample id {sample_id} out of range [0, {len(self)})")
        kept = self.cache.lookup(sample_id)
        if kept is not MISSING:
            return kept
        if self._seen is None:
            self._seen = np.zeros(len(self), dtype=bool)
        first_time = not self._seen[sample_id]
        self._seen[sample_id] = True
        try:
            input_ids, loss_mask = self._read(sample_id)
            document, truncated = self._apply_length_policy(sample_id, input_ids, loss_mask)
        except BadRecord as bad:
            if first_time:
                self._report_bad(sample_id, bad)
            self.cache.keep(sample_id, None)
            return None
        if first_time:
            self.stats.documents += 1
            self.stats.truncated += int(truncated)
        self.cache.keep(sample_id, document)
        return document

    def _apply_length_policy(
        self, sample_id: int, input_ids: np.ndarray, loss_mask: np.ndarray
    ) -> tuple[Document, bool]:
        max_len = self.config.max_seq_len
        truncated = input_ids.shape[0] > max_len
        if truncated:
            if self.config.too_long == "drop":
                raise BadRecord("too_long", f"{input_ids.shape[0]} tokens > data.max_seq_len={max_len}")
            input_ids, loss_mask = input_ids[:max_len], loss_mask[:max_len]
        if input_ids.shape[0] == 0:
            raise BadRecord("empty", "no tokens")
        if not loss_mask.any():
            # Costs a target forward and trains nothing.
            raise BadRecord("no_loss_tokens", "loss mask is all zeros" + (" after truncation" if truncated else ""))
        document = Document(
            sample_id,
            np.ascontiguousarray(input_ids, dtype=np.int32),
            np.ascontiguousarray(loss_mask, dtype=np.uint8),
        )
        return document, truncated

    def _report_bad(self, sample_id: int, bad: BadRecord) -> None:
        self.stats.bad[bad.reason] += 1
        if len(self.stats.first_bad) < self.stats.keep_first_bad:
            self.stats.first_bad.append(f"{self.location(sample_id)} {bad}")
        total = sum(self.stats.bad.values())
        if total <= _MAX_LOGGED_BAD_RECORDS:
            log.warning("bad record %s (sample %d) skipped: %s", self.location(sample_id), sample_id, bad)
            if total == _MAX_LOGGED_BAD_RECORDS:
                log.warning("further bad records are only counted (see data stats)")


# ----------------------------------------------------------------------------------------------
# Files


def _token_array(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, (list, np.ndarray)):
        raise BadRecord("wrong_type", f"{name} must be a list of ints, got {type(value).__name__}")
    array = np.asarray(value) if len(value) else np.zeros(0, np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise BadRecord("wrong_type", f"{name} must be a flat list of ints")
    return array


def validate_tokenized(record: Any, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of a pre-tokenized record; loss_mask defaults to all ones."""
    if not isinstance(record, dict):
        raise BadRecord("wrong_type", f"record must be an object, got {type(record).__name__}")
    if "input_ids" not in record:
        raise BadRecord("missing_key", "input_ids")
    input_ids = _token_array(record["input_ids"], "input_ids")
    if input_ids.size and (input_ids.min() < 0 or (vocab_size is not None and input_ids.max() >= vocab_size)):
        raise BadRecord("bad_value", f"input_ids outside [0, {vocab_size})")
    if record.get("loss_mask") is None:
        return input_ids, np.ones(input_ids.shape[0], np.uint8)
    loss_mask = _token_array(record["loss_mask"], "loss_mask")
    if loss_mask.shape != input_ids.shape:
        raise BadRecord("bad_value", f"loss_mask has {loss_mask.shape[0]} entries for {input_ids.shape[0]} tokens")
    if loss_mask.size and (loss_mask.min() < 0 or loss_mask.max() > 1):
        raise BadRecord("bad_value", "loss_mask values must be 0 or 1")
    return input_ids, loss_mask


class TokenizedJsonlSource(DataSource):
    """JSONL lines ``{"input_ids": [...], "loss_mask": [...]}`` (loss_mask optional)."""

    def __init__(self, config: DataConfig, paths: list[str]):
        super().__init__(config)
        self.records = FileRecords([JsonlRecords(p) for p in paths])

    def __len__(self) -> int:
        return len(self.records)

    def location(self, sample_id: int) -> str:
        return self.records.location(sample_id)

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        return validate_tokenized(self.records.read(sample_id), self.config.vocab_size)


class ParquetSource(DataSource):
    """Parquet files with an ``input_ids`` list column and an optional ``loss_mask`` column.

    The token columns are decoded into memory once (Arrow buffers), so random access is a slice.
    Keep data sets larger than memory in JSONL, which is read from disk by line offset.
    """

    def __init__(self, config: DataConfig, paths: list[str]):
        super().__init__(config)
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                "reading parquet needs pyarrow: pip install pyarrow (or pip install 'dflash-stream[parquet]')"
            ) from None
        self._columns: list[dict[str, Any]] = []
        for path in paths:
            names = pq.read_schema(path).names
            if "input_ids" not in names:
                raise ValueError(f"{path}: parquet file has no input_ids column (columns: {names})")
            wanted = [n for n in ("input_ids", "loss_mask") if n in names]
            table = pq.read_table(path, columns=wanted)
            self._columns.append({name: table.column(name).combine_chunks() for name in wanted})
        self._files = RecordFiles(paths, [len(c["input_ids"]) for c in self._columns])

    def __len__(self) -> int:
        return len(self._files)

    def location(self, sample_id: int) -> str:
        file_index, row = self._files.locate(sample_id)
        return f"{self._files.paths[file_index]}:row {row}"

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        file_index, row = self._files.locate(sample_id)
        columns = self._columns[file_index]
        record = {}
        for name, column in columns.items():
            value = column[row]
            record[name] = value.values.to_numpy(zero_copy_only=False) if value.is_valid else None
        if record["input_ids"] is None:
            raise BadRecord("missing_key", "input_ids is null")
        return validate_tokenized(record, self.config.vocab_size)


# ----------------------------------------------------------------------------------------------
# Chat

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# An empty reasoning block where an answer starts (Qwen3 / Qwen3.5 templates insert one when a turn has no
# reasoning): the target never generates it after a thinking-off prompt, so it is no training target.
_EMPTY_THINK = re.compile(r"(?:<think>)?\s*</think>\s*")


def _common_prefix_length(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


DEFAULT_ROLE_NAMES = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
    "function_call": "tool_call",
}
"""The speakers of the common layouts (OpenAI, ShareGPT and its variants) and the role each is; ``data.role_names``
adds to them (``tool_call``: an assistant turn whose text is a JSON tool call)."""

CONVERSATION_KEYS = ("messages", "conversations", "conversation", "data")
"""Where a record keeps its conversation, looked for in this order unless ``data.messages_key`` names it: OpenAI and
UltraChat 200k (messages), ShareGPT (conversations), LMSYS-Chat (conversation), the original UltraChat (data)."""

_FORMATS = (
    "expected {\"messages\": [{\"role\", \"content\"}, ...]} (OpenAI) or "
    "{\"conversations\": [{\"from\", \"value\"}, ...]} (ShareGPT); data.messages_key, data.role_key and "
    "data.content_key name other keys"
)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, None (an assistant turn that only calls tools), or a list of
    OpenAI content parts of which only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRecord(
                    "unsupported_content", f"{where}[{j}] is a {kind!r} part: only text parts are trained on"
                )
        return "".join(texts)
    raise BadRecord("wrong_type", f"{where} must be a string, a list of content parts or null")


def _json_value(value: Any, where: str) -> Any:
    """``value``, or what it holds when it is JSON text (tables often keep a conversation or tools as a string)."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return None
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise BadRecord("wrong_type", f"{where} is text that is not JSON") from None


def _without_nulls(value: Any) -> Any:
    """An object without its null entries: a table gives every row each key that any row has, null where absent,
    and a template tests whether a key is there, not whether it is null."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _tool_calls_in_text(text: Any, where: str) -> list[dict[str, Any]]:
    """The calls a ShareGPT ``function_call`` turn writes as JSON (``{"name", "arguments"}`` or a list of them), as
    OpenAI tool calls."""
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        value = None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, dict) and isinstance(item.get("name"), str) for item in items):
        raise BadRecord("wrong_type", f"{where} must be a JSON tool call {{\"name\", \"arguments\"}} or a list of them")
    return [
        {
            "type": "function",
            "function": {"name": item["name"], "arguments": item.get("arguments", item.get("parameters", {}))},
        }
        for item in items
    ]


@dataclass(frozen=True)
class ChatLayout:
    """Where a chat record keeps its conversation and what its messages call the speaker and the text
    (``data.messages_key``, ``data.role_key``, ``data.content_key``, ``data.role_names``); None: found by itself."""

    messages_key: str | None = None
    role_key: str | None = None
    content_key: str | None = None
    role_names: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_NAMES))

    @classmethod
    def of(cls, config: DataConfig) -> ChatLayout:
        names = {**DEFAULT_ROLE_NAMES, **{name.lower(): role for name, role in config.role_names.items()}}
        return cls(config.messages_key, config.role_key, config.content_key, names)

    def conversation_key(self, record: dict[str, Any]) -> str | None:
        """The key of ``record`` that holds its conversation, or None."""
        if self.messages_key is not None:
            return self.messages_key if self.messages_key in record else None
        return next((key for key in CONVERSATION_KEYS if key in record), None)

    def message_keys(self, message: dict[str, Any]) -> tuple[str | None, str]:
        """(speaker key, text key) of a message: the configured ones, else role and content or from and value."""
        role_key = self.role_key or ("role" if "role" in message else "from" if "from" in message else None)
        return role_key, self.content_key or ("value" if role_key == "from" else "content")

    def openai_record(self, record: Any) -> dict[str, Any]:
        """The record with its conversation as OpenAI messages under ``messages`` (text content; tool calls, tool
        results and reasoning kept) and its ``tools`` as a list; raises BadRecord. A prompt may have no assistant
        turn yet: ``validate_messages`` asks for one."""
        if not isinstance(record, dict):
            raise BadRecord("wrong_type", f"record must be an object, got {type(record).__name__}; {_FORMATS}")
        key = self.conversation_key(record)
        if key is None:
            wanted = repr(self.messages_key) if self.messages_key else " or ".join(map(repr, CONVERSATION_KEYS))
            raise BadRecord("unknown_format", f"no {wanted} key (keys: {sorted(record)[:6]}); {_FORMATS}")
        raw = _json_value(record[key], key)
        if not isinstance(raw, list) or not raw:
            raise BadRecord("wrong_type", f"{key} must be a non-empty list")
        if self.role_key is None and all(isinstance(m, str) for m in raw):  # the original UltraChat: turns in order
            messages = [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(raw)]
        else:
            messages = [self._message(message, f"{key}[{i}]") for i, message in enumerate(raw)]
        converted = {k: v for k, v in record.items() if k not in (key, "tools")}
        converted["messages"] = messages
        tools = _json_value(record.get("tools"), "tools")
        if tools:
            converted["tools"] = tools
        return converted

    def _message(self, message: Any, where: str) -> dict[str, Any]:
        if not isinstance(message, dict):
            raise BadRecord("wrong_type", f"{where} must be an object")
        role_key, content_key = self.message_keys(message)
        if role_key is None or role_key not in message:
            raise BadRecord("missing_key", f"{where}.{role_key or 'role'}")
        name = message[role_key]
        if not isinstance(name, str):
            raise BadRecord("wrong_type", f"{where}.{role_key} must be a string")
        role = self.role_names.get(name.lower())
        if role == "tool_call":
            calls = _tool_calls_in_text(message.get(content_key), f"{where}.{content_key}")
            return {"role": "assistant", "content": "", "tool_calls": calls}
        if role is None:
            if role_key != "role":
                raise BadRecord(
                    "wrong_type", f"{where}.{role_key}: unknown speaker {name!r} (data.role_names maps it to a role)"
                )
            role = name  # an OpenAI role of the template's own (ipython, function, ...)
        if content_key not in message and not message.get("tool_calls"):
            raise BadRecord("missing_key", f"{where}.{content_key}")
        converted = {"role": role, "content": _text_of(message.get(content_key), f"{where}.{content_key}")}
        if role_key == "role":  # tool_calls, tool_call_id, name, reasoning_content go to the template as they are
            for k, v in message.items():
                if v is not None and k not in (role_key, content_key, "role", "content"):
                    converted[k] = v
            if isinstance(converted.get("tool_calls"), list):
                converted["tool_calls"] = [
                    {**_without_nulls(call), "function": _without_nulls(call.get("function"))}
                    if isinstance(call, dict) and "function" in call
                    else _without_nulls(call)
                    for call in converted["tool_calls"]
                ]
        return converted

    def check(self, record: dict[str, Any], where: str) -> str:
        """How this layout reads records like ``record`` (the first of a file), in words; DataError naming the keys
        found and the ``data.*`` keys that fix it when it cannot."""
        key = self.conversation_key(record)
        if key is None:
            named = (
                f"data.messages_key = {self.messages_key!r} is none of them"
                if self.messages_key
                else f"none is {', '.join(CONVERSATION_KEYS)}: data.messages_key names the one that holds the messages"
            )
            raise DataError(
                f"data.paths: {where}: no conversation in its records, whose keys are {sorted(record)}; {named}"
            )
        try:
            raw = _json_value(record[key], key)
        except BadRecord:
            raw = record[key]
        first = raw[0] if isinstance(raw, list) and raw else None
        if first is None:
            return f"conversations in {key!r}"
        if isinstance(first, str) and self.role_key is None:
            return f"conversations in {key!r} as user and assistant turns in order"
        if isinstance(first, dict):
            role_key, content_key = self.message_keys(first)
            if role_key in first and (content_key in first or "tool_calls" in first):
                return f"conversations in {key!r}, messages {{{role_key!r}, {content_key!r}}}"
            raise DataError(
                f"data.paths: {where}: the messages in {key!r} have the keys {sorted(first)}: data.role_key and "
                "data.content_key name the speaker's and the text's (found by themselves: role and content, or from "
                "and value)"
            )
        raise DataError(
            f"data.paths: {where}: {key!r} holds {type(raw).__name__} values, not lists of messages; "
            "data.messages_key names the key that holds the messages"
        )


_DEFAULT_LAYOUT = ChatLayout()


def validate_messages(record: Any) -> list[dict[str, Any]]:
    """The conversation of a record in any layout that ``ChatLayout`` reads by itself (OpenAI, ShareGPT, UltraChat)
    as OpenAI messages with text content (tool calls, tool results and content parts included); it must have an
    assistant turn."""
    messages = _DEFAULT_LAYOUT.openai_record(record)["messages"]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_loss_tokens", "no assistant message")
    return messages


def record_tools(record: Any) -> list[dict[str, Any]] | None:
    """The tool definitions of an OpenAI record (its ``tools`` list, which the chat template renders into the
    prompt), or None when it has none."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRecord("wrong_type", "tools must be a list of objects (OpenAI tool definitions)")
    return tools


def template_kwargs_of(record: Any, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``template_kwargs`` with the record's tool definitions added, if it has some."""
    tools = record_tools(record)
    return {**template_kwargs, "tools": tools} if tools else dict(template_kwargs)


def tool_calls_of(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The tool calls of an OpenAI assistant message as ``{"id", "name", "arguments"}`` (id None when the record
    gives none; arguments as recorded: a JSON string or an object). Raises BadRecord for a malformed call."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise BadRecord("wrong_type", f"{where}.tool_calls must be a list")
    normalized = []
    for k, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRecord("wrong_type", f"{where}.tool_calls[{k}] must be an object with function.name")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise BadRecord("wrong_type", f"{where}.tool_calls[{k}].function.arguments must be a string or an object")
        normalized.append({"id": call.get("id"), "name": function["name"], "arguments": arguments})
    return normalized


_CONTEXT_ROLES = frozenset({"system", "developer"})
"""Roles that are context wherever they stand: they neither open nor answer a turn."""


def check_turn_order(messages: list[dict[str, Any]]) -> None:
    """Check that the target can write the conversation turn by turn (synthesize.turns = "all"): system messages
    anywhere; a user turn first; then user and assistant turns alternating, where an assistant turn that calls tools
    is followed by their results (``role: "tool"``, each answering one of its calls by ``tool_call_id``, or in order
    when the record gives no ids) and then by the assistant turn that reads them. Raises BadRecord ("turn_order" or
    "tool_result_without_call") naming the message."""
    previous: str | None = None  # user, assistant, calls (an assistant turn with tool calls), tool
    caller = -1  # the assistant message whose calls the tool results answer
    unanswered: list[str | None] = []  # ids of its calls that no result answered yet
    for i, message in enumerate(messages):
        role, where = message["role"], f"messages[{i}]"
        if role in _CONTEXT_ROLES:
            continue
        if role == "user":
            if previous == "user":
                raise BadRecord("turn_order", f"{where}: two user turns in a row")
            if previous == "tool":
                raise BadRecord("turn_order", f"{where}: a user turn follows tool results no assistant turn reads")
            if previous == "calls":
                raise BadRecord("turn_order", f"{where}: a user turn follows the tool calls of messages[{caller}]")
            previous = "user"
        elif role == "assistant":
            if previous is None:
                raise BadRecord("turn_order", f"{where}: the conversation starts with an assistant turn")
            if previous in ("assistant", "calls"):
                raise BadRecord("turn_order", f"{where}: two assistant turns in a row")
            calls = tool_calls_of(message, where)
            previous, caller, unanswered = ("calls" if calls else "assistant"), i, [c["id"] for c in calls]
        elif role == "tool":
            if previous not in ("calls", "tool"):
                raise BadRecord("tool_result_without_call", f"{where}: a tool result with no tool call before it")
            answered = message.get("tool_call_id")
            if answered is not None and answered in unanswered:
                unanswered.remove(answered)
            elif unanswered and (answered is None or all(call_id is None for call_id in unanswered)):
                unanswered.pop(0)  # no ids to match: results answer the calls in order
            else:
                detail = f"tool_call_id {answered!r} answers" if answered is not None else "more results than"
                raise BadRecord("tool_result_without_call", f"{where}: {detail} the calls of messages[{caller}]")
            previous = "tool"
        else:
            raise BadRecord("turn_order", f"{where}: role {role!r} is none of system, developer, user, assistant, tool")


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a conversation rendered by the chat template, and its assistant-token mask.

    Templates with ``{% generation %}`` blocks give the mask directly. For any other template
    the assistant spans are found in the text (``chat_text_and_spans``) and tokens are assigned to
    them by character offsets (``tokens_with_mask``).
    """
    if _GENERATION_TAG.search(tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **template_kwargs
        )
        return np.asarray(encoded["input_ids"], np.int64), np.asarray(encoded["assistant_masks"], np.uint8)
    full, spans = chat_text_and_spans(tokenizer, messages, **template_kwargs)
    return tokens_with_mask(tokenizer(full, add_special_tokens=False, return_offsets_mapping=True), spans)


def chat_text_and_spans(
    tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text by the chat template, and the character spans of its assistant turns.

    The spans are found by rendering prefixes: an assistant turn starts where the prompt for it
    (history + generation header) ends, and ends where the rendering of the history through that turn
    ends. Templates that render the last turn differently (e.g. Qwen3 adds an empty think block to the
    final assistant turn only) are handled by finding where that turn's tail rejoins the full text. An
    empty think block that opens a turn (``<think>\n\n</think>\n\n``, or its tail after a thinking
    prompt's ``<think>\n``) is left out of the span; a turn's reasoning, when it has some, is supervised
    with its answer.
    """

    def render(prefix: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            prefix, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    full = render(messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _common_prefix_length(render(messages[:k], True), full) if k else 0
        through = render(messages[: k + 1], False)
        end = _common_prefix_length(through, full)
        if end < len(through):
            # The turn was rendered differently as the last one: its tail rejoins the full text at `end`.
            tail = through[end:]
            rejoined = next((i for i in range(len(tail)) if full.startswith(tail[i:], end)), None)
            if rejoined is None:
                raise BadRecord("template", f"cannot locate assistant turn {k} in the rendered conversation")
            end += len(tail) - rejoined
        empty_think = _EMPTY_THINK.match(full, start, end)
        if empty_think:
            start = empty_think.end()
        spans.append((start, end))
    return full, spans


def tokens_with_mask(encoded: Any, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of one encoded text and the mask of the tokens that start inside ``spans``: by character
    offsets, so merges across turn boundaries cannot shift the mask."""
    token_starts = np.asarray([s for s, _ in encoded["offset_mapping"]], np.int64)
    loss_mask = np.zeros(token_starts.shape[0], np.uint8)
    for start, end in spans:
        loss_mask[(token_starts >= start) & (token_starts < end)] = 1
    return np.asarray(encoded["input_ids"], np.int64), loss_mask


@contextlib.contextmanager
def template_errors() -> Iterator[None]:
    """A template may raise on content it rejects (e.g. role order): that record is bad, and the run goes on."""
    try:
        yield
    except BadRecord:
        raise
    except Exception as error:
        raise BadRecord("template", f"{type(error).__name__}: {error}") from None


def _opens_a_json_array(path: str) -> bool:
    """Whether the file is one JSON document that opens with ``[`` (a list of records, not one record a line)."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


class ChatRecords(FileRecords):
    """The records of chat data's files as one sequence, each read as OpenAI messages by the data's layout."""

    def __init__(self, files: list[Records], layout: ChatLayout, described: list[str]):
        super().__init__(files)
        self.layout = layout
        self._described = described

    def read(self, sample_id: int) -> dict[str, Any]:
        """The record with its conversation as OpenAI messages under ``messages``; raises BadRecord."""
        return self.layout.openai_record(super().read(sample_id))

    def describe(self) -> list[str]:
        """One line per entry of the paths: what it is and how its records are read."""
        return list(self._described)


def chat_records(config: DataConfig, paths: list[str]) -> ChatRecords:
    """The chat records of ``paths`` (files and dataset folders: producer/data_files.py) as ``config`` lays them out;
    DataError when a file cannot be read or its first record not as configured."""
    layout = ChatLayout.of(config)
    files: list[Records] = []
    described = []
    for entry in paths:
        container, names = entry_files(entry, config.split)
        layouts: dict[str, None] = {}  # the distinct ones, in order
        opened = [open_records(name) for name in names]
        for records in opened:
            sample = records.sample()
            if sample is None:
                if isinstance(records, JsonlRecords) and _opens_a_json_array(records.path):
                    raise DataError(
                        f"data.paths: {records.path} is one JSON array of records, not JSON lines: write one record "
                        "a line (jq -c '.[]' file.json > file.jsonl)"
                    )
                continue  # its first records are all bad: each is reported as one
            layouts[layout.check(sample, records.path)] = None
            records.project([layout.conversation_key(sample), "tools"])
        if not sum(len(records) for records in opened):
            raise DataError(f"data.paths: {entry} is empty (no records)")
        files += opened
        described.append(f"{entry}: {container}; {', '.join(layouts) or 'no record read yet'}")
    return ChatRecords(files, layout, described)


class ChatSource(DataSource):
    """Chat records (JSONL lines, Parquet or Arrow rows: producer/data_files.py) rendered with the target's chat
    template (with their ``tools``)."""

    def __init__(self, config: DataConfig, records: ChatRecords, tokenizer: Any):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat data needs a tokenizer with a chat_template")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("chat data needs a fast tokenizer (character offsets locate the assistant turns)")
        super().__init__(config)
        self.records = records
        self.tokenizer = tokenizer
        self._rendered: dict[int, tuple[np.ndarray, np.ndarray] | BadRecord] = {}
        """The window announced last (``prefetch``), rendered and tokenized together, until ``_read`` takes it."""

    def __len__(self) -> int:
        return len(self.records)

    def location(self, sample_id: int) -> str:
        return self.records.location(sample_id)

    def read_json(self, sample_id: int) -> dict[str, Any]:
        """The record, its conversation as OpenAI messages under ``messages`` whatever its layout; raises BadRecord."""
        return self.records.read(sample_id)

    def describe(self) -> list[str]:
        """What each entry of the paths is read as, for ``check``."""
        return self.records.describe()

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        rendered = self._rendered.pop(sample_id, None)
        if rendered is None:
            record = self.read_json(sample_id)
            messages = validate_messages(record)
            with template_errors():
                return render_chat(
                    self.tokenizer, messages, **template_kwargs_of(record, self.config.chat_template_kwargs)
                )
        if isinstance(rendered, BadRecord):
            raise rendered
        return rendered

    def prefetch(self, sample_ids: list[int]) -> None:
        """Render the window's records and tokenize them in one call: the tokenizer's batch runs on every core,
        where one record at a time runs on the producer's one thread (tokenizing is most of a record's cost).
        The documents are the same as one at a time (tests/test_data_sources.py)."""
        self._rendered = {}
        if _GENERATION_TAG.search(self.tokenizer.chat_template or ""):
            return  # the template gives the mask with its own tokenization: one record at a time
        texts: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        for sample_id in sample_ids:
            try:
                record = self.read_json(sample_id)
                messages = validate_messages(record)
                with template_errors():
                    texts[sample_id] = chat_text_and_spans(
                        self.tokenizer, messages, **template_kwargs_of(record, self.config.chat_template_kwargs)
                    )
            except BadRecord as bad:
                self._rendered[sample_id] = bad
        if not texts:
            return
        encoded = self.tokenizer(
            [text for text, _ in texts.values()], add_special_tokens=False, return_offsets_mapping=True
        )
        for i, (sample_id, (_, spans)) in enumerate(texts.items()):
            self._rendered[sample_id] = tokens_with_mask(
                {"input_ids": encoded["input_ids"][i], "offset_mapping": encoded["offset_mapping"][i]}, spans
            )


ChatJsonlSource = ChatSource
"""The chat source's former name, which the evaluation's held-out records still import."""


# ----------------------------------------------------------------------------------------------
# Synthetic

# Log-normal spread of the chat-like length mix; with mean 1000 and max 3072 this gives a few
# dozen to a few thousand tokens, a long tail like real assistant answers.
_CHAT_LENGTH_SIGMA = 0.8


class SyntheticSource(DataSource):
    """Deterministic documents with structure a small drafter can learn from context.

    A document is a prompt (loss mask 0, about a tenth of it) and an answer (loss mask 1), both
    made of segments of two kinds: arithmetic progressions ``a, a+s, a+2s, ... (mod V)`` (the next
    token follows from the previous two) and a short random motif repeated (the next token is
    a copy from earlier). Sample i depends only on (seed, i), so any sample can be regenerated.
    """

    def __len__(self) -> int:
        return self.config.num_samples

    def location(self, sample_id: int) -> str:
        return f"synthetic(seed={self.config.seed}):{sample_id}"

    def _length(self, rng: np.random.Generator) -> int:
        cfg = self.config
        if cfg.length_mode == "fixed":
            return cfg.mean_len
        mu = np.log(cfg.mean_len) - _CHAT_LENGTH_SIGMA**2 / 2  # so that the unclipped mean is mean_len
        return int(np.clip(round(rng.lognormal(mu, _CHAT_LENGTH_SIGMA)), cfg.min_len, cfg.max_seq_len))

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.config.seed, sample_id])
        vocab = self.config.vocab_size
        length = self._length(rng)
        tokens = np.empty(length, np.int64)
        filled = 0
        while filled < length:
            size = min(int(rng.integers(16, 129)), length - filled)
            if rng.random() < 0.5:
                start, step = rng.integers(0, vocab), rng.integers(1, min(vocab, self.config.max_step + 1))
                segment = (start + step * np.arange(size)) % vocab
            else:
                motif = rng.integers(0, vocab, size=int(rng.integers(2, 9)))
                segment = np.resize(motif, size)
            tokens[filled : filled + size] = segment
            filled += size
        loss_mask = np.ones(length, np.uint8)
        loss_mask[: length // 10] = 0
        return tokens, loss_mask


# ----------------------------------------------------------------------------------------------
# The held-out split


class SubsetSource(DataSource):
    """The records of ``source`` with the given ids, renumbered ``0 .. len(ids) - 1`` in their order."""

    def __init__(self, source: DataSource, ids: np.ndarray):
        super().__init__(source.config)
        self.source = source
        self.ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def location(self, sample_id: int) -> str:
        return self.source.location(int(self.ids[sample_id]))

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source._read(int(self.ids[sample_id]))

    def prefetch(self, sample_ids: list[int]) -> None:
        self.source.prefetch([int(self.ids[i]) for i in sample_ids])

    def read_json(self, sample_id: int) -> Any:
        """The raw record (sources of JSON records only)."""
        return self.source.read_json(int(self.ids[sample_id]))


HELD_OUT_SEED = 0x5EED_E7A1
"""Mixed with data.shuffle_seed to pick the held-out records: fixed, so that every process picks the same ones."""


HELD_OUT_MOST = 0.1
"""The largest fraction of a data set held out by default: a small one keeps nine tenths to train on."""


def held_out_ids(num_records: int, count: int, shuffle_seed: int) -> np.ndarray:
    """The ids of the records held out for evaluation, sorted: ``count`` of them, at most a tenth of the data, drawn
    by a fixed seed spread over the whole data set (not its head or tail, which are often one source or length)."""
    count = min(count, int(num_records * HELD_OUT_MOST))
    rng = np.random.default_rng([HELD_OUT_SEED, shuffle_seed])
    return np.sort(rng.choice(num_records, size=count, replace=False))


def split_held_out(
    source: DataSource, count: int, shuffle_seed: int, held_out_file: Path | None = None
) -> tuple[DataSource, DataSource]:
    """(training records, held-out records) of ``source``: disjoint, together all of it, the same in every process.

    With ``held_out_file`` (a run's ``held_out.json``) the ids are the ones it stores, written there at the run's first
    start: a later start or evaluation with another ``eval.num_prompts`` holds out, and evaluates on, the same records
    (never some the run trained on). A file of another data set (another record count) is refused."""
    stored = read_json(held_out_file) if held_out_file is not None else None
    if stored is not None:
        if stored.get("num_records") != len(source):
            raise DataError(
                f"{held_out_file}: the run held out records of a data set of {stored.get('num_records')} "
                f"records, data.paths now holds {len(source)}: evaluate with the run's own data, or "
                "give eval.paths"
            )
        held = np.asarray(stored["ids"], dtype=np.int64)
    else:
        held = held_out_ids(len(source), count, shuffle_seed)
        if held_out_file is not None:
            atomic_write_json(held_out_file, {"num_records": len(source), "ids": held.tolist()})
    kept = np.setdiff1d(np.arange(len(source), dtype=np.int64), held, assume_unique=True)
    return SubsetSource(source, kept), SubsetSource(source, held)


# ----------------------------------------------------------------------------------------------


def build_data_source(config: DataConfig, tokenizer: Any = None) -> DataSource:
    """The source described by ``config``; chat data uses ``tokenizer`` (or loads config.tokenizer)."""
    if config.format == "synthetic":
        if config.vocab_size is None:
            raise ValueError("data.vocab_size must be set for synthetic data (the producer sets it from the target)")
        return SyntheticSource(config)
    if config.format == "tokenized":
        paths = expand_paths(config.paths)
        parquet = [p.endswith(".parquet") for p in paths]
        if all(parquet):
            return ParquetSource(config, paths)
        if any(parquet):
            raise ValueError("paths mixes parquet and JSONL files; use one kind per data set")
        return TokenizedJsonlSource(config, paths)
    if tokenizer is None:
        if config.tokenizer is None:
            raise ValueError("chat data needs a tokenizer: pass the target's or set tokenizer")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)

    return ChatSource(config, chat_records(config, expand_paths(config.paths, folders=True)), tokenizer)


def run_sources(
    cfg: RunConfig, target_vocab_size: int, tokenizer: Any = None, held_out_file: Path | None = None
) -> tuple[DataSource, DataSource]:
    """(training, held-out) documents of a run, the same in every process that asks.

    Held out: the files of ``eval.paths`` when given; for synthetic data the ``eval.num_prompts`` documents after
    ``data.num_samples`` (generated like the training ones); otherwise ``eval.num_prompts`` records of the data
    itself (at most a tenth of it), drawn by ``held_out_ids`` and never trained on, kept in ``held_out_file`` (a run's
    ``held_out.json``) from the first start on. Chat data is rendered with ``tokenizer``, else ``data.tokenizer``,
    else the target's.
    """
    data = cfg.data
    if data.format == "synthetic" and data.vocab_size is None:
        # Keep the last id free: with no tokenizer it is the drafter's mask token.
        data = dataclasses.replace(data, vocab_size=target_vocab_size - 1)
    if tokenizer is None and data.format == "chat" and data.tokenizer is None and cfg.target.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    count = cfg.eval.num_prompts
    if data.format == "synthetic":
        extended = build_data_source(dataclasses.replace(data, num_samples=data.num_samples + count))
        return build_data_source(data), SubsetSource(extended, np.arange(data.num_samples, data.num_samples + count))
    source = build_data_source(data, tokenizer=tokenizer)
    if cfg.eval.paths:
        try:
            held = build_data_source(dataclasses.replace(data, paths=list(cfg.eval.paths)), tokenizer=tokenizer)
        except DataError as error:  # the same readers as data.paths: name the key the user wrote
            raise DataError(str(error).replace("data.paths", "eval.paths", 1)) from None
        return source, held
    return split_held_out(source, count, data.shuffle_seed, held_out_file)

"""Chat records as OpenAI messages: where a record keeps its conversation and what its messages call the speaker
and the text (``ChatLayout``: OpenAI ``{"messages": [{"role", "content"}, ...]}`` and the record's ``tools``,
ShareGPT, UltraChat, or keys the config names), the checks a conversation must pass (an assistant turn; with
``synthesize.turns = "all"`` turns the target can write in order) and the records of chat data's files read so
(``chat_records``; the files themselves: producer/data/files.py). Rendering them: producer/data/render.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.config import DataConfig
from producer.data.files import BadRecord, DataError, FileRecords, JsonlRecords, Records, entry_files, open_records

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
    """The chat records of ``paths`` (files and dataset folders: producer/data/files.py) as ``config`` lays them out;
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

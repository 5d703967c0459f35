"""Chat rendering: a conversation through the target's chat template to token ids and the mask of its assistant
turns (``render_chat``), and ``ChatSource``, the chat records of data.paths (producer/data/chat.py) rendered so.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from common.config import DataConfig
from producer.data.chat import ChatRecords, record_tools, validate_messages
from producer.data.files import BadRecord
from producer.data.sources import DataSource

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# An empty reasoning block where an answer starts (Qwen3 / Qwen3.5 templates insert one when a turn has no
# reasoning): the target never generates it after a thinking-off prompt, so it is no training target.
_EMPTY_THINK = re.compile(r"(?:<think>)?\s*</think>\s*")


def _common_prefix_length(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def template_kwargs_of(record: Any, template_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``template_kwargs`` with the record's tool definitions added, if it has some."""
    tools = record_tools(record)
    return {**template_kwargs, "tools": tools} if tools else dict(template_kwargs)


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


class ChatSource(DataSource):
    """Chat records (JSONL lines, Parquet or Arrow rows: producer/data/files.py) rendered with the target's chat
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

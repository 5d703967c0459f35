"""The ``[data]`` section: where documents come from and how long they may be."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .base import require

SourceFormat = Literal["chat", "tokenized", "synthetic"]


LengthMode = Literal["chat", "fixed"]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "tool_call")
"""What ``data.role_names`` maps a speaker to: a chat template's roles, and ``tool_call`` for an assistant turn whose
text is a JSON tool call (ShareGPT's ``function_call``)."""


@dataclass
class DataConfig:
    """Where documents come from and how they are cut to length."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "format": "producer",
        "paths": "producer",
        "max_seq_len": "producer",
        "too_long": "producer",
        "chat_template_kwargs": "producer",
        "vocab_size": "producer",
        "num_samples": "producer",
        "seed": "producer",
        "shuffle_seed": "producer",
        "length_mode": "producer",
        "mean_len": "producer",
        "min_len": "producer",
        "max_step": "producer",
        "tokenizer": "producer launcher",
        "regenerate": "producer",
        "cache_mb": "producer",
        "messages_key": "producer",
        "role_key": "producer",
        "content_key": "producer",
        "role_names": "producer",
        "split": "producer",
    }

    format: SourceFormat = "synthetic"
    """"chat" (conversations in JSONL, Parquet or a Hugging Face dataset folder), "tokenized" (JSONL or parquet
    input_ids) or "synthetic"."""
    paths: list[str] = field(default_factory=list)
    """Files for chat/tokenized, in order; glob patterns expand to their sorted matches. Chat data may also name a
    folder: one written by datasets' save_to_disk (Dataset or DatasetDict), or of Parquet, Arrow or JSONL files (a
    hub snapshot); docs/conversations.md "Datasets as you hold them"."""
    max_seq_len: int = 3072
    """Longest document in tokens; longer ones are truncated or dropped (see too_long). Long contexts (32K to 128K,
    thinking and agentic traces) train in linear time and memory with sliding draft layers
    (drafter.layer_types, docs/internals.md "Long documents"); batching.token_budget must hold one such document."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with a document longer than max_seq_len."""
    tokenizer: str | None = None
    """Tokenizer path for chat data; None: the target's tokenizer."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (e.g. {enable_thinking = false})."""
    vocab_size: int | None = None
    """Token ids must be < vocab_size (checked for tokenized data; synthetic: None means the target's)."""
    num_samples: int = 10_000
    """Synthetic only: number of documents in the data set (one epoch)."""
    seed: int = 0
    """Synthetic only: seed of the document contents."""
    shuffle_seed: int = 0
    """Seed of the per-epoch order of documents and of batches inside a window."""
    length_mode: LengthMode = "chat"
    """Synthetic only: "chat" (log-normal lengths around mean_len) or "fixed" (all mean_len)."""
    mean_len: int = 1000
    """Synthetic only: mean document length in tokens (the length in fixed mode)."""
    min_len: int = 32
    """Synthetic only: shortest document in chat mode."""
    max_step: int = 63
    """Synthetic only: largest stride of the arithmetic runs (small strides are easier to learn)."""
    regenerate: bool = False
    """Chat only: the producers' target answers each record as the stream reaches it (its last user turn, or with
    ``synthesize.turns = "all"`` every assistant turn, docs/conversations.md), and those answers are trained on (on-policy data without a synthesis first; producer/regenerate.py). Generation follows
    the synthesize section (max_new_tokens, temperature, rows, ...); the answers are kept in RUN/regenerated, so
    a batch computed again after a restart holds the same documents."""
    cache_mb: int = 1024
    """Host memory (MiB, per producer) for documents already read and rendered, reused by later epochs and replays
    instead of reading and rendering them again; the first records read are kept until it is full. 0: none kept."""
    messages_key: str | None = None
    """Chat only: the key (JSONL) or column (Parquet, Arrow) holding a record's conversation; None: the first of
    messages, conversations, conversation and data that the record has."""
    role_key: str | None = None
    """Chat only: the key of a message's speaker; None: role (OpenAI), else from (ShareGPT)."""
    content_key: str | None = None
    """Chat only: the key of a message's text; None: content with role, value with from."""
    role_names: dict[str, str] = field(default_factory=dict)
    """Chat only: speaker names (matched without case) mapped to system, developer, user, assistant, tool or
    tool_call (an assistant turn whose text is a JSON tool call), over the defaults: human -> user; gpt, chatgpt,
    bing, bard, model -> assistant; observation, function_response -> tool; function_call -> tool_call. With role, a
    name neither maps is passed to the chat template as it is; with any other key it makes the record bad."""
    split: str | None = None
    """Chat only: the split read from a dataset folder of paths (a DatasetDict, or files named
    <split>-00000-of-00002.parquet); None: train, or the folder's only split. eval.paths names a split's folder or
    files."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        require(
            self.format in ("chat", "tokenized", "synthetic"),
            "format",
            f"must be 'chat', 'tokenized' or 'synthetic', got {self.format!r}",
        )
        require(
            self.format == "synthetic" or bool(self.paths),
            "paths",
            f"must name at least one file for format={self.format!r}",
        )
        require(self.max_seq_len >= 1, "max_seq_len", f"must be >= 1, got {self.max_seq_len}")
        require(
            self.too_long in ("truncate", "drop"), "too_long", f"must be 'truncate' or 'drop', got {self.too_long!r}"
        )
        require(self.vocab_size is None or self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        require(self.shuffle_seed >= 0, "shuffle_seed", "must be >= 0")
        require(self.max_step >= 1, "max_step", "must be >= 1")
        require(self.cache_mb >= 0, "cache_mb", f"must be >= 0, got {self.cache_mb}")
        require(not self.regenerate or self.format == "chat", "regenerate", f"needs format='chat', got {self.format!r}")
        for key in ("messages_key", "role_key", "content_key", "split"):
            value = getattr(self, key)
            require(
                value is None or (isinstance(value, str) and value != ""),
                key,
                f"must be a non-empty string, got {value!r}",
            )
            require(value is None or self.format == "chat", key, f"is read for format='chat' only, got {self.format!r}")
        require(
            isinstance(self.role_names, dict)
            and all(isinstance(name, str) and role in CHAT_ROLES for name, role in self.role_names.items()),
            "role_names",
            f"must map speaker names to one of {', '.join(CHAT_ROLES)}, got {self.role_names!r}",
        )
        require(
            not self.role_names or self.format == "chat",
            "role_names",
            f"is read for format='chat' only, got {self.format!r}",
        )
        if self.format == "synthetic":
            require(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
            require(
                self.length_mode in ("chat", "fixed"),
                "length_mode",
                f"must be 'chat' or 'fixed', got {self.length_mode!r}",
            )
            require(
                1 <= self.min_len <= self.mean_len <= self.max_seq_len,
                "mean_len",
                f"min_len <= mean_len <= max_seq_len must hold, got {self.min_len}, {self.mean_len}, {self.max_seq_len}",
            )

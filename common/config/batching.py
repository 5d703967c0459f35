"""The ``[batching]`` section: how producers pack documents into batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import require


@dataclass
class BatchingConfig:
    """How documents are grouped into token-budget batches (one batch = one ring slot)."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "token_budget": "producer trainer launcher",
        "max_docs_per_batch": "producer",
        "window_docs": "producer",
    }

    token_budget: int = 16384
    """Most tokens in one batch; sizes the ring slots (token_budget x bytes per token of the features, allocated once
    at the producer's start); must be >= data.max_seq_len, so that the longest document is one batch. A document
    longer than it is skipped and counted with its file:line; a shard where every one is stops the run (exit 2)."""
    max_docs_per_batch: int | None = None
    """Most documents in one batch; None for no limit."""
    window_docs: int = 512
    """Documents of the shard's order sorted by length together; larger groups lengths better
    but delays the samples of a window relative to the order by up to a window."""

    def __post_init__(self) -> None:
        require(self.token_budget >= 1, "token_budget", f"must be >= 1, got {self.token_budget}")
        require(
            self.max_docs_per_batch is None or self.max_docs_per_batch >= 1,
            "max_docs_per_batch",
            "must be >= 1 or unset",
        )
        require(self.window_docs >= 1, "window_docs", f"must be >= 1, got {self.window_docs}")

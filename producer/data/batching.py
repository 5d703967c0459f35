"""Token-budget batches, grouped by length, deterministic and resumable.

The shard's order (producer/data/order.py) is cut into windows of ``window_docs`` documents; windows never
straddle an epoch. Each window is split on its own: its good documents are sorted by length
(longest first), cut greedily into batches of at most ``token_budget`` tokens (and at most
``max_docs_per_batch`` documents), and the batches are emitted in an order shuffled by
(seed, epoch, shard, window). So a batch is identified by a :class:`BatchCursor`
``(epoch, window, index)`` and its sample ids are a pure function of it, the data and the
config: a checkpoint that committed through batch k lets the producer recompute exactly the
batches after it with ``iter_batches(k.next())``.

Packed batches hold no padding; the statistics report what padding to the longest document of
each batch would have cost (padding efficiency), since grouping by length is what keeps it low.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.batch import Document, PackedBatch
from common.config import BatchingConfig
from producer.data.files import DataError
from producer.data.order import ShardOrder
from producer.data.sources import DataSource

log = logging.getLogger(__name__)

LONGER_THAN_BATCH = "longer_than_token_budget"
"""The bad-record reason of a document longer than ``batching.token_budget``: it fits no batch and no ring slot."""


class BatchCursor(NamedTuple):
    """A batch position: batch ``index`` of window ``window`` of ``epoch``. Ordered like the stream."""

    epoch: int
    window: int
    index: int

    def next(self) -> BatchCursor:
        """The position after this one; ``iter_batches`` rolls it over windows and epochs."""
        return BatchCursor(self.epoch, self.window, self.index + 1)


@dataclass
class BatchStats:
    """Shape of one batch."""

    num_docs: int
    num_tokens: int
    max_doc_len: int

    @property
    def padded_tokens(self) -> int:
        """Tokens the batch would take padded to its longest document."""
        return self.num_docs * self.max_doc_len

    @property
    def padding_efficiency(self) -> float:
        return self.num_tokens / max(self.padded_tokens, 1)

    @property
    def mean_seq_len(self) -> float:
        return self.num_tokens / max(self.num_docs, 1)

    def as_dict(self) -> dict[str, float]:
        return {
            "batch_docs": self.num_docs,
            "batch_tokens": self.num_tokens,
            "padding_efficiency": self.padding_efficiency,
            "mean_seq_len": self.mean_seq_len,
        }


def batch_stats(batch: PackedBatch) -> BatchStats:
    lengths = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    return BatchStats(batch.num_docs, batch.num_tokens, int(lengths.max()) if lengths.numel() else 0)


@dataclass
class RunningBatchStats:
    """Totals over the batches seen so far."""

    batches: int = 0
    docs: int = 0
    tokens: int = 0
    padded_tokens: int = 0

    def update(self, stats: BatchStats) -> None:
        self.batches += 1
        self.docs += stats.num_docs
        self.tokens += stats.num_tokens
        self.padded_tokens += stats.padded_tokens

    def as_dict(self) -> dict[str, float]:
        batches = max(self.batches, 1)
        return {
            "batches": self.batches,
            "padding_efficiency": self.tokens / max(self.padded_tokens, 1),
            "mean_seq_len": self.tokens / max(self.docs, 1),
            "mean_batch_docs": self.docs / batches,
            "mean_batch_tokens": self.tokens / batches,
        }


def split_by_length(
    sample_ids: list[int], lengths: list[int], token_budget: int, max_docs: int | None
) -> list[list[int]]:
    """Sort documents longest first and cut them greedily into batches within the limits.

    Ties keep the given order, so the split is a pure function of its inputs.
    """
    order = np.argsort(-np.asarray(lengths, np.int64), kind="stable")
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in order.tolist():
        length = lengths[i]
        if length > token_budget:
            raise ValueError(f"document {sample_ids[i]} has {length} tokens > token_budget={token_budget}")
        if current and (tokens + length > token_budget or (max_docs is not None and len(current) >= max_docs)):
            batches.append(current)
            current, tokens = [], 0
        current.append(sample_ids[i])
        tokens += length
    if current:
        batches.append(current)
    return batches


def pack_documents(documents: list[Document], epoch: int = 0, meta: dict | None = None) -> PackedBatch:
    """Concatenate whole documents into a PackedBatch (no padding, no hidden states)."""
    lengths = np.asarray([len(d) for d in documents], np.int64)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate([d.input_ids for d in documents]).astype(np.int32, copy=False)),
        loss_mask=torch.from_numpy(np.concatenate([d.loss_mask for d in documents]).astype(np.uint8, copy=False)),
        cu_seqlens=torch.from_numpy(cu_seqlens),
        sample_ids=torch.tensor([d.sample_id for d in documents], dtype=torch.int64),
        epoch=epoch,
        meta=dict(meta or {}),
    )


class BatchPlan:
    """The batch stream of one shard: which sample ids form each batch, and their packing.

    Not thread-safe: use one plan per thread (they agree, being deterministic).
    """

    def __init__(self, source: DataSource, order: ShardOrder, config: BatchingConfig):
        if config.token_budget < source.config.max_seq_len:
            raise ValueError(
                f"batching.token_budget={config.token_budget} must be >= data.max_seq_len={source.config.max_seq_len}:"
                " a document of data.max_seq_len tokens is one batch, in one ring slot"
            )
        if order.num_samples != len(source):
            raise ValueError(f"order has {order.num_samples} samples but the data source has {len(source)}")
        self.source = source
        self.order = order
        self.config = config
        # Documents read while planning a window are reused when its batches are packed.
        self._documents: OrderedDict[int, Document] = OrderedDict()
        self._cache_capacity = 2 * config.window_docs
        self._planned: tuple[tuple[int, int], list[list[int]]] | None = None
        self._skipped_too_long: set[int] = set()

    def num_windows(self) -> int:
        """Windows per epoch (the last one may be short)."""
        return -(-self.order.epoch_length() // self.config.window_docs)

    def epoch_batches(self) -> int:
        """Batches of this shard's first epoch (later epochs have about as many): plans every window of it."""
        return sum(len(self.window_batches(0, window)) for window in range(self.num_windows()))

    def window_batches(self, epoch: int, window: int) -> list[list[int]]:
        """Sample ids of every batch of a window, in emission order (bad records left out)."""
        key = (epoch, window)
        if self._planned is not None and self._planned[0] == key:
            return self._planned[1]
        if not 0 <= window < self.num_windows():
            raise IndexError(f"window {window} out of range [0, {self.num_windows()})")
        start = window * self.config.window_docs
        window_ids = self.order.epoch_ids(epoch)[start : start + self.config.window_docs].tolist()
        self.source.prefetch([i for i in window_ids if i not in self._documents and i not in self.source.cache])
        documents = [d for d in (self._document(i) for i in window_ids) if d is not None and self._fits(d)]
        batches = split_by_length(
            [d.sample_id for d in documents],
            [len(d) for d in documents],
            self.config.token_budget,
            self.config.max_docs_per_batch,
        )
        # Longest-first emission would alternate long and short stretches; shuffle them instead.
        rng = np.random.default_rng([self.order.config.seed, epoch, self.order.config.shard_index, window])
        batches = [batches[i] for i in rng.permutation(len(batches))]
        self._planned = (key, batches)
        return batches

    def batch_at(self, cursor: BatchCursor) -> list[int]:
        """Sample ids of the batch at ``cursor`` (random access, for recompute on replay)."""
        return self.window_batches(cursor.epoch, cursor.window)[cursor.index]

    def iter_batches(self, start: BatchCursor = BatchCursor(0, 0, 0)) -> Iterator[tuple[BatchCursor, list[int]]]:
        """(cursor, sample ids) from ``start`` on, forever (epochs roll over).

        A start past the end of its window or epoch begins the next one, so ``committed.next()``
        is always a valid start.
        """
        epoch, window, index = start
        if min(start) < 0:
            raise ValueError(f"cursor fields must be >= 0, got {start}")
        while True:
            whole_epoch, empty_epoch = window == 0 and index == 0, True
            while window < self.num_windows():
                batches = self.window_batches(epoch, window)
                empty_epoch &= not batches
                for i in range(index, len(batches)):
                    yield BatchCursor(epoch, window, i), batches[i]
                window, index = window + 1, 0
            if whole_epoch and empty_epoch:
                raise self._no_good_document(epoch)
            epoch, window, index = epoch + 1, 0, 0

    def _fits(self, document: Document) -> bool:
        """Whether the document fits one batch; one that does not is skipped, counted once among the source's bad
        records and logged with its ``file:line`` (a source that keeps ``data.max_seq_len`` never makes one)."""
        if len(document) <= self.config.token_budget:
            return True
        if document.sample_id not in self._skipped_too_long:
            self._skipped_too_long.add(document.sample_id)
            stats = self.source.stats
            detail = f"{len(document)} tokens > batching.token_budget={self.config.token_budget}"
            stats.documents -= 1
            stats.bad[LONGER_THAN_BATCH] += 1
            where = self.source.location(document.sample_id)
            if len(stats.first_bad) < stats.keep_first_bad:
                stats.first_bad.append(f"{where} {LONGER_THAN_BATCH}: {detail}")
            log.warning("document %s (sample %d) skipped: %s", where, document.sample_id, detail)
        return False

    def _no_good_document(self, epoch: int) -> DataError:
        stats = self.source.stats
        files = getattr(getattr(self.source, "_files", None), "paths", None) or self.source.config.paths
        first = "; first bad: " + " | ".join(stats.first_bad) if stats.first_bad else ""
        # Every record too long for a batch, or for data.max_seq_len with data.too_long = "drop": that key says why.
        key = {frozenset({LONGER_THAN_BATCH}): "batching.token_budget", frozenset({"too_long"}): "data.max_seq_len"}
        return DataError(
            f"{key.get(frozenset(stats.bad), 'data.paths')}: epoch {epoch} of shard {self.order.config.shard_index} "
            "has no good document among the "
            f"{self.order.epoch_length()} records of {', '.join(map(str, files)) or 'the source'} "
            f"(bad: {dict(stats.bad) or 'none'}){first}"
        )

    def materialize(self, cursor: BatchCursor, sample_ids: list[int]) -> PackedBatch:
        """The packed batch of these sample ids; meta carries the cursor."""
        documents = []
        for sample_id in sample_ids:
            document = self._document(sample_id)
            if document is None:
                where = self.source.location(sample_id)
                raise RuntimeError(f"sample {sample_id} was planned but its record is bad now ({where})")
            documents.append(document)
        return pack_documents(documents, epoch=cursor.epoch, meta={"cursor": list(cursor)})

    def _document(self, sample_id: int) -> Document | None:
        if sample_id in self._documents:
            self._documents.move_to_end(sample_id)
            return self._documents[sample_id]
        document = self.source.get(sample_id)
        if document is not None:
            self._documents[sample_id] = document
            if len(self._documents) > self._cache_capacity:
                self._documents.popitem(last=False)
        return document

"""Data sources: documents addressed by a stable global sample id.

Every source maps a sample id (0 .. len-1) to a :class:`Document` (token ids + loss mask) and
can re-read any id at random, which the producer needs to recompute batches on replay:

- ``chat``: conversations read from files (producer/data/chat.py) and rendered with the target tokenizer's chat
  template (producer/data/render.py ``ChatSource``); the loss mask covers the assistant turns only.
- ``tokenized``: JSONL or parquet rows with ``input_ids`` and an optional ``loss_mask``.
- ``synthetic``: a generator with learnable structure; sample i is a pure function of (seed, i).

For files, the sample id is the record index across the listed files in order (line i of a
JSONL file is one record, blank lines included, so ids never shift when a line is bad; row i of a table).
A bad record (invalid JSON, wrong types, empty, too long with the ``drop`` policy, no loss
tokens) is logged with its file and line, counted in :class:`DataStats` and skipped: ``get``
returns ``None``. It never stops the producer.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.batch import Document
from common.config import DataConfig
from producer.data.files import BadRecord, FileRecords, JsonlRecords, RecordFiles

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
# Token files


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

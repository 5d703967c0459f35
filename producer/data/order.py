"""Deterministic, sharded, seekable order of sample ids.

Epoch e of the data set is one permutation of all sample ids, a pure function of (seed, e).
Producer p of P takes every P-th entry of it (``perm[p::P]``): the shards are disjoint, their
union is the whole epoch, and every epoch mixes differently across producers. A position in a
shard's order is an :class:`OrderCursor` (epoch, index in this shard's epoch); seeking is an
index into the cached permutation, and iteration rolls over into the next epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass
class OrderConfig:
    """How the data order is shuffled and split across producers."""

    seed: int = 0
    """Seed of the per-epoch permutations (and of the batch order inside a window)."""
    num_shards: int = 1
    """Number of producers that split each epoch."""
    shard_index: int = 0
    """This producer's shard, 0 <= shard_index < num_shards."""

    def __post_init__(self) -> None:
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard_index must be in [0, {self.num_shards}), got {self.shard_index}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


class OrderCursor(NamedTuple):
    """A position in one shard's order: the next sample is entry ``position`` of ``epoch``."""

    epoch: int
    position: int


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """All sample ids in the order of ``epoch``; int64 [num_samples]."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class ShardOrder:
    """The order of one shard's sample ids, epoch after epoch."""

    def __init__(self, num_samples: int, config: OrderConfig):
        if num_samples < config.num_shards:
            raise ValueError(f"{num_samples} samples cannot feed num_shards={config.num_shards} producers")
        self.num_samples = num_samples
        self.config = config
        self._cached_epoch: int | None = None
        self._cached_ids: np.ndarray | None = None

    def epoch_ids(self, epoch: int) -> np.ndarray:
        """This shard's sample ids of ``epoch`` in order (computed once per epoch, then cached)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self._cached_epoch:
            permutation = epoch_permutation(self.num_samples, self.config.seed, epoch)
            self._cached_ids = permutation[self.config.shard_index :: self.config.num_shards]
            self._cached_epoch = epoch
        return self._cached_ids

    def epoch_length(self) -> int:
        """Samples of this shard per epoch (the same every epoch)."""
        n, p, i = self.num_samples, self.config.num_shards, self.config.shard_index
        return (n - i + p - 1) // p

    def iter_from(self, start: OrderCursor = OrderCursor(0, 0)) -> Iterator[tuple[OrderCursor, int]]:
        """(cursor, sample id) from ``start`` on, forever; the cursor is the sample's own position."""
        epoch, position = start
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        while True:
            ids = self.epoch_ids(epoch)
            for index in range(position, len(ids)):
                yield OrderCursor(epoch, index), int(ids[index])
            epoch, position = epoch + 1, 0

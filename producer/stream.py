"""Which batch a producer computes next, so that every batch is trained exactly once.

Batches of a shard's stream are numbered by their ordinal: the position of the batch in the
deterministic stream (``BatchPlan.iter_batches`` from the start). A trainer commits, per producer,
a prefix of ordinals plus a few beyond it (the format: common/committed.py).

When a trainer incarnation says HELLO with its committed state, the producer reconciles:
ready slots holding committed batches are dropped; batches it produced that are neither committed
nor still in the ring (a dead trainer consumed them after its last checkpoint) are queued for
recompute; committed ordinals ahead are skipped. The stream then continues. A producer that starts
fresh begins from the committed state of the latest checkpoint (or the stream start).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from common.committed import read_committed
from producer.data.batching import BatchCursor, BatchPlan


@dataclass(frozen=True)
class PlannedBatch:
    ordinal: int
    cursor: BatchCursor
    sample_ids: list[int]
    replay: bool = False


def parse_committed(committed: dict | None) -> tuple[int, BatchCursor | None, set[int]]:
    """(next ordinal, cursor of the ordinal before it, committed ordinals beyond) from a HELLO/checkpoint."""
    ordinal, last, extra = read_committed(committed)
    return ordinal, BatchCursor(*last) if last is not None else None, extra


class BatchStream:
    """Thread-safe source of the next batch to compute (compute thread) and reconciliation (server thread)."""

    def __init__(self, plan: BatchPlan, committed: dict | None = None) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self._history: dict[int, BatchCursor] = {}
        """Ordinal -> cursor of every batch handed out and not yet known to be committed."""
        self._replay: list[int] = []
        self._in_flight: set[int] = set()
        self._skip: set[int] = set()
        self._committed_below = 0
        self._committed_extra: set[int] = set()
        self._next_ordinal = 0
        self._iter: Iterator[tuple[BatchCursor, list[int]]] = iter(())
        self.replayed = 0
        self._seek(*parse_committed(committed))

    def _seek(self, ordinal: int, last_cursor: BatchCursor | None, extra: set[int]) -> None:
        start = last_cursor.next() if last_cursor is not None else BatchCursor(0, 0, 0)
        self._iter = self.plan.iter_batches(start)
        self._next_ordinal = ordinal
        self._committed_below = ordinal
        self._committed_extra = set(extra)
        self._skip = set(extra)

    def take(self) -> PlannedBatch:
        """The next batch to compute: queued replays first, then the stream (committed ones skipped)."""
        with self._lock:
            if self._replay:
                ordinal = self._replay.pop(0)
                cursor = self._history[ordinal]
                self._in_flight.add(ordinal)
                self.replayed += 1
                return PlannedBatch(ordinal, cursor, self.plan.batch_at(cursor), replay=True)
            while True:
                cursor, sample_ids = next(self._iter)
                ordinal = self._next_ordinal
                self._next_ordinal += 1
                if ordinal < self._committed_below or ordinal in self._skip:
                    self._skip.discard(ordinal)  # committed while we were behind: never computed
                    continue
                self._history[ordinal] = cursor
                self._in_flight.add(ordinal)
                return PlannedBatch(ordinal, cursor, sample_ids)

    def publish(self, ordinal: int, publish: Callable[[], None], drop: Callable[[], None]) -> bool:
        """Announce a computed batch (``publish``), or ``drop`` it if a trainer committed it meanwhile.

        Atomic with ``reconcile``: a batch is in flight or in the ring, never neither, so a
        reconciliation can never miss it (the trainer may consume and ack it the moment it is out).
        Lock order: this stream's lock, then the ring's.
        """
        with self._lock:
            self._in_flight.discard(ordinal)
            if self._is_committed(ordinal):
                drop()
                return False
            publish()
            return True

    def committed_snapshot(self) -> Callable[[int], bool]:
        """A lock-free test of the current committed state (for use under the ring's lock)."""
        with self._lock:
            below, extra = self._committed_below, frozenset(self._committed_extra)
        return lambda ordinal: ordinal < below or ordinal in extra

    def _is_committed(self, ordinal: int) -> bool:
        return ordinal < self._committed_below or ordinal in self._committed_extra

    def reconcile(self, committed: dict | None, ring_ordinals: Callable[[], set[int]]) -> int:
        """Apply a new trainer incarnation's committed state; returns how many batches go to replay.

        ``ring_ordinals()``: ordinals now READY or LEASED in the ring (they will be served again as
        they are), read under this stream's lock so that no publish slips in between.
        """
        ordinal, last_cursor, extra = parse_committed(committed)
        with self._lock:
            in_ring = ring_ordinals()
            if ordinal > self._next_ordinal:
                # The trainer is ahead of us (we restarted from an older checkpoint): jump forward.
                self._history.clear()
                self._replay.clear()
                self._seek(ordinal, last_cursor, extra)
                return 0
            self._committed_below = ordinal
            self._committed_extra = set(extra)
            self._skip = {o for o in extra if o >= self._next_ordinal}
            for old in [o for o in self._history if self._is_committed(o)]:
                del self._history[old]
            lost = [o for o in self._history if o not in in_ring and o not in self._in_flight and o not in self._replay]
            self._replay = sorted(set(self._replay + lost) - {o for o in self._replay if self._is_committed(o)})
            return len(lost)

    def forget_committed(self, committed: dict | None) -> int:
        """Drop from the record of handed-out batches those a checkpoint committed; returns how many.

        Otherwise the record (what ``reconcile`` replays from) grows by one entry per batch for as
        long as one trainer incarnation lives, since only a HELLO prunes it. Only the record shrinks:
        a later trainer resumes from this checkpoint or a newer one, so it never needs these again.
        """
        ordinal, _, extra = parse_committed(committed)
        with self._lock:
            done = [o for o in self._history if (o < ordinal or o in extra) and o not in self._replay]
            for o in done:
                del self._history[o]
            return len(done)

    def position(self) -> dict:
        with self._lock:
            return {
                "next_ordinal": self._next_ordinal,
                "replay_queue": len(self._replay),
                "replayed": self.replayed,
                "history": len(self._history),
            }

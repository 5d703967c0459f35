"""What a producer measures of itself and shows: the batches it packed, its tokens per second and the share of time
its ring was full over the last ten seconds (its fields of ``ProducerStats``, common/metrics.py, sent in each
heartbeat), and its status file, RUN/producers/p{I}.json, about once a second.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from common.batch import PackedBatch
from common.metrics import ProducerStats
from common.ring import RingBuffer
from common.status import ProducerStatus
from producer.data.batching import BatchPlan, BatchStats, RunningBatchStats, batch_stats
from producer.stream import BatchStream
from producer.target_model.capture import Target
from producer.target_model.tensor_parallel import TensorParallelGroup

THROUGHPUT_WINDOW_S = 10.0
"""The span over which tokens per second and the blocked share are measured."""


class ProducerFigures:
    """A producer's figures; its publisher thread records, its server's and status threads read."""

    def __init__(self, plan: BatchPlan, stream: BatchStream, epoch_batches: int | None) -> None:
        """``epoch_batches``: the batches of an epoch of this shard, shown when the trainer sizes the run by them."""
        self.plan, self.stream, self.epoch_batches = plan, stream, epoch_batches
        self.batching = RunningBatchStats()
        self.shown: dict[str, Any] = {}
        """What the status shows of the producer's start (``started``)."""
        self._published: deque[tuple[float, int, float]] = deque()  # (when, tokens, the ring's blocked seconds then)
        self._lock = threading.Lock()

    def started(
        self,
        target: Target,
        group: TensorParallelGroup | None,
        ring: RingBuffer,
        endpoint: str,
        load_s: float,
    ) -> None:
        """Record what the status shows of the start: the target's devices and kernels, the ring, the endpoint."""
        self.shown = dict(
            ring={"backend": ring.backend, "slot_bytes": ring.slot_bytes},
            pid=os.getpid(),
            torchrun_pid=group.torchrun_pid if group else None,  # the launcher knows a tensor-parallel producer by it
            tensor_parallel={"size": group.size, "pids": group.pids} if group else None,
            endpoint=endpoint,
            load_s=round(load_s, 2),
            device=",".join(group.devices) if group is not None else str(target.device),
            kernels={"attention": target.attention, "linear_attention": target.linear, "compiled": target.compiled},
        )

    def packed(self, batch: PackedBatch) -> BatchStats:
        """Count a batch packed for a slot; its figures."""
        stats = batch_stats(batch)
        self.batching.update(stats)
        return stats

    def published(self, tokens: int, blocked_s: float) -> None:
        """Count a batch of ``tokens`` published, the ring's blocked seconds being ``blocked_s`` by then."""
        with self._lock:
            self._published.append((time.monotonic(), tokens, blocked_s))

    def throughput(self) -> dict[str, Any]:
        """The producer's figures of its ``ProducerStats``, by field (the server's ``stats`` callback)."""
        now = time.monotonic()
        with self._lock:
            while self._published and now - self._published[0][0] > THROUGHPUT_WINDOW_S:
                self._published.popleft()
            window = list(self._published)
        tokens_per_s, blocked = 0.0, 0.0
        span = window[-1][0] - window[0][0] if len(window) >= 2 else 0.0
        if span > 0:
            tokens_per_s = sum(t for _, t, _ in window[1:]) / span
            blocked = (window[-1][2] - window[0][2]) / span
        return {
            "tokens_per_s": round(tokens_per_s, 1),
            "blocked_fraction": round(min(1.0, blocked), 4),
            "batching": self.batching.as_dict(),
            "data": {**self.plan.source.stats.as_dict(), **self.plan.source.cache.as_dict()},
            "stream": self.stream.position(),
        }

    def write_status(self, path: Path, producer_id: int, stats: ProducerStats, jobs: dict, ready: bool) -> None:
        """The status file: ``stats`` (the ring's counts, the server's counters and these figures), the jobs'
        states and what the start showed."""
        ProducerStatus.showing(
            stats,
            id=producer_id,
            ready=ready,
            updated=time.time(),
            jobs=jobs,
            epoch_batches=self.epoch_batches,
            **self.shown,
        ).write(path)

"""A producer's ring: its slots in shared memory (host, or the target's GPU), the endpoint trainers reach it at, and
the headroom it keeps free while they take batches (``ring.headroom_slots``). The server that leases the slots is
common/transport.py's ``RingServer``.
"""

from __future__ import annotations

import threading
import time

import torch

from common.batch import SlotFormat
from common.config import RingConfig, RunConfig
from common.naming import owner_identity, run_tag, sweep_stale
from common.ring import RingBuffer, create_ring
from common.rundir import RunDir
from common.slots import SlotTable
from common.sockets import ipc_endpoint


def open_ring(
    cfg: RunConfig,
    run_dir: RunDir,
    producer_id: int,
    slot_format: SlotFormat,
    device: torch.device,
    listen: str | None,
) -> RingBuffer:
    """The producer's ring: ``ring.num_slots`` slots, each large enough for any batch the batching config makes.
    ``ring.backend = "auto"``: on the target's GPU, unless the consumers are on other hosts (``listen``), who need the
    bytes in host memory (sent as frames)."""
    batching = cfg.batching
    slot_bytes = slot_format.slot_bytes(batching.token_budget, batching.max_docs_per_batch or batching.token_budget)
    backend = cfg.ring.backend
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" and listen is None else "host"
    return create_ring(
        backend,
        num_slots=cfg.ring.num_slots,
        slot_bytes=slot_bytes,
        run_tag=run_tag(run_dir.root),
        role=f"p{producer_id}",
        device=(device.index or 0) if device.type == "cuda" else 0,
    )


def ring_endpoint(run_dir: RunDir, producer_id: int, listen: str | None) -> str:
    """Where trainers reach the producer: ``listen`` (tcp, for other hosts), else an ipc socket in DIR/sockets (the
    sockets a dead producer left swept first)."""
    run_dir.sockets.mkdir(parents=True, exist_ok=True, mode=0o700)
    sweep_stale(run_dir.sockets, prefix=f"p{producer_id}.", suffix=".ipc")
    return listen or ipc_endpoint(run_dir.sockets / f"p{producer_id}.{owner_identity()}.ipc")


class Headroom:
    """``ring.headroom_slots``: slots kept free while the consumers keep taking batches, filled when they pause."""

    def __init__(self, config: RingConfig, slots: SlotTable, stop: threading.Event) -> None:
        self.config, self.slots, self.stop = config, slots, stop
        self._leases_seen, self._last_lease = 0, float("-inf")

    def may_fill(self) -> bool:
        """Whether to fill a slot now: always, unless the headroom is to be kept free (see
        RingConfig.headroom_slots)."""
        if self.config.headroom_slots == 0:
            return True
        counters, now = self.slots.counters, time.monotonic()
        if counters.leased != self._leases_seen:
            self._leases_seen, self._last_lease = counters.leased, now
        if now - self._last_lease > self.config.pause_detect_s:
            return True  # consumers paused or absent: fill the headroom for them
        return self.slots.counts()["free"] > self.config.headroom_slots

    def hold_back(self, seconds: float) -> None:
        """Wait while the headroom is kept free; counted as blocked time (the ring is full enough)."""
        self.stop.wait(seconds)
        self.slots.counters.blocked_s += seconds  # only the filling thread writes blocked_s

"""The ``[ring]`` section: the shared-memory rings between producers and the trainer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import require


@dataclass
class RingConfig:
    """Each producer's ring and the protocol timings."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "backend": "producer",
        "num_slots": "producer",
        "credits": "trainer",
        "heartbeat_interval_s": "producer trainer",
        "heartbeat_timeout_s": "producer trainer",
        "handshake_timeout_s": "trainer",
        "headroom_slots": "producer",
        "pause_detect_s": "producer",
    }

    backend: Literal["auto", "host", "cuda"] = "auto"
    """Where slots live: host (/dev/shm), cuda (GPU memory by CUDA IPC); auto: cuda when the producer has a GPU."""
    num_slots: int = 4
    """Slots per ring; each holds one batch of batching.token_budget tokens."""
    credits: int = 2
    """Batches a consumer may hold at once (its prefetch depth)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats, both ways."""
    heartbeat_timeout_s: float = 10.0
    """Silence after which a peer is dead and its leases go back to the ring."""
    handshake_timeout_s: float = 60.0
    """How long a consumer waits for WELCOME."""
    headroom_slots: int = 0
    """Slots a producer keeps free while its consumers keep taking batches, filled only when they
    pause (no lease for ``pause_detect_s``) or are absent. On a GPU shared with a trainer rank this
    moves target work into the trainer's pauses (checkpoints, evaluations) instead of competing
    with its steps; after a pause the trainer trains from the backlog with the GPU to itself.
    0: always fill the whole ring (right for a producer with a GPU of its own)."""
    pause_detect_s: float = 1.0
    """Seconds without a lease after which a producer treats its consumers as paused (see headroom_slots)."""

    def __post_init__(self) -> None:
        require(
            self.backend in ("auto", "host", "cuda"), "backend", f"must be auto, host or cuda, got {self.backend!r}"
        )
        require(self.num_slots >= 1, "num_slots", "must be >= 1")
        require(
            0 <= self.headroom_slots < self.num_slots, "headroom_slots", f"must be in [0, num_slots={self.num_slots})"
        )
        require(self.pause_detect_s > 0, "pause_detect_s", "must be > 0")
        require(self.credits >= 1, "credits", "must be >= 1")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        require(
            self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            "must exceed twice heartbeat_interval_s",
        )
        require(self.handshake_timeout_s > 0, "handshake_timeout_s", "must be > 0")

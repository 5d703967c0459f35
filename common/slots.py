"""Slot ownership: the state machine of a ring's slots. Lives in the producer process only.

    FREE -> FILLING -> READY (announced) -> LEASED (to one consumer) -> FREE (acked)

Each fill gets a new generation number and the next sequence number; an ack must name the slot,
its generation and come from the consumer that holds the lease, or it is ignored. Reclaimed leases go back to READY in front of
newer batches, oldest first. Thread-safe: the compute thread fills, the server thread leases.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from enum import IntEnum

SEND_POLL_S = 0.002  # how often a filler held by a queued zero-copy send looks again


class SlotState(IntEnum):
    FREE = 0
    FILLING = 1
    READY = 2
    LEASED = 3


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    generation: int = 0
    seq: int = -1
    """Fill order (given at acquire, so the announcement can be built before publish); READY slots
    are served lowest first."""
    holder: object = None
    """Consumer key of the lease (LEASED only)."""
    payload: object = None
    """What the filler attached at publish (layout and metadata)."""
    sending: list = field(default_factory=list)
    """Zero-copy sends of this slot's bytes that may still be queued in ZeroMQ (their MessageTrackers): the
    slot is not refilled before they are done, whatever happened to the leases meanwhile."""


@dataclass
class Lease:
    slot: int
    generation: int
    seq: int
    payload: object


@dataclass
class SlotCounters:
    published: int = 0
    leased: int = 0
    released: int = 0
    reclaimed: int = 0
    discarded: int = 0
    stale_acks: int = 0
    held_for_send: int = 0
    """Times the filler found a free slot whose bytes a queued zero-copy send still reads (it waited)."""
    blocked_s: float = 0.0
    """Seconds the filler waited for a free slot (backpressure)."""


class SlotTable:
    """Thread-safe slot states for one ring."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self._slots = [Slot(i) for i in range(num_slots)]
        self._cond = threading.Condition()
        self._next_seq = 0
        self._next_generation = 1
        self.counters = SlotCounters()

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def acquire(self, timeout: float | None = None) -> int | None:
        """FREE -> FILLING. Waits up to ``timeout`` for a free slot (counted as blocked time); a free slot
        whose bytes a zero-copy send may still read (``mark_sending``) waits for that send."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            started = time.monotonic()
            try:
                while True:
                    held = False
                    for slot in self._slots:
                        if slot.state is SlotState.FREE and slot.sending:
                            slot.sending = [t for t in slot.sending if not t.done]
                            if slot.sending:
                                held = True
                                continue
                        if slot.state is SlotState.FREE:
                            slot.state = SlotState.FILLING
                            slot.generation = self._next_generation
                            self._next_generation += 1
                            slot.seq = self._next_seq
                            self._next_seq += 1
                            return slot.index
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    if held:  # a send's end is not notified: look again shortly
                        self.counters.held_for_send += 1
                        remaining = SEND_POLL_S if remaining is None else min(remaining, SEND_POLL_S)
                    self._cond.wait(remaining)
            finally:
                self.counters.blocked_s += time.monotonic() - started

    def filling(self, index: int) -> tuple[int, int]:
        """(generation, seq) of a FILLING slot."""
        with self._cond:
            slot = self._slots[index]
            if slot.state is not SlotState.FILLING:
                raise RuntimeError(f"slot {index} is {slot.state.name}, not FILLING")
            return slot.generation, slot.seq

    def publish(self, index: int, payload: object) -> int:
        """FILLING -> READY. Returns the slot's sequence number."""
        with self._cond:
            slot = self._slots[index]
            if slot.state is not SlotState.FILLING:
                raise RuntimeError(f"slot {index} is {slot.state.name}, not FILLING")
            slot.state = SlotState.READY
            slot.payload = payload
            self.counters.published += 1
            self._cond.notify_all()
            return slot.seq

    def abort(self, index: int) -> None:
        """FILLING -> FREE (the filler gave up on this slot)."""
        with self._cond:
            slot = self._slots[index]
            if slot.state is SlotState.FILLING:
                self._free(slot)

    def lease_next(self, holder: object) -> Lease | None:
        """READY -> LEASED for the oldest ready slot, or None if none is ready."""
        with self._cond:
            slot = None
            for candidate in self._slots:
                if candidate.state is SlotState.READY and (slot is None or candidate.seq < slot.seq):
                    slot = candidate
            if slot is None:
                return None
            slot.state = SlotState.LEASED
            slot.holder = holder
            self.counters.leased += 1
            return Lease(slot.index, slot.generation, slot.seq, slot.payload)

    def release(self, holder: object, index: int, generation: int, notify: bool = True) -> bool:
        """LEASED -> FREE if ``holder`` holds this slot at this generation; else ignored.

        With ``notify=False`` a filler waiting in ``acquire`` is not woken until ``wake``: the server
        thread first sends its next lease, then lets the filler compete for the CPU.
        """
        with self._cond:
            if not 0 <= index < len(self._slots):
                self.counters.stale_acks += 1
                return False
            slot = self._slots[index]
            if slot.state is not SlotState.LEASED or slot.generation != generation or slot.holder != holder:
                self.counters.stale_acks += 1
                return False
            self._free(slot, notify)
            self.counters.released += 1
            return True

    def mark_sending(self, index: int, tracker: object) -> None:
        """A zero-copy send of slot ``index`` left for ZeroMQ; ``tracker.done`` says when it no longer reads it."""
        with self._cond:
            self._slots[index].sending.append(tracker)

    def unlease(self, holder: object, index: int, generation: int) -> bool:
        """LEASED -> READY for one lease whose announcement never left (it keeps its place in front)."""
        with self._cond:
            slot = self._slots[index]
            if slot.state is not SlotState.LEASED or slot.generation != generation or slot.holder != holder:
                return False
            slot.state = SlotState.READY
            slot.holder = None
            self.counters.reclaimed += 1
            return True

    def reclaim(self, holder: object) -> list[int]:
        """LEASED -> READY for every slot ``holder`` leased; they keep their order in front."""
        with self._cond:
            taken = [s for s in self._slots if s.state is SlotState.LEASED and s.holder == holder]
            for slot in taken:
                slot.state = SlotState.READY
                slot.holder = None
            self.counters.reclaimed += len(taken)
            if taken:
                self._cond.notify_all()
            return [s.index for s in taken]

    def discard_ready(self, predicate) -> list[object]:
        """READY -> FREE for ready slots whose payload matches ``predicate``; returns the payloads."""
        with self._cond:
            dropped = [s for s in self._slots if s.state is SlotState.READY and predicate(s.payload)]
            payloads = [s.payload for s in dropped]
            for slot in dropped:
                self._free(slot)
            self.counters.discarded += len(dropped)
            return payloads

    def payloads(self, *states: SlotState) -> list[object]:
        """Payloads of the slots in any of ``states`` (a snapshot)."""
        with self._cond:
            return [s.payload for s in self._slots if s.state in states]

    def counts(self) -> dict[str, int]:
        with self._cond:
            out = {state.name.lower(): 0 for state in SlotState}
            for slot in self._slots:
                out[slot.state.name.lower()] += 1
            return out

    def wake(self) -> None:
        """Wake a filler blocked in acquire (used at shutdown)."""
        with self._cond:
            self._cond.notify_all()

    def _free(self, slot: Slot, notify: bool = True) -> None:
        slot.state = SlotState.FREE
        slot.holder = None
        slot.payload = None
        if notify:
            self._cond.notify_all()

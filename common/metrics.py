"""A producer's statistics as one typed record, ``ProducerStats``, from where they are counted to where they are read.

The ring server counts its own (common/transport.py ``RingServer.stats``) and adds the producer's throughput
(producer/figures.py); the record travels in each HEARTBEAT as its ``stats`` map (``to_wire``), is written into the
producer's status file (common/status.py ``ProducerStatus.showing``) and logged by the trainer
(trainer/metrics.py ``producer_metrics``). A new statistic is a field here and the line that computes it.

``from_wire`` checks the type of every key it knows, gives a missing one its default and leaves out keys it does not
know, so that a statistic added or left out keeps the protocol's version (common/protocol.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Self, get_type_hints

LOGGED = {"logged": True}
"""A field's metadata: the trainer logs it as ``producer/<id>/<name>``."""
MAX_NUMBER = 1e15


@dataclass
class RingCounts:
    """A producer's ring slots by state."""

    slots: int = 0
    free: int = 0
    filling: int = 0
    ready: int = 0
    leased: int = 0

    def shares(self) -> dict[str, float]:
        """Each state's share of the slots."""
        slots = max(1, self.slots)
        return {state: count / slots for state, count in dataclasses.asdict(self).items() if state != "slots"}


@dataclass
class ProducerStats:
    """What a producer's HEARTBEAT says of it: its ring, its server's counters and its throughput."""

    producer_id: int = 0
    ring: RingCounts = field(default_factory=RingCounts)
    blocked_s: float = 0.0
    """Seconds the filler waited for a free slot (backpressure), since the start."""
    published: int = 0
    """Batches published into the ring."""
    reclaimed: int = 0
    """Leases taken back from consumers that left or fell silent."""
    released: int = 0
    """Slots freed by a consumer's ACK."""
    stale_acks: int = 0
    """ACKs of a lease that was no longer the consumer's."""
    consumers: int = 0
    """Consumers connected now."""
    messages: int = 0
    """Messages the server received."""
    dropped_malformed: int = 0
    """Messages dropped as not valid in the protocol."""
    dropped_unknown_peer: int = 0
    """Messages dropped from a peer that never said HELLO."""
    refused: int = 0
    """HELLOs refused (another target, malformed committed state, ...)."""
    socket_blocked: int = 0
    """Times a send would have blocked (it never does: the message is dropped or the lease undone)."""
    internal_errors: int = 0
    """Valid messages whose handling raised (a bug, logged with its traceback); zero in every test."""
    max_busy_s: float = 0.0
    """Longest stretch the server thread spent handling messages without returning to its poll."""
    tokens_per_s: float = field(default=0.0, metadata=LOGGED)
    """Tokens published per second over the last 10 s."""
    blocked_fraction: float = field(default=0.0, metadata=LOGGED)
    """The share of the last 10 s the producer waited for a free slot (the trainer is the bottleneck)."""
    batching: dict[str, float] = field(default_factory=dict)
    """Its batches' shape so far (batches, padding efficiency, mean length, documents and tokens a batch)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Its data source's counters and cache."""
    stream: dict[str, Any] = field(default_factory=dict)
    """Its position in the batch stream."""

    @classmethod
    def logged(cls) -> tuple[str, ...]:
        """The fields the trainer logs as they are."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("logged"))

    def to_wire(self) -> dict[str, Any]:
        """The HEARTBEAT's ``stats`` map: a key a field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, wire: object) -> Self:
        """The record a ``stats`` map describes; raises ValueError, naming the key, where a value has the wrong type."""
        return _parsed(cls, wire, "stats")


def _parsed(record: type, wire: object, where: str) -> Any:
    if type(wire) is not dict:
        raise ValueError(f"field {where!r} must be a map")
    values = {}
    for spec in dataclasses.fields(record):
        if spec.name in wire:
            values[spec.name] = _value(_FIELD_TYPES[record][spec.name], wire[spec.name], f"{where}.{spec.name}")
    return record(**values)


def _value(kind: Any, value: object, where: str) -> Any:
    if kind is int:
        if type(value) is not int or value < 0:
            raise ValueError(f"field {where!r} must be a non-negative integer")
        return value
    if kind is float:
        if type(value) not in (int, float) or not math.isfinite(value) or not 0.0 <= value <= MAX_NUMBER:
            raise ValueError(f"field {where!r} must be a finite number in [0, {MAX_NUMBER:g}]")
        return value
    if kind is RingCounts:
        return _parsed(RingCounts, value, where)
    if type(value) is not dict:
        raise ValueError(f"field {where!r} must be a map")
    if kind == dict[str, float]:
        for key, number in value.items():
            _value(float, number, f"{where}.{key}")
    return value


_FIELD_TYPES = {record: get_type_hints(record) for record in (RingCounts, ProducerStats)}
"""Each record's fields' types, resolved once: a HEARTBEAT is parsed every second."""

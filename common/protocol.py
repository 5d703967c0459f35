"""Wire protocol between producers and consumers: typed messages, msgpack, strict validation.

Every frame is a msgpack map ``{"v": PROTOCOL_VERSION, "t": <type>, <fields>...}``. ``decode``
checks the size, the version, the type and every field (type, range, length) before a message
object exists; anything else raises ProtocolError, which receivers log and drop. No pickle, no
eval: dtype names and message types are looked up in fixed tables.

Conversation (consumer = DEALER, producer = ROUTER):
    consumer HELLO  -> producer WELCOME | REFUSE
    producer BATCH  (one per lease, only while the consumer has credit)
    consumer ACK    (slot released; the consumer never reads it again; may carry credit)
    consumer CREDIT (room for n more batches)
    both     HEARTBEAT (producer's carries its statistics)
    consumer BYE    (leases go back to the ring at once)
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import msgpack

from common.codec import LayoutError, TensorSpec

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
MAX_STR = 4096
MAX_COLLECTION = 4096
MAX_DEPTH = 6
MAX_INT = 2**63 - 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


class VersionMismatch(ProtocolError):
    def __init__(self, theirs: object) -> None:
        super().__init__(f"peer speaks protocol version {theirs!r}, this process speaks {PROTOCOL_VERSION}")
        self.theirs = theirs


# -- field checks -------------------------------------------------------------------------------


def _int(name: str, value: object, lo: int = 0, hi: int = MAX_INT) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} must be an integer in [{lo}, {hi}]")
    return value


def _float(name: str, value: object, lo: float = 0.0, hi: float = 1e9) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} must be a finite number in [{lo}, {hi}]")
    return float(value)


def _str(name: str, value: object, max_len: int = MAX_STR) -> str:
    if type(value) is not str or len(value) > max_len:
        raise ProtocolError(f"field {name!r} must be a string of at most {max_len} characters")
    return value


def _plain(name: str, value: object, depth: int = 0) -> object:
    """JSON-like data: None, bool, int, float, str, lists and string-keyed maps, bounded."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"field {name!r} is nested too deeply")
    if value is None or type(value) in (bool, int, float):
        if type(value) is int and not -MAX_INT <= value <= MAX_INT:
            raise ProtocolError(f"field {name!r} holds an integer out of range")
        return value
    if type(value) is str:
        return _str(name, value)
    if type(value) is list:
        if len(value) > MAX_COLLECTION:
            raise ProtocolError(f"field {name!r} holds a list longer than {MAX_COLLECTION}")
        return [_plain(name, v, depth + 1) for v in value]
    if type(value) is dict:
        if len(value) > MAX_COLLECTION:
            raise ProtocolError(f"field {name!r} holds a map larger than {MAX_COLLECTION}")
        out = {}
        for key, v in value.items():
            if type(key) is not str or len(key) > 256:
                raise ProtocolError(f"field {name!r} holds a non-string or long key")
            out[key] = _plain(name, v, depth + 1)
        return out
    raise ProtocolError(f"field {name!r} holds a value of type {type(value).__name__}")


def _map(name: str, value: object) -> dict:
    if type(value) is not dict:
        raise ProtocolError(f"field {name!r} must be a map")
    return _plain(name, value)  # type: ignore[return-value]


# -- messages -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""

    def check(self) -> None:
        """Raise ProtocolError unless every field is valid."""

    def encode(self) -> bytes:
        self.check()
        body = {"v": PROTOCOL_VERSION, "t": self.TYPE}
        for f in fields(self):
            value = getattr(self, f.name)
            body[f.name] = [s.to_wire() for s in value] if f.name == "layout" else value
        return msgpack.packb(body, use_bin_type=True)


@dataclass(frozen=True)
class Hello(Message):
    """Consumer -> producer: who I am, what I expect, what I have committed."""

    TYPE: ClassVar[str] = "hello"
    consumer_id: str
    incarnation: int
    """Grows with every restart of the consumer's job; a newer one supersedes older ones."""
    pid: int
    credits: int
    expect: dict = field(default_factory=dict)
    """What the consumer requires of the producer (target identity, layer ids, dtype...)."""
    committed: dict = field(default_factory=dict)
    """What the consumer's checkpoint already includes from this producer."""

    def check(self) -> None:
        _str("consumer_id", self.consumer_id, 128)
        if not self.consumer_id:
            raise ProtocolError("field 'consumer_id' must not be empty")
        _int("incarnation", self.incarnation)
        _int("pid", self.pid, 0, 2**31)
        _int("credits", self.credits, 0, 1 << 20)
        _map("expect", self.expect)
        _map("committed", self.committed)


@dataclass(frozen=True)
class Welcome(Message):
    """Producer -> consumer: the ring to open and what is shipped in it."""

    TYPE: ClassVar[str] = "welcome"
    producer_id: int
    pid: int
    ring: dict
    describe: dict
    heartbeat_interval_s: float
    heartbeat_timeout_s: float

    def check(self) -> None:
        _int("producer_id", self.producer_id, 0, 1 << 20)
        _int("pid", self.pid, 0, 2**31)
        _map("ring", self.ring)
        _map("describe", self.describe)
        _float("heartbeat_interval_s", self.heartbeat_interval_s, 1e-3, 3600)
        _float("heartbeat_timeout_s", self.heartbeat_timeout_s, 1e-3, 3600)


@dataclass(frozen=True)
class Refuse(Message):
    """Producer -> consumer: the handshake is refused, and why."""

    TYPE: ClassVar[str] = "refuse"
    reason: str

    def check(self) -> None:
        _str("reason", self.reason)


@dataclass(frozen=True)
class Batch(Message):
    """Producer -> consumer: slot ``slot`` (generation ``generation``) is leased to you."""

    TYPE: ClassVar[str] = "batch"
    slot: int
    generation: int
    seq: int
    layout: tuple[TensorSpec, ...]
    meta: dict = field(default_factory=dict)

    def check(self) -> None:
        _int("slot", self.slot, 0, 1 << 20)
        _int("generation", self.generation)
        _int("seq", self.seq)
        if not isinstance(self.layout, tuple) or len(self.layout) > 16:
            raise ProtocolError("field 'layout' must hold at most 16 tensor specs")
        _map("meta", self.meta)


@dataclass(frozen=True)
class Ack(Message):
    """Consumer -> producer: I am done with this slot (and, with ``credit``, send me more)."""

    TYPE: ClassVar[str] = "ack"
    slot: int
    generation: int
    credit: int = 0
    """Credits granted with the ack: one message per slot instead of two."""

    def check(self) -> None:
        _int("slot", self.slot, 0, 1 << 20)
        _int("generation", self.generation)
        _int("credit", self.credit, 0, 1 << 20)


@dataclass(frozen=True)
class Credit(Message):
    """Consumer -> producer: send me up to ``n`` more batches."""

    TYPE: ClassVar[str] = "credit"
    n: int

    def check(self) -> None:
        _int("n", self.n, 1, 1 << 20)


@dataclass(frozen=True)
class Heartbeat(Message):
    """Either way: I am alive. The producer's carries its statistics."""

    TYPE: ClassVar[str] = "heartbeat"
    stats: dict = field(default_factory=dict)

    def check(self) -> None:
        _map("stats", self.stats)


@dataclass(frozen=True)
class Bye(Message):
    """Consumer -> producer: I am leaving; take my leases back."""

    TYPE: ClassVar[str] = "bye"
    reason: str = ""

    def check(self) -> None:
        _str("reason", self.reason)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Refuse, Batch, Ack, Credit, Heartbeat, Bye)
}
# Field names and required fields per type, computed once: decode runs for every message.
_FIELD_NAMES = {cls: frozenset(f.name for f in fields(cls)) for cls in MESSAGE_TYPES.values()}
_REQUIRED = {
    cls: frozenset(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
    for cls in MESSAGE_TYPES.values()
}


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raise ProtocolError (or VersionMismatch) if it is not valid."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same here
        raise ProtocolError(f"not msgpack: {type(exc).__name__}") from None
    if type(body) is not dict:
        raise ProtocolError("a message must be a map")
    kind = body.get("t")
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(kind)[:32]!r}")
    # Refuse is readable across versions so that a version mismatch can be explained to the peer.
    if body.get("v") != PROTOCOL_VERSION and cls is not Refuse:
        raise VersionMismatch(body.get("v"))
    names, required = _FIELD_NAMES[cls], _REQUIRED[cls]
    given = body.keys() - {"v", "t"}
    if not given <= names:
        raise ProtocolError(f"{kind}: unknown fields {sorted(given - names)[:4]}")
    if not required <= given:
        raise ProtocolError(f"{kind}: missing fields {sorted(required - given)}")
    kwargs = {name: body[name] for name in given}
    if cls is Batch:
        raw_layout = kwargs.get("layout")
        if type(raw_layout) is not list or len(raw_layout) > 16:
            raise ProtocolError("batch: field 'layout' must be a list of at most 16 tensor specs")
        try:
            kwargs["layout"] = tuple(TensorSpec.from_wire(item) for item in raw_layout)
        except LayoutError as exc:
            raise ProtocolError(f"batch: {exc}") from None
    message = cls(**kwargs)
    message.check()
    return message

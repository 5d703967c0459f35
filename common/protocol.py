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

Payload: a HELLO says how the consumer gets a batch's bytes. ``ring``: it opens the producer's
ring (same host) and reads the slot in place; every message is one frame. ``frames`` (consumers on
other hosts): it opens nothing, and each BATCH is a two-frame message [batch, payload], the payload
being the slot's first ``payload_bytes(layout, slot_bytes)`` bytes; the WELCOME's ring is then
``{"backend": "frames", "num_slots", "slot_bytes"}``.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import ClassVar

import msgpack

from common.codec import ALIGN, LayoutError, TensorSpec
from common.metrics import ProducerStats
from common.naming import SEGMENT_PREFIX, SHM_DIR

PROTOCOL_VERSION = 2
"""2: HELLO says ``payload`` and BATCH may carry the payload as a second frame. A version-1 peer
would drop a HELLO with the new field as malformed (the consumer would only see a timeout) or read
a payload frame as a message of its own: the bump makes both sides refuse each other, clearly."""
PAYLOAD_RING = "ring"
PAYLOAD_FRAMES = "frames"
PAYLOAD_MODES = (PAYLOAD_RING, PAYLOAD_FRAMES)
MAX_FRAME_BYTES = 1 << 20
MAX_STR = 4096
MAX_COLLECTION = 4096
MAX_DEPTH = 6
MAX_INT = 2**63 - 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


class VersionMismatch(ProtocolError):
    def __init__(self, theirs: object) -> None:
        # The peer's value is shown cut short: it is untrusted and the reason travels in a REFUSE.
        super().__init__(f"peer speaks protocol version {repr(theirs)[:32]}, this process speaks {PROTOCOL_VERSION}")
        self.theirs = theirs


# -- field checks -------------------------------------------------------------------------------

# Bounds the unpacker enforces while it parses, so a hostile length never allocates: bin and ext
# types are refused outright (no field carries bytes), strings and collections are capped. A string
# limit in bytes: four per character covers UTF-8, and the per-field checks count characters.
_UNPACK_LIMITS = {
    "max_bin_len": 0,
    "max_ext_len": 0,
    "max_str_len": 4 * MAX_STR,
    "max_array_len": MAX_COLLECTION,
    "max_map_len": MAX_COLLECTION,
}
MAX_KEY = 256


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


def _plain(name: str, value: object, depth: int = 0) -> None:
    """Raise unless ``value`` is JSON-like data: None, bool, int, float, str, lists and string-keyed
    maps, bounded in size and depth. Runs on every message, so scalars are checked inline."""
    kind = type(value)
    if kind is str:
        if len(value) > MAX_STR:
            raise ProtocolError(f"field {name!r} holds a string longer than {MAX_STR}")
        return
    if kind is int:
        if not -MAX_INT <= value <= MAX_INT:
            raise ProtocolError(f"field {name!r} holds an integer out of range")
        return
    if kind is float:
        if not math.isfinite(value):  # JSON has no NaN or infinity, and int(inf) raises
            raise ProtocolError(f"field {name!r} holds a non-finite number")
        return
    if value is None or kind is bool:
        return
    if kind is dict:
        items = value.values()
        for key in value:
            if type(key) is not str or len(key) > MAX_KEY:
                raise ProtocolError(f"field {name!r} holds a non-string key or one longer than {MAX_KEY}")
    elif kind is list:
        items = value
    else:
        raise ProtocolError(f"field {name!r} holds a value of type {kind.__name__}")
    if len(value) > MAX_COLLECTION:
        raise ProtocolError(f"field {name!r} holds a collection larger than {MAX_COLLECTION}")
    if items and depth >= MAX_DEPTH:
        raise ProtocolError(f"field {name!r} is nested deeper than {MAX_DEPTH}")
    for item in items:
        _plain(name, item, depth + 1)


def _map(name: str, value: object) -> None:
    if type(value) is not dict:
        raise ProtocolError(f"field {name!r} must be a map")
    _plain(name, value)


MAX_SLOTS = 1 << 20
MAX_SLOT_BYTES = 1 << 44


def _ring_spec(value: object) -> None:
    """A WELCOME's ring description: the fields ``common.ring.attach_ring`` reads, typed and bounded."""
    _map("ring", value)
    backend = value.get("backend")
    _int("ring.num_slots", value.get("num_slots"), 1, MAX_SLOTS)
    _int("ring.slot_bytes", value.get("slot_bytes"), 1, MAX_SLOT_BYTES)
    if backend == "frames":
        return  # nothing to open: the payload travels in the BATCH messages
    if backend == "host":
        folder, _, name = _str("ring.path", value.get("path"), 255).rpartition("/")
        if folder != str(SHM_DIR) or not name.startswith(f"{SEGMENT_PREFIX}."):
            raise ProtocolError(f"field 'ring.path' must name a {SEGMENT_PREFIX}.* segment in {SHM_DIR}")
    elif backend == "cuda":
        handle = _str("ring.handle", value.get("handle"), 128)
        if len(handle) != 128 or any(c not in "0123456789abcdef" for c in handle):
            raise ProtocolError("field 'ring.handle' must be 128 lowercase hex digits (a 64-byte CUDA IPC handle)")
        _str("ring.gpu_uuid", value.get("gpu_uuid"), 64)
    else:
        raise ProtocolError(f"field 'ring.backend' must be 'host', 'cuda' or 'frames', got {repr(backend)[:32]}")


# -- messages -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""

    def check(self) -> None:
        """Raise ProtocolError unless every field is valid."""

    def encode(self) -> bytes:
        self.check()
        body = {"v": PROTOCOL_VERSION, "t": self.TYPE}
        for name in _FIELD_ORDER[type(self)]:
            body[name] = getattr(self, name)
        return msgpack.packb(self._to_wire(body), use_bin_type=True)

    def _to_wire(self, body: dict) -> dict:
        """The frame's body from the field values (types with non-plain fields convert them)."""
        return body


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
    payload: str = PAYLOAD_RING
    """``ring``: the consumer reads the ring in place; ``frames``: send each batch's bytes with it."""

    def check(self) -> None:
        _str("consumer_id", self.consumer_id, 128)
        if not self.consumer_id:
            raise ProtocolError("field 'consumer_id' must not be empty")
        _int("incarnation", self.incarnation)
        _int("pid", self.pid, 0, 2**31)
        _int("credits", self.credits, 0, 1 << 20)
        _map("expect", self.expect)
        _map("committed", self.committed)
        if self.payload not in PAYLOAD_MODES:
            raise ProtocolError(f"field 'payload' must be one of {list(PAYLOAD_MODES)}, got {repr(self.payload)[:32]}")


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
        _ring_spec(self.ring)
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

    def _to_wire(self, body: dict) -> dict:
        body["layout"] = [spec.to_wire() for spec in self.layout]
        return body


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
    """A producer's ``ProducerStats`` (common/metrics.py) as its wire map; empty in a consumer's."""

    def check(self) -> None:
        _map("stats", self.stats)
        try:
            ProducerStats.from_wire(self.stats)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from exc


@dataclass(frozen=True)
class Bye(Message):
    """Consumer -> producer: I am leaving; take my leases back."""

    TYPE: ClassVar[str] = "bye"
    reason: str = ""

    def check(self) -> None:
        _str("reason", self.reason)


def payload_bytes(layout: tuple[TensorSpec, ...] | list[TensorSpec], slot_bytes: int) -> int:
    """Length of a batch's payload frame: its layout's end, rounded up to the slot alignment (so the
    received buffer can be viewed as every dtype, as a slot can), but never past the slot.

    Both sides compute it: the producer sends exactly this many bytes, the consumer refuses any
    other length (and a layout that ends past the slot fails the consumer's bounds check).
    """
    end = max((spec.offset + spec.nbytes for spec in layout), default=0)
    return min(slot_bytes, (end + ALIGN - 1) // ALIGN * ALIGN)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Refuse, Batch, Ack, Credit, Heartbeat, Bye)
}
# Field names and required fields per type, computed once: encode and decode run for every message.
_FIELD_ORDER = {cls: tuple(f.name for f in fields(cls)) for cls in MESSAGE_TYPES.values()}
_FIELD_NAMES = {cls: frozenset(names) for cls, names in _FIELD_ORDER.items()}
_REQUIRED = {
    cls: frozenset(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)
    for cls in MESSAGE_TYPES.values()
}


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raise ProtocolError (or VersionMismatch) if it is not valid."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same here
        raise ProtocolError(f"not msgpack: {type(exc).__name__}") from None
    if type(body) is not dict:
        raise ProtocolError("a message must be a map")
    version, kind = body.pop("v", None), body.pop("t", None)
    cls = MESSAGE_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {repr(kind)[:32]}")
    # Refuse is readable across versions so that a version mismatch can be explained to the peer.
    if (type(version) is not int or version != PROTOCOL_VERSION) and cls is not Refuse:
        raise VersionMismatch(version)
    names, required = _FIELD_NAMES[cls], _REQUIRED[cls]
    if not body.keys() <= names:
        unknown = sorted(repr(key)[:32] for key in body.keys() - names)  # keys may be str or bytes
        raise ProtocolError(f"{kind}: unknown fields {unknown[:4]}")
    if not required <= body.keys():
        raise ProtocolError(f"{kind}: missing fields {sorted(required - body.keys())}")
    if cls is Batch:
        raw_layout = body["layout"]
        if type(raw_layout) is not list or len(raw_layout) > 16:
            raise ProtocolError("batch: field 'layout' must be a list of at most 16 tensor specs")
        try:
            body["layout"] = tuple(TensorSpec.from_wire(item) for item in raw_layout)
        except LayoutError as exc:
            raise ProtocolError(f"batch: {exc}") from None
    message = cls(**body)
    message.check()
    return message

"""Wire protocol: typed messages round-trip; malformed frames raise ProtocolError, never crash."""

import msgpack
import pytest

from common.codec import TensorSpec
from common.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Bye,
    Credit,
    Heartbeat,
    Hello,
    ProtocolError,
    Refuse,
    VersionMismatch,
    Welcome,
    decode,
)

MESSAGES = [
    Hello(
        consumer_id="trainer/r0", incarnation=3, pid=123, credits=4, expect={"layers": [1, 9]}, committed={"next": 5}
    ),
    Welcome(
        producer_id=1,
        pid=9,
        ring={"backend": "host", "path": "/dev/shm/dflash.t.p0.1-2", "num_slots": 4, "slot_bytes": 4096},
        describe={"target": "x"},
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=10.0,
    ),
    Refuse(reason="other target"),
    Batch(slot=2, generation=7, seq=11, layout=(TensorSpec("x", "bfloat16", (3, 4), 0),), meta={"samples": [1, 2, 3]}),
    Ack(slot=2, generation=7),
    Credit(n=3),
    Heartbeat(stats={"tokens_per_s": 1.5e4, "ring": {"free": 3}}),
    Bye(reason="done"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.TYPE)
def test_roundtrip(message):
    assert decode(message.encode()) == message


def _frame(**body):
    return msgpack.packb({"v": PROTOCOL_VERSION, **body}, use_bin_type=True)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        msgpack.packb([1, 2, 3]),
        _frame(t="nope"),
        _frame(t="ack", slot="1", generation=1),
        _frame(t="ack", slot=True, generation=1),
        _frame(t="ack", slot=-1, generation=1),
        _frame(t="ack", slot=1),
        _frame(t="ack", slot=1, generation=1, extra=1),
        _frame(t="credit", n=0),
        _frame(t="hello", consumer_id="", incarnation=0, pid=1, credits=1),
        _frame(t="hello", consumer_id="x" * 5000, incarnation=0, pid=1, credits=1),
        _frame(t="heartbeat", stats={"a": b"bytes"}),
        _frame(t="heartbeat", stats={1: 2}),
        _frame(t="batch", slot=0, generation=0, seq=0, layout=[["x", "evil", [1], 0]], meta={}),
        _frame(t="batch", slot=0, generation=0, seq=0, layout="x", meta={}),
        _frame(
            t="welcome",
            producer_id=0,
            pid=1,
            ring={},
            describe={},
            heartbeat_interval_s=float("nan"),
            heartbeat_timeout_s=1.0,
        ),
        b"\x00" * ((1 << 20) + 1),
        # Each of these raised something other than ProtocolError once (found by the fuzzer):
        _frame(t="batch", slot=0, generation=0, seq=0, layout=[["x", ["uint8"], [1], 0]], meta={}),  # unhashable dtype
        msgpack.packb(
            {b"": 1, "x": 2, "v": PROTOCOL_VERSION, "t": "ack", "slot": 1, "generation": 1}, use_bin_type=True
        ),
        _frame(t="hello", consumer_id="x", incarnation=0, pid=1, credits=1, committed={"extra": [float("inf")]}),
        # Bins, exts and timestamps never reach a field check: the unpacker refuses them.
        _frame(t="bye", reason=b"x"),
        _frame(t="heartbeat", stats={"a": msgpack.ExtType(5, b"x")}),
        _frame(t="heartbeat", stats={"a": msgpack.Timestamp(1)}),
        # Statistics consumers read must have the right types.
        _frame(t="heartbeat", stats={"ring": "full"}),
        _frame(t="heartbeat", stats={"ring": {"slots": "4"}}),
        _frame(t="heartbeat", stats={"tokens_per_s": -1.0}),
        msgpack.packb({"v": True, "t": "ack", "slot": 1, "generation": 1}),
    ],
)
def test_malformed_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_deep_nesting_is_refused():
    deep: object = 1
    for _ in range(20):
        deep = {"k": deep}
    with pytest.raises(ProtocolError):
        decode(_frame(t="heartbeat", stats=deep))


def test_version_mismatch_is_explicit_but_refuse_stays_readable():
    frame = msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": "ack", "slot": 1, "generation": 1})
    with pytest.raises(VersionMismatch, match=f"version {PROTOCOL_VERSION + 1}"):
        decode(frame)
    refuse = msgpack.packb({"v": PROTOCOL_VERSION + 7, "t": "refuse", "reason": "old"})
    assert decode(refuse) == Refuse(reason="old")


HOST_RING = {"backend": "host", "path": "/dev/shm/dflash.t.p0.1-2", "num_slots": 4, "slot_bytes": 4096}
CUDA_RING = {"backend": "cuda", "handle": "ab" * 64, "gpu_uuid": "GPU-x", "num_slots": 4, "slot_bytes": 4096}


@pytest.mark.parametrize(
    "ring",
    [
        {},
        {**HOST_RING, "backend": "disk"},
        {**HOST_RING, "num_slots": 0},
        {**HOST_RING, "num_slots": -1},
        {**HOST_RING, "slot_bytes": 1 << 60},
        {**HOST_RING, "path": 7},
        {**HOST_RING, "path": "/etc/passwd"},
        {**HOST_RING, "path": "/dev/shm/dflash.x/../../etc/passwd"},
        {**HOST_RING, "path": "dflash.t.p0.1-2"},
        {k: v for k, v in HOST_RING.items() if k != "path"},
        {**CUDA_RING, "handle": "zz" * 64},
        {**CUDA_RING, "handle": "ab"},
        {k: v for k, v in CUDA_RING.items() if k != "gpu_uuid"},
    ],
)
def test_welcome_ring_description_is_checked_before_anyone_opens_it(ring):
    with pytest.raises(ProtocolError, match="ring"):
        decode(
            _frame(
                t="welcome",
                producer_id=0,
                pid=1,
                ring=ring,
                describe={},
                heartbeat_interval_s=1.0,
                heartbeat_timeout_s=1.0,
            )
        )
    good = Welcome(producer_id=0, pid=1, ring=CUDA_RING, describe={}, heartbeat_interval_s=1.0, heartbeat_timeout_s=1.0)
    assert decode(good.encode()) == good


def test_refusal_reason_quotes_a_hostile_version_cut_short():
    with pytest.raises(VersionMismatch) as info:
        decode(msgpack.packb({"v": list(range(4000)), "t": "hello"}))
    assert len(str(info.value)) < 200
    Refuse(reason=str(info.value)).encode()  # fits the reason field, so it can be sent back

"""Protocol fuzzing: hostile messages against a live producer, a live trainer intake and a live trainer.

    python -m launch.tools.fuzz                          # all three sides, 100,000 messages each
    python -m launch.tools.fuzz producer --messages 5000 --seed 3
    python -m launch.tools.fuzz trainer --json out.json

``producer``: a real producer process (``launch.tools.demo``: a RingServer over a /dev/shm ring, every
batch checksummed) serves a well-formed consumer process while hostile peers send it malformed
and semantically wrong messages: valid msgpack with wrong types, huge lengths, bins and exts,
unknown types and fields, other versions, negative and foreign slot numbers, stale generations,
acks for slots never leased (also from a peer that said a proper HELLO), replays, HELLOs of
superseded incarnations, messages producers send, multi-frame and oversized frames, garbage bytes.
The well-formed consumer holds its leases a random while, checks every checksum when it acks
(an ack that freed a slot it still holds would let the producer overwrite it) and replays its own
old acks, which are stale by then.

``consumer``: this program is a hostile producer: a real ring and ROUTER socket whose WELCOME and
batches mix well-formed ones with the same kinds of malformed messages, plus batches whose layout
points outside the slot or the ring, and batches that break the packed-batch contract. The
consumer is a separate process running the trainer's real intake (``trainer.feeder.Feeder``: the
RingClient, the batch checks, the copy out, the exactly-once dedupe), found through a run
directory like a trainer finds its producers. It must take exactly the well-formed batches, bit
for bit, and nothing else.

``trainer``: the same hostile producer, listed in the run directory of a real trainer process
(``python -m trainer.train``, tiny config). It must train on exactly the well-formed batches, once
and in order (its ledger), keep training after the storm and stop cleanly.

A side passes when the attacked process neither crashed nor stopped serving, its ring was never
corrupted, it counted the drops and the well-formed peer kept working after the storm. One JSON
line reports the counts; the exit code is 0 only if everything held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import msgpack
import torch
import zmq

from common.codec import ALIGN, TensorSpec, bytes_needed, write_tensors
from common.contract import BatchMeta
from common.protocol import (
    MAX_COLLECTION,
    MAX_STR,
    PROTOCOL_VERSION,
    Ack,
    Batch,
    Credit,
    Heartbeat,
    Hello,
    ProtocolError,
    decode,
)
from common.ring import HostRing
from common.sockets import ipc_endpoint, make_socket

ROOT = Path(__file__).resolve().parents[2]
GOOD_INCARNATION = 10**15
"""The well-formed consumer's incarnation; hostile HELLOs use lower ones, so they are refused as
superseded (a higher one would legitimately take over: that is the restart protocol, not an attack)."""


# -- hostile values and frames -------------------------------------------------------------------


def _pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


class Hostile:
    """Generates malformed or wrong-but-well-formed frames; every frame is tagged with its kind."""

    def __init__(self, rng: random.Random, num_slots: int) -> None:
        self.rng = rng
        self.num_slots = num_slots
        self.sent: list[bytes] = []
        """A sample of earlier frames, for replays."""

    # values that no field of their kind accepts (so a mutated message is always malformed)
    def bad_int(self) -> object:
        return self.rng.choice(
            [-1, -(2**63), 2**64 - 1, 2**63, "7", 7.5, True, None, [1], {"a": 1}, float("nan"), b"\x07"]
        )

    def bad_num(self) -> object:
        return self.rng.choice(["1", None, True, [1.0], float("nan"), float("inf"), -1.0, 1e12, b"\x01"])

    def bad_str(self) -> object:
        return self.rng.choice([7, None, True, ["x"], {"x": 1}, "x" * (MAX_STR + 1), b"bytes", float("inf")])

    def bad_map(self) -> object:
        rng = self.rng
        choice = rng.randrange(9)
        if choice == 0:
            return rng.choice([[], "map", 3, None, True, 1.5])
        if choice == 1:
            return {"k": b"bin"}
        if choice == 2:
            return {"k": msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(1, 8)))}
        if choice == 3:
            deep: object = 1
            for _ in range(rng.randrange(8, 40)):
                deep = {"d": deep} if rng.random() < 0.5 else [deep]
            return {"deep": deep}
        if choice == 4:
            return {"nan": rng.choice([float("nan"), float("inf"), -float("inf")])}
        if choice == 5:
            return {"k" * rng.randrange(257, 400): 1}
        if choice == 6:
            return {"big": list(range(MAX_COLLECTION + 1))}
        if choice == 7:
            return {"int": rng.choice([2**64 - 1, -(2**63)])}
        return {"ts": msgpack.Timestamp(rng.randrange(2**32))}

    def garbage(self, template: bytes) -> bytes:
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0 or not template:
            return rng.randbytes(rng.randrange(0, 128))
        if choice == 1:
            return template[: rng.randrange(0, max(1, len(template)))]
        if choice == 2:
            data = bytearray(template)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return bytes(data)
        if choice == 3:
            return template + rng.randbytes(rng.randrange(1, 16))  # trailing bytes
        if choice == 4:
            return _pack(rng.choice([[1, 2, 3], "hello", 42, None, 3.5, b"bin", [template]]))
        return b"\xc1" * rng.randrange(1, 32)  # a byte msgpack never uses

    def header(self, body: dict) -> bytes:
        """The right fields under a wrong version or type."""
        rng = self.rng
        body = dict(body)
        choice = rng.randrange(7)
        if choice == 0:
            body["v"] = rng.choice(
                [PROTOCOL_VERSION + rng.randrange(1, 1000), 0, -1, "1", True, 1.0, None, [1], list(range(300))]
            )
        elif choice == 1:
            body.pop("v")
        elif choice == 2:
            body["t"] = rng.choice(["", "HELLO", "ack ", "pickle", "__class__", "x" * 3000, 1, None, ["ack"]])
        elif choice == 3:
            body.pop("t")
        elif choice == 4:
            body[rng.choice(["extra", "__init__", "layout2", "x" * 300])] = 1
        elif choice == 5:
            body[b""] = 1  # a bytes key (allowed by msgpack's strict_map_key)
        else:
            del body[rng.choice([k for k in body if k not in ("v", "t")] or ["v"])]
        return _pack(body)

    def mutate(self, body: dict, kinds: dict[str, str]) -> bytes:
        """One field of ``body`` replaced by a value of the wrong kind."""
        name = self.rng.choice(list(kinds))
        value = {"int": self.bad_int, "num": self.bad_num, "str": self.bad_str, "map": self.bad_map}[kinds[name]]()
        return _pack({**body, name: value})

    def huge(self, body: dict, kinds: dict[str, str]) -> bytes:
        """A field blown up to (or just past) the limits."""
        rng = self.rng
        name = rng.choice(list(kinds))
        kind = kinds[name]
        if kind == "str":
            value: object = "é" * rng.choice([MAX_STR + 1, 4 * MAX_STR + 1])
        elif kind in ("int", "num"):
            # Past every field's range (a valid huge HELLO incarnation would legitimately take over).
            value = rng.choice([2**63, 2**64 - 1])
        else:
            value = {
                f"k{i}": rng.choice([1, "x" * 200, [0] * 50])
                for i in range(rng.choice([MAX_COLLECTION, MAX_COLLECTION + 1, 3000]))
            }
        return _pack({**body, name: value})

    def remember(self, frame: bytes) -> bytes:
        if len(self.sent) < 256:
            self.sent.append(frame)
        else:
            self.sent[self.rng.randrange(256)] = frame
        return frame

    def replay(self) -> bytes:
        return self.rng.choice(self.sent) if self.sent else b""


def _header(kind: str, **fields: object) -> dict:
    return {"v": PROTOCOL_VERSION, "t": kind, **fields}


CONSUMER_MESSAGE_KINDS = {
    "hello": {
        "consumer_id": "str",
        "incarnation": "int",
        "pid": "int",
        "credits": "int",
        "expect": "map",
        "committed": "map",
    },
    "ack": {"slot": "int", "generation": "int", "credit": "int"},
    "credit": {"n": "int"},
    "heartbeat": {"stats": "map"},
    "bye": {"reason": "str"},
}
PRODUCER_MESSAGE_KINDS = {
    "welcome": {
        "producer_id": "int",
        "pid": "int",
        "ring": "map",
        "describe": "map",
        "heartbeat_interval_s": "num",
        "heartbeat_timeout_s": "num",
    },
    "batch": {"slot": "int", "generation": "int", "seq": "int", "layout": "map", "meta": "map"},
    "heartbeat": {"stats": "map"},
    "refuse": {"reason": "str"},
}


def _consumer_body(rng: random.Random, kind: str, num_slots: int) -> dict:
    """A well-formed body of a consumer's message, for mutation (HELLOs with superseded incarnations)."""
    if kind == "hello":
        return _header(
            kind,
            consumer_id=f"fuzz-{rng.randrange(1000)}",
            incarnation=rng.randrange(GOOD_INCARNATION),
            pid=rng.randrange(1, 2**31),
            credits=rng.randrange(0, 8),
            expect={},
            committed={},
        )
    if kind == "ack":
        return _header(kind, slot=rng.randrange(num_slots), generation=rng.randrange(1, 10**6), credit=rng.randrange(2))
    if kind == "credit":
        return _header(kind, n=rng.randrange(1, 8))
    if kind == "heartbeat":
        return _header(kind, stats={})
    return _header(kind, reason="fuzz")


def to_producer(h: Hostile, generation_hint: int) -> tuple[str, list[bytes]]:
    """One hostile message for a producer's ROUTER (frames after the peer's identity)."""
    rng = h.rng
    kind = rng.choice(list(CONSUMER_MESSAGE_KINDS))
    body = _consumer_body(rng, kind, h.num_slots)
    roll = rng.randrange(100)
    if roll < 10:
        # Not a HELLO's bytes: a flipped bit could make its incarnation a valid newer one, which
        # takes over by design (that is a restart, not an attack).
        template = body if kind != "hello" else _consumer_body(rng, "ack", h.num_slots)
        return "garbage", [h.garbage(_pack(template))]
    if roll < 20:
        return "bad-header", [h.header(body)]
    if roll < 40:
        return "wrong-type", [h.mutate(body, CONSUMER_MESSAGE_KINDS[kind])]
    if roll < 46:
        return "huge", [h.huge(body, CONSUMER_MESSAGE_KINDS[kind])]
    if roll < 52:
        other = rng.choice(list(PRODUCER_MESSAGE_KINDS))
        return "wrong-direction", [_pack(_header(other, **{k: 1 for k in PRODUCER_MESSAGE_KINDS[other]}))]
    if roll < 62:
        slot = rng.choice([-1, -(2**40), h.num_slots + (1 << 20), 2**63])  # outside any ring and the field's range
        return "negative-or-huge-slot", [_pack(_header("ack", slot=slot, generation=1, credit=0))]
    if roll < 80:
        return "superseded-hello", [
            h.remember(_pack(body if kind == "hello" else _consumer_body(rng, "hello", h.num_slots)))
        ]
    if roll < 88:
        frame = h.replay()
        return ("replay", [frame]) if frame else ("garbage", [h.garbage(b"")])
    if roll < 94:
        return "unknown-peer", [
            h.remember(
                rng.choice([Credit(n=rng.randrange(1, 9)), Heartbeat(), Ack(slot=0, generation=1, credit=3)]).encode()
            )
        ]
    if roll < 99:
        frames = [_pack(body)] * rng.randrange(2, 4) if rng.random() < 0.7 else [b""]
        return "framing", frames
    return "oversized", [b"\x00" * ((1 << 20) + rng.randrange(1, 1024))]


ACCEPTED_ACK_KINDS = ("never-leased", "stale-generation", "foreign-slot")
"""Well-formed acks the accepted peer sends: each must reach the slot table and be ignored there."""


def for_accepted_peer(h: Hostile, generation_hint: int) -> tuple[str, list[bytes]]:
    """Messages from a peer that said a proper HELLO (credits 0, so it never holds a lease): acks for
    slots it never leased, with live, stale and future generations, and for slots past the ring."""
    rng = h.rng
    roll = rng.randrange(100)
    if roll < 30:
        return "never-leased", [
            Ack(slot=rng.randrange(h.num_slots), generation=rng.randrange(1, 10**6), credit=0).encode()
        ]
    if roll < 50:
        generation = max(1, generation_hint + rng.randrange(-8, 3))  # around the live generations
        return "stale-generation", [Ack(slot=rng.randrange(h.num_slots), generation=generation, credit=0).encode()]
    if roll < 60:
        return "foreign-slot", [Ack(slot=rng.randrange(h.num_slots, 1 << 20), generation=generation_hint).encode()]
    if roll < 70:
        return "heartbeat", [Heartbeat().encode()]
    kind = rng.choice(["ack", "heartbeat", "bye", "credit"])
    body = _consumer_body(rng, kind, h.num_slots)
    return "wrong-type", [h.mutate(body, CONSUMER_MESSAGE_KINDS[kind])]


# -- attacking a producer ------------------------------------------------------------------------


def _spawn(module: str, *args: str, log: Path) -> subprocess.Popen:
    """``python -m module args``: JSON lines on stdout, its log (a file: it may be long) in ``log``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env=env
        )


def _log_tail(path: Path, lines: int = 15) -> list[str]:
    """The last lines of a log, without the (expected, numerous) drop reports."""
    noise = ("dropped a malformed", "not said hello", "refused a consumer", "dropped batch", "sent batch")
    kept = [
        line.rstrip() for line in path.read_text(errors="replace").splitlines() if not any(n in line for n in noise)
    ]
    return kept[-lines:]


class _Lines:
    """Reads a process's JSON lines in the background."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.records: list[dict] = []
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._read, args=(proc.stdout,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.records.append(record)
                self.cond.notify_all()

    def wait(self, predicate, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                found = next((r for r in reversed(self.records) if predicate(r)), None)
                if found is not None or time.monotonic() >= deadline:
                    return found
                self.cond.wait(deadline - time.monotonic())


def good_consumer(args: argparse.Namespace) -> int:
    """The well-formed peer: hold leases a while, check every checksum at ack, replay stale acks."""
    from common.transport import Delivery, RingClient
    from launch.tools.demo import checksum

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = random.Random(args.seed)
    client = RingClient(args.endpoint, "good", GOOD_INCARNATION, credits=3, heartbeat_interval_s=0.2)
    client.connect(timeout_s=30)
    print(json.dumps({"event": "connected"}), flush=True)
    held: list = []
    old_acks: list[tuple[int, int]] = []
    indices: list[int] = []
    bad = replays = 0
    while not stop.is_set():
        for delivery in client.poll(timeout_s=0.02):
            indices.append(delivery.meta["index"])
            held.append((time.monotonic() + rng.uniform(0, 0.01), delivery))
        now = time.monotonic()
        for due, delivery in [x for x in held if x[0] <= now]:
            held.remove((due, delivery))
            if checksum(delivery.tensors) != delivery.meta["crc"]:
                bad += 1
            old_acks.append((delivery.slot, delivery.generation))
            client.ack(delivery, grant=1)
            if len(old_acks) % 100 == 0:
                print(json.dumps({"event": "progress", "received": len(old_acks)}), flush=True)
        if old_acks and rng.random() < 0.2:
            # Our own earlier ack again: by now its slot was refilled under a new generation.
            slot, generation = rng.choice(old_acks[-50:])
            client.ack(Delivery(slot, generation, seq=0, meta={}, tensors={}))
            replays += 1
    in_order = indices == list(range(indices[0], indices[0] + len(indices))) if indices else False
    repeated = [i for i, n in Counter(indices).items() if n > 1]
    print(
        json.dumps(
            {
                "event": "done",
                "received": len(indices),
                "bad": bad,
                "in_order": in_order,
                "repeated": repeated[:20],
                "replayed_acks": replays,
                "dropped": client.dropped_malformed,
            }
        ),
        flush=True,
    )
    client.close()
    return 0


PRODUCER_STATS = (
    "dropped_malformed",
    "dropped_unknown_peer",
    "refused",
    "stale_acks",
    "released",
    "reclaimed",
    "internal_errors",
    "socket_blocked",
    "ring",
)
"""The producer's figures the report keeps."""


def fuzz_producer(messages: int, seed: int) -> dict:
    """Attack a live producer; returns the report (``ok`` says whether every guarantee held)."""
    rng = random.Random(seed)
    num_slots = 4
    tmp = Path(tempfile.mkdtemp(prefix="df-fz-", dir="/tmp"))
    endpoint = ipc_endpoint(tmp / "p.ipc")
    procs: list[subprocess.Popen] = []
    report: dict = {"side": "producer", "messages": 0, "kinds": {}}
    try:
        producer, producer_lines, consumer, consumer_lines = _start_demo_pair(tmp, endpoint, num_slots, seed, procs)
        kinds, fuzz_s, received = flood_producer(endpoint, rng, num_slots, messages)
        report.update(
            messages=sum(kinds.values()), kinds=dict(kinds), fuzz_s=round(fuzz_s, 1), producer_received=received
        )
        # The well-formed consumer must keep receiving after the storm.
        before = (consumer_lines.wait(lambda r: r.get("event") == "progress", 0) or {}).get("received", 0)
        after = consumer_lines.wait(lambda r: r.get("event") == "progress" and r["received"] >= before + 300, 60)
        report["received_after_fuzz"] = (after or {}).get("received", before) - before
        report["producer_alive"] = producer.poll() is None
        consumer.send_signal(signal.SIGTERM)
        summary = consumer_lines.wait(lambda r: r.get("event") == "done", 60) or {}
        consumer.wait(timeout=30)
        producer.send_signal(signal.SIGTERM)
        done = producer_lines.wait(lambda r: r.get("event") == "done", 60) or {}
        producer.wait(timeout=30)
        stats = done.get("stats", {})
        report.update(
            consumer=summary,
            producer_exit=producer.returncode,
            producer_stats={k: stats.get(k) for k in PRODUCER_STATS},
        )
        report["checks"] = producer_checks(report, stats, kinds, messages, num_slots)
        report["ok"] = all(report["checks"].values())
        if not report["ok"]:
            report["logs"] = {"producer": _log_tail(tmp / "producer.log"), "consumer": _log_tail(tmp / "consumer.log")}
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _start_demo_pair(
    tmp: Path, endpoint: str, num_slots: int, seed: int, procs: list[subprocess.Popen]
) -> tuple[subprocess.Popen, _Lines, subprocess.Popen, _Lines]:
    """A demo producer serving ``endpoint`` and a well-formed consumer connected to it, each with its output lines;
    both go into ``procs`` as they start."""
    producer = _spawn(
        "launch.tools.demo",
        "producer",
        "--endpoint",
        endpoint,
        "--count",
        "0",
        "--slots",
        str(num_slots),
        "--slot-bytes",
        "16384",
        "--heartbeat-interval",
        "0.2",
        "--heartbeat-timeout",
        "5",
        "--linger",
        "0.5",
        log=tmp / "producer.log",
    )
    procs.append(producer)
    producer_lines = _Lines(producer)
    if producer_lines.wait(lambda r: r.get("event") == "ready", 60) is None:
        raise RuntimeError(f"producer did not start: {_log_tail(tmp / 'producer.log')}")
    consumer = _spawn(
        "launch.tools.fuzz", "_good-consumer", "--endpoint", endpoint, "--seed", str(seed), log=tmp / "consumer.log"
    )
    procs.append(consumer)
    consumer_lines = _Lines(consumer)
    if consumer_lines.wait(lambda r: r.get("event") == "connected", 60) is None:
        raise RuntimeError(f"good consumer did not connect: {_log_tail(tmp / 'consumer.log')}")
    return producer, producer_lines, consumer, consumer_lines


def flood_producer(endpoint: str, rng: random.Random, num_slots: int, messages: int) -> tuple[Counter, float, int]:
    """Send ``messages`` hostile messages from six peers and one accepted one; the messages sent by kind, the
    seconds that took, and how many the producer says it received (its heartbeats count them)."""
    ctx = zmq.Context()
    hostile = Hostile(rng, num_slots)
    peers = [make_socket(ctx, zmq.DEALER, connect=endpoint, linger_ms=10_000) for _ in range(6)]
    accepted = make_socket(ctx, zmq.DEALER, connect=endpoint, linger_ms=0)
    hello = Hello(consumer_id="fuzz-accepted", incarnation=GOOD_INCARNATION, pid=1, credits=0).encode()
    accepted.send(hello)
    kinds: Counter = Counter()
    generation_hint = 1
    started = time.monotonic()
    for i in range(messages):
        if i % 500 == 0:
            # The producer's heartbeats to the accepted peer say how far its generations are.
            for stats in _heartbeat_stats(accepted, wait_ms=0):
                generation_hint = int(stats.get("published", generation_hint))
            if i % 5000 == 0:  # stay accepted: a peer silent past the timeout is dropped
                accepted.send(hello)
        if rng.random() < 0.2:
            kind, frames = for_accepted_peer(hostile, generation_hint)
            sock = accepted
        else:
            kind, frames = to_producer(hostile, generation_hint)
            sock = peers[i % len(peers)]
            if kind == "oversized":  # zmq drops the connection of a peer that sends one: use a spare
                sock = make_socket(ctx, zmq.DEALER, connect=endpoint, linger_ms=500)
                sock.send_multipart(frames)
                sock.close()
                kinds[kind] += 1
                continue
        sock.send_multipart(frames)
        kinds[kind] += 1
        if i % 2000 == 1999:
            time.sleep(0.01)  # let the producer's queue drain: this is a flood, not a benchmark of zmq buffers
    fuzz_s = time.monotonic() - started
    for sock in peers:
        sock.close()  # after sending what they still hold (linger)
    # Wait until the producer has read them all.
    received = 0
    deadline = time.monotonic() + 120
    while received < messages - kinds["oversized"] and time.monotonic() < deadline:
        for stats in _heartbeat_stats(accepted, wait_ms=200):
            received = int(stats.get("messages", 0))
    accepted.close()
    ctx.term()
    return kinds, fuzz_s, received


def _heartbeat_stats(sock: zmq.Socket, wait_ms: int) -> list[dict]:
    """The figures of every HEARTBEAT waiting on ``sock``, after up to ``wait_ms`` for the first message; the other
    messages are read and passed over."""
    found = []
    while sock.poll(wait_ms):
        wait_ms = 0
        try:
            message = decode(sock.recv())
        except ProtocolError:
            continue
        if isinstance(message, Heartbeat):
            found.append(message.stats)
    return found


def producer_checks(report: dict, stats: dict, kinds: Counter, messages: int, num_slots: int) -> dict[str, bool]:
    """The producer's guarantees, each held or not, from the report so far and the producer's last figures."""
    summary, ring = report["consumer"], stats.get("ring", {})
    accepted_acks = sum(kinds[k] for k in ACCEPTED_ACK_KINDS)
    return {
        "producer never crashed": report["producer_alive"] and report["producer_exit"] == 0,
        "well-formed consumer kept working": report["received_after_fuzz"] >= 300,
        "no checksum errors (ring never corrupted)": summary.get("bad") == 0 and summary.get("received", 0) > 0,
        "every batch once, in order": summary.get("in_order") is True,
        "no lease left behind": ring.get("leased") == 0
        and sum(ring.get(k, 0) for k in ("free", "filling", "ready", "leased")) == num_slots,
        "malformed dropped and counted": (stats.get("dropped_malformed") or 0) > 0,
        "every foreign, stale or unleased ack ignored": stats.get("stale_acks")
        == accepted_acks + summary.get("replayed_acks", -1),
        "no handler errors": stats.get("internal_errors") == 0,
        # (zmq itself drops the oversized frames; the count includes the well-formed consumer's few)
        "every hostile message reached the producer": report["producer_received"] >= messages - kinds["oversized"],
    }


def _kill(procs: list[subprocess.Popen]) -> None:
    """Kill (and reap) each of ``procs`` still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- attacking a consumer (the trainer's intake, or the whole trainer) ---------------------------

INTAKE_DESCRIBE = {
    "producer_id": 0,
    "target_identity": "fuzz",
    "layer_ids": [1, 3],
    "dtype": "bfloat16",
    "last_hidden": False,
    "hidden_size": 16,
    "vocab_size": 100,
    "token_budget": 256,
}


def _widths(describe: dict) -> tuple[int, torch.dtype]:
    from common.codec import DTYPES

    return len(describe["layer_ids"]) * describe["hidden_size"], DTYPES[describe["dtype"]]


def good_batch(rng: random.Random, ordinal: int, describe: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A batch that keeps the packed-batch contract for ``describe``, and its metadata."""
    gen = torch.Generator().manual_seed(ordinal)
    width, dtype = _widths(describe)
    docs = rng.randrange(1, 6)
    lengths = [rng.randrange(2, describe["token_budget"] // docs + 1) for _ in range(docs)]
    tokens = sum(lengths)
    tensors = {
        "input_ids": torch.randint(0, describe["vocab_size"] - 1, (tokens,), dtype=torch.int32, generator=gen),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "sample_ids": torch.arange(ordinal * 10, ordinal * 10 + docs, dtype=torch.int64),
        "aux_hidden": torch.randn(tokens, width, generator=gen).to(dtype),
    }
    if describe["last_hidden"]:
        tensors["last_hidden"] = torch.randn(tokens, describe["hidden_size"], generator=gen).to(dtype)
    meta = BatchMeta(
        producer=0, ordinal=ordinal, cursor=[0, 0, ordinal], epoch=0, tokens=tokens, docs=docs, max_doc_len=max(lengths)
    ).to_wire()
    return tensors, meta


def tensors_crc(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode() + tensors[name].contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def slot_bytes_for(describe: dict) -> int:
    budget = describe["token_budget"]
    width, dtype = _widths(describe)
    shapes = {
        "input_ids": ((budget,), torch.int32),
        "loss_mask": ((budget,), torch.uint8),
        "cu_seqlens": ((budget + 1,), torch.int32),
        "sample_ids": ((budget,), torch.int64),
        "aux_hidden": ((budget, width), dtype),
        "last_hidden": ((budget, describe["hidden_size"]), dtype),
    }
    return bytes_needed(shapes)


def hostile_contents(slot: torch.Tensor, describe: dict) -> tuple[TensorSpec, ...]:
    """Tensors of the right names, dtypes and shapes whose values break the contract (token ids past
    the vocabulary, falling document boundaries): only a check of the values catches them."""
    tokens = 8
    width, dtype = _widths(describe)
    tensors = {
        "input_ids": torch.full((tokens,), describe["vocab_size"] + 5, dtype=torch.int32),
        "loss_mask": torch.ones(tokens, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 6, 3, tokens], dtype=torch.int32),
        "sample_ids": torch.arange(3, dtype=torch.int64),
        "aux_hidden": torch.zeros(tokens, width, dtype=dtype),
    }
    if describe["last_hidden"]:
        tensors["last_hidden"] = torch.zeros(tokens, describe["hidden_size"], dtype=dtype)
    return tuple(write_tensors(slot, tensors))


class HostileProducer:
    """A ring and a ROUTER socket that serve one consumer well-formed batches among hostile messages."""

    def __init__(self, rng: random.Random, endpoint: str, describe: dict, num_slots: int = 6) -> None:
        self.rng = rng
        self.describe = describe
        self.ring = HostRing.create("fuzz", "p0", num_slots=num_slots, slot_bytes=slot_bytes_for(describe))
        self.hostile_slot = num_slots - 1  # never holds a well-formed batch
        self.hostile_layout = hostile_contents(self.ring.slot(self.hostile_slot), describe)
        self.hostile = Hostile(rng, num_slots)
        self.ctx = zmq.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=endpoint)
        self.identity = b""
        self.credits = 0
        self.leases: dict[int, int] = {}  # slot -> generation of the well-formed batch in it
        self.next_generation = 1
        self.ordinal = 0
        self.sent_good: dict[int, int] = {}  # ordinal -> crc
        self.good: list[tuple[int, int, list, dict]] = []  # (slot, generation, layout, meta), for replays
        self.kinds: Counter = Counter()
        self.next_beat = 0.0

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        self.ring.close()

    def handshake(self, timeout_s: float = 120) -> None:
        """Wait for HELLO; answer with malformed WELCOMEs first (to be waited out), then the real one."""
        if not self.sock.poll(timeout_s * 1000):
            raise RuntimeError("the consumer never said hello")
        self.identity, frame = self.sock.recv_multipart()
        self.credits = decode(frame).credits
        welcome = _header(
            "welcome",
            producer_id=0,
            pid=os.getpid(),
            ring=self.ring.spec(),
            describe=self.describe,
            heartbeat_interval_s=0.2,
            heartbeat_timeout_s=5.0,
        )
        for _ in range(50):
            # (Not bit flips of the real WELCOME: one in the ring's path is well-formed, and a ring
            # that cannot be opened ends the trainer on purpose, see trainer/feeder.py.)
            h = self.hostile
            self._send(
                self.rng.choice(
                    [h.mutate(welcome, PRODUCER_MESSAGE_KINDS["welcome"]), h.header(welcome), h.garbage(b"")]
                )
            )
            self.kinds["bad-welcome"] += 1
        self._send(_pack(welcome))

    def _send(self, frame: bytes) -> bool:
        try:
            self.sock.send_multipart([self.identity, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            time.sleep(0.005)  # the consumer's queue is full: let it drain
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # it left (after its BYE, at the end)
                return False
            raise

    def serve(self, wait_ms: int = 0, batch: bool = True) -> None:
        """Take acks and credits, send a heartbeat when due and (``batch``) a well-formed batch when there is room."""
        while self.sock.poll(wait_ms):
            wait_ms = 0
            frames = self.sock.recv_multipart()
            try:
                message = decode(frames[-1])
            except ProtocolError:
                continue
            if isinstance(message, Ack):
                self.credits += message.credit
                if self.leases.get(message.slot) == message.generation:
                    del self.leases[message.slot]
            elif isinstance(message, Credit):
                self.credits += message.n
            elif isinstance(message, Hello):
                raise RuntimeError("the consumer reconnected: it gave up on this producer")
        now = time.monotonic()
        if now >= self.next_beat:
            self._send(Heartbeat(stats={"ring": {"slots": self.ring.num_slots}}).encode())
            self.next_beat = now + 0.2
        free = [s for s in range(self.hostile_slot) if s not in self.leases]
        if batch and self.credits > 0 and free:
            slot = self.rng.choice(free)
            tensors, meta = good_batch(self.rng, self.ordinal, self.describe)
            layout = write_tensors(self.ring.slot(slot), tensors)
            if self._send(
                Batch(
                    slot=slot, generation=self.next_generation, seq=self.ordinal, layout=tuple(layout), meta=meta
                ).encode()
            ):
                self.leases[slot] = self.next_generation
                self.good.append((slot, self.next_generation, [spec.to_wire() for spec in layout], meta))
                self.sent_good[self.ordinal] = tensors_crc(tensors)
                self.credits -= 1
                self.next_generation += 1
                self.ordinal += 1

    def attack(self, messages: int, good_every: int = 1) -> None:
        """``messages`` hostile messages, with well-formed batches in between as credit allows (at
        most one per ``good_every`` hostile ones: a trainer takes a step for each)."""
        sent = sum(self.kinds.values())
        last_good = -good_every
        while sent < messages:
            before = self.ordinal
            self.serve(batch=sent - last_good >= good_every)
            if self.ordinal != before:
                last_good = sent
            for _ in range(self.rng.randrange(1, 20)):
                kind, frame = to_consumer(self, self.good[-64:])
                if not self._send(frame):
                    continue
                self.kinds[kind] += 1
                sent += 1
                try:
                    if isinstance(decode(frame), Batch):
                        self.credits -= 1  # a batch the consumer will drop and ack, returning this credit
                except ProtocolError:
                    pass

    def calm(self, batches: int, timeout_s: float = 60) -> None:
        """Then only well-formed batches: the consumer must still take them."""
        target = self.ordinal + batches
        deadline = time.monotonic() + timeout_s
        while self.ordinal < target and time.monotonic() < deadline:
            self.serve(wait_ms=10)


def to_consumer(p: HostileProducer, good: list[tuple[int, int, list, dict]]) -> tuple[str, bytes]:
    """One hostile message for a consumer. ``good``: (slot, generation, layout wire, meta) of batches sent before."""
    h, ring = p.hostile, p.ring
    rng = h.rng
    generation = (1 << 40) + rng.randrange(1 << 30)  # never one of the well-formed batches' generations
    roll = rng.randrange(100)
    kind = rng.choice(list(PRODUCER_MESSAGE_KINDS))
    body = _header(kind, **{k: 1 for k in PRODUCER_MESSAGE_KINDS[kind]})
    if roll < 8:
        return "garbage", h.garbage(_pack(body))
    if roll < 16:
        return "bad-header", h.header(body)
    if roll < 30:
        return "wrong-type", h.mutate(body, PRODUCER_MESSAGE_KINDS[kind])
    if roll < 34:
        return "huge", h.huge(body, PRODUCER_MESSAGE_KINDS[kind])
    if roll < 38:
        other = rng.choice(list(CONSUMER_MESSAGE_KINDS))
        return "wrong-direction", _pack(_consumer_body(rng, other, h.num_slots))
    slot_bytes = ring.slot_bytes
    if roll < 46:
        slot = rng.choice([ring.num_slots, ring.num_slots + rng.randrange(100), (1 << 20)])
        return "foreign-slot", _pack(
            _header("batch", slot=slot, generation=generation, seq=0, layout=[["input_ids", "int32", [4], 0]], meta={})
        )
    if roll < 60:
        wire = _layout_outside(rng, slot_bytes)
        return "layout-outside", _pack(
            _header("batch", slot=rng.randrange(ring.num_slots), generation=generation, seq=0, layout=wire, meta={})
        )
    if roll < 78 and good:
        return "contract", _broken_contract(p, rng.choice(good), generation)
    if roll < 86 and good:
        slot, gen, wire, meta = rng.choice(good)
        return "replay", _pack(_header("batch", slot=slot, generation=gen, seq=0, layout=wire, meta=meta))
    if roll < 96:
        stats = rng.choice(
            [
                {"ring": "x"},
                {"ring": {"slots": -1}},
                {"tokens_per_s": "fast"},
                {"batching": [1]},
                {"ring": {"free": float("nan")}},
                h.bad_map(),
            ]
        )
        return "bad-stats", _pack(_header("heartbeat", stats=stats))
    welcome = _header(
        "welcome",
        producer_id=0,
        pid=1,
        ring=ring.spec(),
        describe=p.describe,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=5.0,
    )
    return "welcome-again", _pack(welcome) if rng.random() < 0.3 else h.mutate(
        welcome, PRODUCER_MESSAGE_KINDS["welcome"]
    )


def _layout_outside(rng: random.Random, slot_bytes: int) -> list:
    """A layout that points past the slot, overlaps, repeats names, or is malformed."""
    choice = rng.randrange(8)
    if choice == 0:
        return [["aux_hidden", "bfloat16", [slot_bytes // 2 + 1], 0]]
    if choice == 1:
        return [["x", "uint8", [256], slot_bytes - ALIGN + ALIGN * rng.randrange(1, 4)]]
    if choice == 2:
        return [["a", "int64", [64], 0], ["b", "int64", [64], 256]]
    if choice == 3:
        return [["a", "uint8", [1], 0], ["a", "uint8", [1], 256]]
    if choice == 4:
        return [["x", "uint8", rng.choice([[1 << 39, 1 << 39], [0, 1 << 39, 1 << 39, 1 << 39]]), 0]]
    if choice == 5:
        return [["x", "uint8", [1], 3]]
    if choice == 6:
        return [[f"t{i}", "uint8", [1], 256 * i] for i in range(17)]
    return [["x", rng.choice(["complex64", "object", "float8", "<f4"]), [1], 0]]


def _broken_contract(p: HostileProducer, good: tuple[int, int, list, dict], generation: int) -> bytes:
    """A BATCH of a well-formed batch's slot whose layout lies inside the slot but breaks the batch contract in one
    way (or, in an eighth of them, the right layout with wrong values)."""
    rng, slot_bytes = p.hostile.rng, p.ring.slot_bytes
    slot, _, wire, meta = good
    wire = [list(item) for item in wire]
    meta = dict(meta)
    choice = rng.randrange(8)
    if choice == 0:
        meta.pop(rng.choice(["ordinal", "epoch", "cursor"]))
    elif choice == 1:
        meta[rng.choice(["ordinal", "epoch"])] = rng.choice(["1", -1, 1.5, None, [1]])
    elif choice == 2:
        meta["cursor"] = rng.choice([[0, 0], "x", [0, 0, -1], [0, 0, "1"]])
    elif choice == 3:
        wire = [
            item
            for item in wire
            if item[0] != rng.choice(["input_ids", "cu_seqlens", "sample_ids", "aux_hidden", "loss_mask"])
        ]
    elif choice == 4:
        item = rng.choice(wire)
        item[1] = rng.choice(["float64", "int64", "uint8", "int16"]) if item[1] != "int16" else "int32"
    elif choice == 5:
        aux = next(item for item in wire if item[0] == "aux_hidden")
        aux[2] = [aux[2][0], aux[2][1] // 2]
    elif choice == 6:
        wire = [item for item in wire if item[0] != "last_hidden"] + [
            ["last_hidden", "int8", [1, 1], slot_bytes - ALIGN]
        ]
    else:
        # Right names, dtypes and shapes; wrong values (token ids past the vocabulary, falling boundaries).
        return Batch(slot=p.hostile_slot, generation=generation, seq=0, layout=p.hostile_layout, meta=meta).encode()
    return _pack(_header("batch", slot=slot, generation=generation, seq=0, layout=wire, meta=meta))


def feeder_role(args: argparse.Namespace) -> int:
    """The trainer's intake (Feeder) against the producers listed in a run directory; one line per batch."""
    from common.rundir import RunDir
    from trainer.feeder import Commits, Feeder

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    feeder = Feeder(
        RunDir(args.run_dir),
        consumer_id="trainer/r0",
        incarnation=1,
        expect={"target_identity": "fuzz"},
        commits=Commits(),
        device=torch.device("cpu"),
        credits=4,
        heartbeat_interval_s=0.2,
        handshake_timeout_s=10.0,
        depth=4,
    )
    feeder.start()
    received = 0
    while not stop.is_set() and feeder.error is None:
        item = feeder.get(timeout=0.05)
        if item is not None:
            received += 1
            print(
                json.dumps({"event": "batch", "ordinal": item.ordinal, "crc": tensors_crc(item.batch.tensors())}),
                flush=True,
            )
    link = feeder.links.get(0)
    dropped = link.client.dropped_malformed if link is not None and link.client is not None else None
    error = repr(feeder.error) if feeder.error is not None else None
    feeder.close()
    print(
        json.dumps(
            {"event": "done", "received": received, "dropped": dropped, "error": error, "refusal": feeder.refusal}
        ),
        flush=True,
    )
    return 0


def fuzz_consumer(messages: int, seed: int) -> dict:
    """Attack a live consumer process running the trainer's intake; returns the report."""
    from common.rundir import RunDir
    from common.status import ProducerStatus

    tmp = Path(tempfile.mkdtemp(prefix="df-fz-", dir="/tmp"))
    run = RunDir(tmp / "run")
    endpoint = ipc_endpoint(tmp / "p0.ipc")
    producer = HostileProducer(random.Random(seed), endpoint, INTAKE_DESCRIBE)
    ProducerStatus(id=0, pid=os.getpid(), ready=True, endpoint=endpoint).write(run.producer_status(0))
    consumer = _spawn("launch.tools.fuzz", "_feeder", "--run-dir", str(run.root), log=tmp / "feeder.log")
    lines = _Lines(consumer)
    report: dict = {"side": "consumer"}
    try:
        producer.handshake()
        started = time.monotonic()
        producer.attack(messages)
        report.update(
            messages=sum(producer.kinds.values()),
            kinds=dict(producer.kinds),
            fuzz_s=round(time.monotonic() - started, 1),
        )
        producer.calm(50)
        last = producer.ordinal - 1
        lines.wait(lambda r: r.get("event") == "batch" and r["ordinal"] == last, 30)
        report["consumer_alive"] = consumer.poll() is None
        consumer.send_signal(signal.SIGTERM)
        summary = lines.wait(lambda r: r.get("event") == "done", 60) or {}
        consumer.wait(timeout=30)
        got = [r for r in lines.records if r.get("event") == "batch"]
        report.update(consumer=summary, well_formed_batches=len(producer.sent_good))
        checks = {
            "consumer never crashed": report["consumer_alive"]
            and consumer.returncode == 0
            and summary.get("error") is None,
            "never refused or gave up": summary.get("refusal") is None,
            "every well-formed batch taken once, bit-exact": sorted((r["ordinal"], r["crc"]) for r in got)
            == sorted(producer.sent_good.items()),
            "nothing else taken": len(got) == len(producer.sent_good),
            "malformed dropped and counted": (summary.get("dropped") or 0) > 0,
        }
        report["checks"] = checks
        report["ok"] = all(checks.values())
        if not report["ok"]:
            report["logs"] = {"consumer": _log_tail(tmp / "feeder.log")}
    finally:
        _kill([consumer])
        producer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def fuzz_trainer(messages: int, seed: int) -> dict:
    """Attack a live trainer process (``python -m trainer.train``) that trains from a hostile producer.

    It must train on the well-formed batches only (its ledger says which), stay up, and stop cleanly.
    """
    from common.rundir import read_json
    from common.status import ProducerStatus

    tmp = Path(tempfile.mkdtemp(prefix="df-fz-", dir="/tmp"))
    run, describe = _trainer_run(tmp)
    endpoint = ipc_endpoint(tmp / "p0.ipc")
    producer = HostileProducer(random.Random(seed), endpoint, describe)
    ProducerStatus(id=0, pid=os.getpid(), ready=True, endpoint=endpoint).write(run.producer_status(0))
    trainer = _spawn("trainer.train", "--run-dir", str(run.root), log=tmp / "trainer.log")
    report: dict = {"side": "trainer"}

    def trained() -> list[int]:
        lines = run.ledger.read_text().splitlines() if run.ledger.exists() else []
        return [ordinal for line in lines if line.endswith("}") for _, ordinal in json.loads(line)["batches"]]

    def train_until_all_sent_are_trained(timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while producer.ordinal - 1 not in trained() and time.monotonic() < deadline and trainer.poll() is None:
            producer.serve(wait_ms=50, batch=False)

    try:
        producer.handshake()
        started = time.monotonic()
        producer.attack(messages, good_every=max(1, messages // 40))
        report.update(
            messages=sum(producer.kinds.values()),
            kinds=dict(producer.kinds),
            fuzz_s=round(time.monotonic() - started, 1),
        )
        # Its last well-formed batch trained means it has read every hostile message sent before it.
        train_until_all_sent_are_trained(600)
        step_after_fuzz = (read_json(run.trainer_status) or {}).get("step", 0)
        producer.calm(5)
        train_until_all_sent_are_trained(120)
        report["trainer_alive"] = trainer.poll() is None
        trainer.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while trainer.poll() is None and time.monotonic() < deadline:
            producer.serve(wait_ms=50, batch=False)  # it says BYE after its last checkpoint
        report["trainer_exit"] = trainer.returncode
        report["checks"] = trainer_checks(run, tmp / "trainer.log", sorted(producer.sent_good), step_after_fuzz, report)
        report["ok"] = all(report["checks"].values())
        if not report["ok"]:
            report["logs"] = {"trainer": _log_tail(tmp / "trainer.log", 30)}
    finally:
        _kill([trainer])
        producer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _trainer_run(tmp: Path) -> tuple:
    """A run directory in ``tmp`` for a tiny trainer that trains until stopped, its target's head exported, and the
    description a producer of that target gives in its WELCOME."""
    from common.config import load_config, save_config
    from common.rundir import RunDir
    from producer.build import export_target_head, feature_layer_ids
    from producer.target_model.capture import Target
    from producer.target_model.load import build_target_config

    run = RunDir(tmp / "run")
    run.root.mkdir()
    cfg = load_config(
        ROOT / "launch" / "tiny.toml",
        [
            'logging.wandb_mode="disabled"',
            "logging.progress=false",
            "logging.log_every=5",
            "training.max_steps=1000000",
            "training.checkpoint_every=1000000",
            "batching.token_budget=256",
            "data.max_seq_len=256",
            "eval.every_steps=0",
        ],
    )
    save_config(cfg, run.config)
    layer_ids = feature_layer_ids(cfg, build_target_config(cfg.target).num_hidden_layers)
    target = Target.load(cfg.target, layer_ids, capture_last_hidden=cfg.ships_final_hidden)
    export_target_head(target, run.target_head)
    return run, {
        "producer_id": 0,
        "target_identity": target.identity,
        "layer_ids": layer_ids,
        "dtype": cfg.target.dtype,
        "last_hidden": cfg.ships_final_hidden,
        "hidden_size": target.hidden_size,
        "vocab_size": int(target.model.config.vocab_size),
        "token_budget": cfg.batching.token_budget,
    }


def trainer_checks(run, log: Path, sent_good: list[int], step_after_fuzz: int, report: dict) -> dict[str, bool]:
    """The trainer's guarantees, each held or not, from its status, its ledger and its log (their figures go into
    ``report`` too)."""
    from common.rundir import read_json

    status = read_json(run.trainer_status) or {}
    ledger = [json.loads(line) for line in run.ledger.read_text().splitlines()] if run.ledger.exists() else []
    batches = [ordinal for line in ledger for _, ordinal in line["batches"]]
    samples = [s for line in ledger for _, _, s in line["samples"]]
    expected_samples = {o * 10 + k for o in batches for k in range(10)}
    counted = re.findall(r"dropped (\d+) malformed messages or batches", log.read_text(errors="replace"))
    dropped = sum(int(n) for n in counted)
    report.update(
        steps=status.get("step"),
        step_after_fuzz=step_after_fuzz,
        dropped=dropped,
        well_formed_batches=len(sent_good),
        trained_batches=len(batches),
    )
    return {
        "trainer never crashed, stopped cleanly": report["trainer_alive"]
        and report["trainer_exit"] == 0
        and status.get("state") == "stopped",
        "kept training after the storm": (status.get("step") or 0) > step_after_fuzz,
        "trained every well-formed batch once, in order, and nothing else": batches == sent_good,
        "trained their samples only": set(samples) <= expected_samples and len(samples) == len(set(samples)),
        "malformed messages and batches dropped and counted": dropped >= report["messages"] // 2,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "side",
        nargs="?",
        choices=["all", "producer", "consumer", "trainer", "_good-consumer", "_feeder"],
        default="all",
    )
    parser.add_argument("--messages", type=int, default=100_000, help="hostile messages per side")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="", help="also write the reports here")
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side == "_good-consumer":
        return good_consumer(args)
    if args.side == "_feeder":
        return feeder_role(args)
    reports = []
    if args.side in ("all", "producer"):
        reports.append(fuzz_producer(args.messages, args.seed))
    if args.side in ("all", "consumer"):
        reports.append(fuzz_consumer(args.messages, args.seed))
    if args.side in ("all", "trainer"):
        reports.append(fuzz_trainer(args.messages, args.seed))
    for report in reports:
        failed = [name for name, held in report.get("checks", {}).items() if not held]
        print(
            f"{report['side']:9s} {report.get('messages', 0):>8d} hostile messages in {report.get('fuzz_s', 0)}s: "
            f"{'all guarantees held' if report.get('ok') else 'FAILED: ' + ', '.join(failed)}"
        )
    print(json.dumps({"fuzz": reports}))
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0 if all(r.get("ok") for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())

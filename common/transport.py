"""Serving a ring to consumers (RingServer, in the producer) and consuming it (RingClient).

RingServer runs one thread that owns the ROUTER socket. The filler (the producer's compute
loop) calls ``acquire`` / ``publish`` from its own thread; ``acquire`` blocks only on a full ring
(backpressure, counted as blocked time). The server leases READY slots to consumers that have
credit, never blocks on a socket, reclaims the leases of consumers that stop answering within
the heartbeat timeout or are superseded by a newer incarnation, and logs and drops every
malformed message.

RingClient is single-threaded: whoever owns it must call ``poll`` often (it sends the consumer's
heartbeats); the trainer runs it in a feeder thread. It trusts its producer no more than the
producer trusts it: malformed messages are logged and dropped, and a batch whose layout does not
fit the ring, or that fails the owner's ``accept`` check, is dropped and acked with its credit.

Payload by frames (consumers on other hosts, ``payload="frames"``): the client opens no ring; the
server sends each leased slot's bytes as a second frame of the BATCH message, straight from the host
ring's memory (no copy: the slot stays leased, so unchanged, until the consumer acks, which it does
only after the whole message arrived). The client's tensors are views of the received frame.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from common.codec import DTYPES, LayoutError, TensorSpec, read_tensors
from common.contract import mismatch
from common.metrics import ProducerStats, RingCounts
from common.protocol import (
    MAX_FRAME_BYTES,
    PAYLOAD_FRAMES,
    PAYLOAD_MODES,
    PAYLOAD_RING,
    Ack,
    Batch,
    Bye,
    Credit,
    Heartbeat,
    Hello,
    Message,
    ProtocolError,
    Refuse,
    VersionMismatch,
    Welcome,
    decode,
    payload_bytes,
)
from common.ring import RingBuffer, attach_ring
from common.slots import SlotTable
from common.sockets import CurveKeys, make_socket, send_nowait, start_authenticator

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 1 << 36
"""Default cap of a payload frame a frames consumer accepts (64 GiB, above any slot of the targets
this system trains for): ZeroMQ drops longer frames before allocating them."""
_MAX_ITEMSIZE = max(dtype.itemsize for dtype in DTYPES.values())


class HandshakeRefused(RuntimeError):
    """The producer refused this consumer; the message says why."""


class HandshakeTimeout(TimeoutError):
    """No answer to HELLO within the timeout."""


@dataclass
class _Consumer:
    identity: bytes
    consumer_id: str
    incarnation: int
    pid: int
    credits: int
    last_seen: float
    paused_until: float = 0.0
    """After a send to it would have blocked, it gets no batches until then (its credits stay)."""
    frames: bool = False
    """It reads no ring: each batch's bytes go with its BATCH as a second frame."""


class _Consumers:
    """The consumers a ring server serves, by ZeroMQ identity: only the newest trainer incarnation's, one per
    consumer id, each until it says bye or goes silent; a dropped one's leases go back in the ring."""

    def __init__(self, slots: SlotTable, counters: ServerCounters) -> None:
        self.slots = slots
        self.counters = counters
        self.by_identity: dict[bytes, _Consumer] = {}
        self.newest_incarnation = -1
        self._round_robin = 0

    def __len__(self) -> int:
        return len(self.by_identity)

    def get(self, identity: bytes) -> _Consumer | None:
        return self.by_identity.get(identity)

    def replace(self, identity: bytes, hello: Hello) -> bool:
        """Make room for the consumer of ``hello``: a newer incarnation supersedes every older consumer, and a
        consumer reconnecting replaces its earlier self. True when ``hello`` is of a new incarnation."""
        new_incarnation = hello.incarnation > self.newest_incarnation
        if new_incarnation:
            self.newest_incarnation = hello.incarnation
            for old in [c for c in self.by_identity.values() if c.incarnation < hello.incarnation]:
                self.counters.consumers_superseded += 1
                self.drop(old.identity, reason=f"superseded by incarnation {hello.incarnation}")
        for old in [
            c for c in self.by_identity.values() if c.consumer_id == hello.consumer_id or c.identity == identity
        ]:
            self.drop(old.identity, reason="reconnected")
        return new_incarnation

    def add(self, identity: bytes, hello: Hello) -> _Consumer:
        """The consumer of ``hello``, just heard from, with no credit yet."""
        frames = hello.payload == PAYLOAD_FRAMES
        consumer = _Consumer(
            identity, hello.consumer_id, hello.incarnation, hello.pid, 0, time.monotonic(), frames=frames
        )
        self.by_identity[identity] = consumer
        return consumer

    def drop(self, identity: bytes, reason: str) -> None:
        consumer = self.by_identity.pop(identity, None)
        reclaimed = self.slots.reclaim(identity)
        if consumer is not None:
            log.info("consumer %s %s; %d leases back in the ring", consumer.consumer_id, reason, len(reclaimed))

    def expire(self, now: float, timeout_s: float) -> None:
        """Drop the consumers silent for longer than ``timeout_s``."""
        for consumer in list(self.by_identity.values()):
            if now - consumer.last_seen > timeout_s:
                self.counters.consumers_expired += 1
                self.drop(consumer.identity, reason=f"silent for {now - consumer.last_seen:.1f}s")

    def next_hungry(self, now: float) -> _Consumer | None:
        """The next consumer, round robin, with credit and not paused; None when none has."""
        hungry = [c for c in self.by_identity.values() if c.credits > 0 and c.paused_until <= now]
        if not hungry:
            return None
        self._round_robin += 1
        return hungry[(self._round_robin - 1) % len(hungry)]

    def any_credit(self) -> bool:
        return any(c.credits > 0 for c in self.by_identity.values())


@dataclass
class ServerCounters:
    messages: int = 0
    dropped_malformed: int = 0
    dropped_unknown_peer: int = 0
    send_failures: int = 0
    consumers_expired: int = 0
    consumers_superseded: int = 0
    refused: int = 0
    socket_blocked: int = 0
    """Times a send would have blocked (it never does: the message is dropped or the lease undone)."""
    max_busy_s: float = 0.0
    """Longest stretch the server thread spent handling messages without returning to its poll."""
    internal_errors: int = 0
    """Valid messages whose handling raised (a bug, logged with its traceback); zero in every test."""

    def figures(self) -> dict[str, Any]:
        """The counters a HEARTBEAT carries, by their ``ProducerStats`` name."""
        return dict(
            messages=self.messages,
            dropped_malformed=self.dropped_malformed,
            dropped_unknown_peer=self.dropped_unknown_peer,
            refused=self.refused,
            socket_blocked=self.socket_blocked,
            internal_errors=self.internal_errors,
            max_busy_s=round(self.max_busy_s, 4),
        )


@dataclass
class RateLimitedLog:
    """A warning at most every ``every_s`` seconds, with the count of those held back."""

    every_s: float = 5.0
    last: float = 0.0
    suppressed: int = 0

    def warn(self, text: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            extra = f" (+{self.suppressed} similar)" if self.suppressed else ""
            log.warning("%s%s", text, extra)
            self.last, self.suppressed = now, 0
        else:
            self.suppressed += 1


HelloCheck = Callable[[Hello], "str | None"]
WelcomeHook = Callable[[Hello, bool], None]
ProducerFigures = Callable[[], dict[str, Any]]
"""What a producer adds to the server's statistics: values of ``ProducerStats`` fields, by name."""
DeliveryCheck = Callable[["Delivery", dict], None]
"""Checks a delivered batch against the producer's WELCOME description (e.g.
``common.batchcheck.check_batch``); raising ValueError drops the batch (see RingClient)."""


def _bind_router(
    ctx: zmq.Context, endpoint: str, curve: CurveKeys | None
) -> tuple[zmq.Socket, zmq.auth.thread.ThreadAuthenticator | None]:
    """The server's ROUTER socket bound to ``endpoint`` and, with ``curve``, its context's ZAP handler (stopped again
    when the bind fails)."""
    auth = start_authenticator(ctx, curve) if curve is not None else None
    try:
        return make_socket(ctx, zmq.ROUTER, bind=endpoint, curve=curve), auth
    except BaseException:
        if auth is not None:
            auth.stop()
        raise


def _refusal(hello: Hello, ring: RingBuffer, newest_incarnation: int) -> str | None:
    """Why the server refuses ``hello`` whatever the producer says of it (``check_hello``), or None."""
    if hello.incarnation < newest_incarnation:
        return f"incarnation {hello.incarnation} is superseded by {newest_incarnation}"
    if hello.payload == PAYLOAD_FRAMES and ring.backend != "host":
        # Staging GPU slots through host memory would add a copy and a buffer per lease; a producer
        # serving other hosts is better off writing its features to a host ring at once.
        return (
            f"this producer's ring is in GPU memory (ring.backend={ring.backend}), which a "
            "consumer on another host cannot read: start the producer with ring.backend=host"
        )
    return None


class RingServer:
    """Leases a ring's slots to consumers over one ROUTER socket."""

    def __init__(
        self,
        endpoint: str,
        ring: RingBuffer,
        *,
        producer_id: int = 0,
        describe: dict | None = None,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        check_hello: HelloCheck | None = None,
        on_welcome: WelcomeHook | None = None,
        stats: ProducerFigures | None = None,
        curve: CurveKeys | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        if curve is not None and ctx is not None:
            raise ValueError("a CURVE server makes its own context (its ZAP handler is per context): do not pass ctx")
        self.endpoint = endpoint
        self.ring = ring
        self.producer_id = producer_id
        self.describe = dict(describe or {})
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.slots = SlotTable(ring.num_slots)
        self.counters = ServerCounters()
        self._check_hello = check_hello
        self._on_welcome = on_welcome
        self._stats = stats
        self._curve = curve
        self._ctx = zmq.Context() if curve is not None else ctx or zmq.Context.instance()
        self._consumers = _Consumers(self.slots, self.counters)
        self._credit_waiting = False
        """Some consumer has credit (set by the server thread, read by the filler in ``publish``)."""
        self._freed = False
        """Acks freed slots whose waiting filler is not woken yet (see ``_serve``)."""
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"ring-server-{producer_id}", daemon=True)
        self._bad_log = RateLimitedLog()
        self._refused_log = RateLimitedLog()
        # A consumer that died keeps blocking until its heartbeat timeout, once per heartbeat.
        self._blocked_log = RateLimitedLog()
        self._error: BaseException | None = None

    # -- filler side (any thread) ----------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._bound.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"ring server could not bind {self.endpoint}: {self._error}")

    def acquire(self, timeout_s: float | None = None) -> int | None:
        """A FREE slot now FILLING, or None after ``timeout_s`` on a full ring."""
        return self.slots.acquire(timeout_s)

    def slot_view(self, index: int) -> torch.Tensor:
        return self.ring.slot(index)

    def publish(self, index: int, layout: list[TensorSpec], meta: dict) -> int:
        """Announce a filled slot. Its bytes must be complete (stream synchronised) before this call.

        The slot's payload is ``(layout, meta, frame, payload_bytes)``: the BATCH frame is encoded
        here, on the filler's thread, so leasing the slot costs the server thread one send.
        """
        layout, meta = tuple(layout), dict(meta)
        generation, seq = self.slots.filling(index)
        frame = Batch(slot=index, generation=generation, seq=seq, layout=layout, meta=meta).encode()
        self.slots.publish(index, (layout, meta, frame, payload_bytes(layout, self.ring.slot_bytes)))
        # Read after publishing: the server thread raises the flag before it looks for ready slots,
        # so either it sees this slot or we see the flag. Without credit to spend it would wake for
        # nothing: the next ACK or CREDIT dispatches the slot (saves a thread hand-off per slot).
        if self._credit_waiting:
            self._wake()
        return seq

    def abort(self, index: int) -> None:
        self.slots.abort(index)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self.slots.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already signalled (pipe full) or closing

    # -- server thread ---------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            sock, auth = _bind_router(self._ctx, self.endpoint, self._curve)
        except BaseException as exc:
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._stop.is_set():
                timeout_ms = max(0.0, (next_beat - time.monotonic()) * 1000)
                events = dict(poller.poll(timeout_ms))
                busy_from = time.monotonic()
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if sock in events:
                    self._drain(sock)
                self._dispatch(sock)
                if self._freed:
                    # Woken after the leases went out, so the filler does not delay them.
                    self._freed = False
                    self.slots.wake()
                now = time.monotonic()
                if now >= next_beat:
                    self._consumers.expire(now, self.heartbeat_timeout_s)
                    self._beat(sock)
                    next_beat = now + self.heartbeat_interval_s
                self.counters.max_busy_s = max(self.counters.max_busy_s, time.monotonic() - busy_from)
        finally:
            sock.close(linger=0)
            if auth is not None:
                auth.stop()
                self._ctx.term()
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://") :]).unlink(missing_ok=True)

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(1000):  # bounded so that dispatch and heartbeats still run under a flood
            # Asking first is cheaper than the zmq.Again a NOBLOCK receive raises on an empty queue.
            if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(copy=True)
            self.counters.messages += 1
            if len(frames) != 2:
                self.counters.dropped_malformed += 1
                self._bad_log.warn(f"dropped a message of {len(frames)} frames")
                continue
            identity, frame = frames
            try:
                message = decode(frame)
            except VersionMismatch as exc:
                self.counters.dropped_malformed += 1
                self._bad_log.warn(f"refused a peer: {exc}")
                send_nowait(sock, [identity, Refuse(reason=str(exc)).encode()])
                continue
            except ProtocolError as exc:
                self.counters.dropped_malformed += 1
                self._bad_log.warn(f"dropped a malformed message ({len(frame)} bytes): {exc}")
                continue
            try:
                self._handle(sock, identity, message)
            except Exception:  # a bug must not end the server thread: the ring would never be served again
                self.counters.internal_errors += 1
                log.exception("failed to handle a %s message; dropped it", message.TYPE)

    def _handle(self, sock: zmq.Socket, identity: bytes, message: Message) -> None:
        if isinstance(message, Hello):
            self._on_hello(sock, identity, message)
            return
        consumer = self._consumers.get(identity)
        if consumer is None:
            self.counters.dropped_unknown_peer += 1
            self._bad_log.warn(f"dropped {message.TYPE} from a peer that has not said hello")
            return
        consumer.last_seen = time.monotonic()
        if isinstance(message, Ack):
            if self.slots.release(identity, message.slot, message.generation, notify=False):
                self._freed = True
            if message.credit:
                self._add_credit(consumer, message.credit)
        elif isinstance(message, Credit):
            self._add_credit(consumer, message.n)
        elif isinstance(message, Bye):
            self._consumers.drop(identity, reason=f"said bye ({message.reason})")
        elif isinstance(message, Heartbeat):
            pass
        else:
            self.counters.dropped_malformed += 1
            self._bad_log.warn(f"dropped a {message.TYPE} message, which consumers do not send")

    def _add_credit(self, consumer: _Consumer, n: int) -> None:
        consumer.credits = min(consumer.credits + n, 1 << 20)
        self._credit_waiting = True  # before _dispatch looks for ready slots (see publish)

    def _on_hello(self, sock: zmq.Socket, identity: bytes, hello: Hello) -> None:
        reason = _refusal(hello, self.ring, self._consumers.newest_incarnation)
        if reason is None and self._check_hello is not None:
            reason = self._check_hello(hello)
        if reason:
            self._refuse(sock, identity, reason)
            return
        new_incarnation = self._consumers.replace(identity, hello)
        if self._on_welcome is not None:
            # After the superseded leases are back in the ring, before anything is leased again.
            self._on_welcome(hello, new_incarnation)
        consumer = self._consumers.add(identity, hello)
        if hello.credits:
            self._add_credit(consumer, hello.credits)
        ring = self.ring.spec()
        if consumer.frames:
            ring = {"backend": PAYLOAD_FRAMES, "num_slots": self.ring.num_slots, "slot_bytes": self.ring.slot_bytes}
        welcome = Welcome(
            producer_id=self.producer_id,
            pid=os.getpid(),
            ring=ring,
            describe=self.describe,
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
        )
        if not send_nowait(sock, [identity, welcome.encode()]):
            self.counters.send_failures += 1
            self._consumers.by_identity.pop(identity, None)
            return
        log.info(
            "consumer %s (pid %d, incarnation %d, payload by %s) connected",
            hello.consumer_id,
            hello.pid,
            hello.incarnation,
            hello.payload,
        )

    def _refuse(self, sock: zmq.Socket, identity: bytes, reason: str) -> None:
        self.counters.refused += 1
        self._refused_log.warn(f"refused a consumer: {reason}")
        send_nowait(sock, [identity, Refuse(reason=reason).encode()])

    def _dispatch(self, sock: zmq.Socket) -> None:
        """Lease READY slots to consumers with credit, round robin."""
        now = time.monotonic()
        while (consumer := self._consumers.next_hungry(now)) is not None:
            lease = self.slots.lease_next(consumer.identity)
            if lease is None:
                break
            # Sent from the slot itself: safe because a slot is refilled neither before its ack nor before ZeroMQ
            # is done with every send of it. A lease taken back while its message still waits in ZeroMQ's queue (a
            # consumer silent past the timeout but connected) may be leased again and acked by another consumer,
            # but the filler waits for the queued send's tracker (``SlotTable.mark_sending``), so the late receiver
            # gets the bytes of the batch it was announced, never a half-refilled slot.
            payload = self.ring.send_buffer(lease.slot)[: lease.payload[3]] if consumer.frames else None
            sent = send_nowait(sock, [consumer.identity, lease.payload[2]], payload)
            if sent:
                consumer.credits -= 1
                if payload is not None:  # the slot is not refilled while ZeroMQ may still read it
                    self.slots.mark_sending(lease.slot, sent)
            else:
                # Its queue is full or it is gone: undo this lease and try it again a heartbeat later
                # (a gone consumer expires meanwhile). Its credits stay: taking them would starve
                # a consumer that has nothing left to ack.
                self.counters.socket_blocked += 1
                self.slots.unlease(consumer.identity, lease.slot, lease.generation)
                consumer.paused_until = now + self.heartbeat_interval_s
                self._blocked_log.warn(
                    f"send to consumer {consumer.consumer_id} would block; slot {lease.slot} back in the ring"
                )
        self._credit_waiting = self._consumers.any_credit()

    def stats(self) -> ProducerStats:
        """The ring's counts, the server's counters and what the producer adds (``stats``)."""
        counts = self.slots.counts()
        return ProducerStats(
            producer_id=self.producer_id,
            ring=RingCounts(slots=self.slots.num_slots, **counts),
            blocked_s=round(self.slots.counters.blocked_s, 4),
            published=self.slots.counters.published,
            reclaimed=self.slots.counters.reclaimed,
            released=self.slots.counters.released,
            stale_acks=self.slots.counters.stale_acks,
            consumers=len(self._consumers),
            **self.counters.figures(),
            **(self._stats() if self._stats is not None else {}),
        )

    def _beat(self, sock: zmq.Socket) -> None:
        if not self._consumers:
            return
        frame = Heartbeat(stats=self.stats().to_wire()).encode()
        for identity in list(self._consumers.by_identity):
            if not send_nowait(sock, [identity, frame]):
                self.counters.send_failures += 1


# -- consumer side -------------------------------------------------------------------------------


@dataclass
class Delivery:
    """A leased slot: read ``tensors`` (views into the ring), then ``RingClient.ack`` it."""

    slot: int
    generation: int
    seq: int
    meta: dict
    tensors: dict[str, torch.Tensor]


class RingClient:
    """One consumer connection to one producer."""

    def __init__(
        self,
        endpoint: str,
        consumer_id: str,
        incarnation: int,
        *,
        expect: dict | None = None,
        committed: dict | None = None,
        credits: int = 2,
        heartbeat_interval_s: float = 1.0,
        accept: DeliveryCheck | None = None,
        curve: CurveKeys | None = None,
        ctx: zmq.Context | None = None,
        payload: str = PAYLOAD_RING,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        """``payload``: ``ring`` opens the producer's ring (same host); ``frames`` receives each batch's
        bytes with its announcement (another host), refusing slots larger than ``max_payload_bytes``."""
        if payload not in PAYLOAD_MODES:
            raise ValueError(f"payload must be one of {list(PAYLOAD_MODES)}, got {payload!r}")
        self.endpoint = endpoint
        self.consumer_id = consumer_id
        self.incarnation = incarnation
        self.expect = dict(expect or {})
        self.committed = dict(committed or {})
        self.initial_credits = credits
        self.heartbeat_interval_s = heartbeat_interval_s
        self._accept = accept
        self.payload = payload
        self._frames = payload == PAYLOAD_FRAMES
        self.max_payload_bytes = max_payload_bytes
        self._ctx = ctx or zmq.Context.instance()
        max_frame = max(MAX_FRAME_BYTES, max_payload_bytes) if self._frames else MAX_FRAME_BYTES
        self._sock = make_socket(self._ctx, zmq.DEALER, connect=endpoint, curve=curve, max_frame_bytes=max_frame)
        self._poller = zmq.Poller()  # kept: Socket.poll builds a new Poller on every call
        self._poller.register(self._sock, zmq.POLLIN)
        self._slots: list[torch.Tensor] = []
        self.welcome: Welcome | None = None
        self.ring: RingBuffer | None = None
        self.producer_stats: dict = {}
        self.last_heard = time.monotonic()
        self._next_beat = 0.0
        self.dropped_malformed = 0
        """Messages from the producer that were dropped: undecodable, with the wrong number of frames, or
        batches that fail the checks."""
        self._bad_log = RateLimitedLog()

    def connect(self, timeout_s: float = 30.0) -> Welcome:
        """HELLO, then wait for WELCOME (ring attached) or REFUSE (raises HandshakeRefused)."""
        self.hello()
        welcome = self.await_welcome(timeout_s)
        if welcome is None:
            raise HandshakeTimeout(f"no answer from the producer at {self.endpoint} within {timeout_s:.0f}s")
        return welcome

    def hello(self) -> None:
        """Send HELLO; ``await_welcome`` then takes the answer (a caller that must not wait, e.g. for
        a producer on another host that may be down, asks it with timeout 0 from time to time)."""
        self._send(
            Hello(
                consumer_id=self.consumer_id,
                incarnation=self.incarnation,
                pid=os.getpid(),
                credits=self.initial_credits,
                expect=self.expect,
                committed=self.committed,
                payload=self.payload,
            )
        )

    def await_welcome(self, timeout_s: float) -> Welcome | None:
        """The WELCOME (its ring attached) once it arrives within ``timeout_s``, else None; a REFUSE
        or an answer this consumer cannot use raises HandshakeRefused."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if not self._poller.poll(max(0.0, remaining) * 1000):
                return None
            message, _ = self._recv()
            if isinstance(message, Refuse):
                raise HandshakeRefused(f"producer at {self.endpoint} refused: {message.reason}")
            if isinstance(message, Welcome):
                return self._welcomed(message)
            if remaining <= 0:
                return None  # past the deadline: a flood of other messages must not keep us here

    def _welcomed(self, message: Welcome) -> Welcome:
        # The producer checks our expectations too; checking here as well means a producer
        # that ignores them (or is not ours) never gets its ring opened.
        differs = mismatch(self.expect, message.describe)
        if differs:
            raise HandshakeRefused(f"producer at {self.endpoint}: {differs}")
        backend = message.ring["backend"]
        if (backend == PAYLOAD_FRAMES) != self._frames:
            raise HandshakeRefused(
                f"producer at {self.endpoint} answered a HELLO for payload by {self.payload} "
                f"with a ring of backend {backend!r}"
            )
        if self._frames and message.ring["slot_bytes"] > self.max_payload_bytes:
            raise HandshakeRefused(
                f"producer at {self.endpoint} has slots of {message.ring['slot_bytes']} bytes, "
                f"more than this consumer accepts as frames ({self.max_payload_bytes})"
            )
        self.welcome = message
        if not self._frames:
            self.ring = attach_ring(message.ring)
            self._slots = [self.ring.slot(i) for i in range(self.ring.num_slots)]
        self.last_heard = time.monotonic()
        return message

    def keepalive(self) -> None:
        """Send our heartbeat if one is due, receiving nothing (for a caller busy elsewhere)."""
        now = time.monotonic()
        if now >= self._next_beat:
            self._send(Heartbeat())
            self._next_beat = now + self.heartbeat_interval_s

    def poll(self, timeout_s: float = 0.0) -> list[Delivery]:
        """Receive what has arrived (waiting up to ``timeout_s`` for the first); send heartbeats."""
        deliveries: list[Delivery] = []
        self.keepalive()
        if not self._poller.poll(timeout_s * 1000):
            return deliveries
        while self._readable():
            message, payload = self._recv()
            if message is None:
                continue
            self.last_heard = time.monotonic()
            if isinstance(message, Batch):
                delivery = self._deliver(message, payload)
                if delivery is not None:
                    deliveries.append(delivery)
            elif isinstance(message, Heartbeat):
                self.producer_stats = message.stats
            elif isinstance(message, Refuse):
                raise HandshakeRefused(f"producer at {self.endpoint} dropped this consumer: {message.reason}")
        return deliveries

    def _readable(self) -> bool:
        # Asking EVENTS is cheaper than a zero-timeout poll.
        return bool(self._sock.get(zmq.EVENTS) & zmq.POLLIN)

    def _deliver(self, message: Batch, payload: zmq.Frame | None) -> Delivery | None:
        """The batch as views into its slot (or its payload frame), or None when it does not fit the
        ring, its payload is not exactly the layout's length, or it fails ``accept``."""
        try:
            if self.welcome is None or message.slot >= self.welcome.ring["num_slots"]:
                raise LayoutError(f"slot {message.slot} is outside the ring")
            if self._frames:
                expected = payload_bytes(message.layout, self.welcome.ring["slot_bytes"])
                if len(payload) != expected:
                    raise LayoutError(f"payload frame of {len(payload)} bytes, the layout needs {expected}")
                tensors = read_tensors(_frame_tensor(payload), list(message.layout))
            else:
                tensors = read_tensors(self._slots[message.slot], list(message.layout))
            delivery = Delivery(message.slot, message.generation, message.seq, message.meta, tensors)
            if self._accept is not None:
                self._accept(delivery, self.welcome.describe)
        except (LayoutError, ValueError, TypeError, KeyError) as exc:
            # Nothing was read. The ack returns the slot and the credit this batch used, so an
            # honest producer with a bug loses nothing and our credit window does not shrink.
            self.dropped_malformed += 1
            self._bad_log.warn(f"dropped batch (slot {message.slot}) from the producer at {self.endpoint}: {exc}")
            self._send(Ack(slot=message.slot, generation=message.generation, credit=1))
            return None
        return delivery

    def ack(self, delivery: Delivery, grant: int = 0) -> None:
        """Give the slot back (granting ``grant`` more batches). Do not touch ``delivery.tensors`` after."""
        delivery.tensors = {}
        self._send(Ack(slot=delivery.slot, generation=delivery.generation, credit=grant))

    def grant(self, n: int = 1) -> None:
        """Room for ``n`` more batches."""
        if n > 0:
            self._send(Credit(n=n))

    def producer_silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self, reason: str = "closing") -> None:
        if self._sock.closed:
            return
        if self.dropped_malformed:
            log.warning(
                "dropped %d malformed messages or batches from the producer at %s",
                self.dropped_malformed,
                self.endpoint,
            )
        try:
            # Best effort, never waiting: a socket whose producer refused our CURVE key (or was never
            # reached) has no peer to queue it for, and the producer times our leases out anyway.
            self._sock.send(Bye(reason=reason).encode(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        # A short linger lets BYE leave before the socket goes.
        self._sock.close(linger=200)

    def _send(self, message: Message) -> None:
        # A DEALER send would block only while the producer's queue is full; a live producer drains
        # continuously, so the first try succeeds in practice, and a dead one must not hang us.
        frame = message.encode()
        try:
            self._sock.send(frame, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass
        if not self._sock.poll(5000, zmq.POLLOUT):
            raise TimeoutError(f"cannot send to the producer at {self.endpoint}: its queue is full")
        self._sock.send(frame, flags=zmq.NOBLOCK)

    def _recv(self) -> tuple[Message | None, zmq.Frame | None]:
        """The next message and, for a BATCH of a frames consumer, its payload frame; (None, None)
        when it is dropped: undecodable, or with more or fewer frames than it must have."""
        frame = self._sock.recv(copy=True)
        payload, extra = None, 0
        # The parts of one message arrive together: these receives never wait.
        while self._sock.get(zmq.RCVMORE):
            part = self._sock.recv(copy=False)
            payload = part if payload is None else payload
            extra += 1
        try:
            message = decode(frame)
        except ProtocolError as exc:
            self.dropped_malformed += 1
            self._bad_log.warn(f"dropped a malformed message from the producer at {self.endpoint}: {exc}")
            return None, None
        wanted = 1 if self._frames and isinstance(message, Batch) else 0
        if extra != wanted:
            self.dropped_malformed += 1
            self._bad_log.warn(
                f"dropped a {message.TYPE} message of {1 + extra} frames from the producer at "
                f"{self.endpoint} (expected {1 + wanted})"
            )
            if isinstance(message, Batch):
                # As for any dropped batch: the slot and its credit go back, nothing was read.
                self._send(Ack(slot=message.slot, generation=message.generation, credit=1))
            return None, None
        return message, payload


def _frame_tensor(frame: zmq.Frame) -> torch.Tensor:
    """A received payload frame as a flat uint8 tensor, without a copy where its address allows."""
    if not len(frame):
        return torch.empty(0, dtype=torch.uint8)
    flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)  # keeps the frame alive as long as its views
    if flat.data_ptr() % _MAX_ITEMSIZE:
        # ZeroMQ may keep a small message inside its receive buffer at any address; typed views of
        # it need the alignment a slot has (a copy, of a small message only).
        flat = flat.clone()
    return flat

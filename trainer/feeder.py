"""The trainer's side of the rings: receive batches ahead of the step, copy them out, ack at once.

A ``Feeder`` thread owns one RingClient per producer. It copies each leased slot into the
trainer's own memory (its GPU, or a CPU tensor), waits for the copy, acks the slot and grants a
new credit, then queues the batch. So the ring is never held by the step, the next batches are
staged while the current step runs, and a producer can refill its slot at once.

Exactly-once bookkeeping (``Commits``): per producer, which stream ordinals this trainer has
received and which it has trained. A HELLO carries the received set (a restarted producer must not
produce again what sits in our queue); a checkpoint stores the trained set.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from common.batch import PackedBatch, pad_packed
from common.batchcheck import check_delivery
from common.committed import OrdinalSet
from common.config import load_config
from common.contract import BatchMeta
from common.metrics import ProducerStats
from common.naming import process_start_ticks
from common.protocol import PAYLOAD_FRAMES, Welcome
from common.ring import RingMemoryError
from common.rundir import RunDir
from common.sockets import CurveKeys, SecretsError
from common.status import ProducerStatus
from common.transport import Delivery, HandshakeRefused, RateLimitedLog, RingClient

log = logging.getLogger(__name__)


@dataclass
class Commits:
    """Received and trained ordinals per producer id, shared by the feeder thread and the loop."""

    trained: dict[int, OrdinalSet] = field(default_factory=dict)
    received: dict[int, OrdinalSet] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_checkpoint(cls, committed: dict) -> Commits:
        trained = {int(p): OrdinalSet(s) for p, s in committed.items()}
        received = {int(p): OrdinalSet(s) for p, s in committed.items()}
        return cls(trained, received)

    def mark_received(self, producer: int, ordinal: int, cursor: list) -> bool:
        """Add a received batch; False if it was received before (a duplicate: never train it)."""
        with self._lock:
            seen = self.received.setdefault(producer, OrdinalSet())
            if ordinal in seen:
                return False
            seen.add(ordinal, cursor)
            return True

    def mark_trained(self, producer: int, ordinal: int, cursor: list) -> None:
        with self._lock:
            self.trained.setdefault(producer, OrdinalSet()).add(ordinal, cursor)

    def is_trained(self, producer: int, ordinal: int) -> bool:
        with self._lock:
            return ordinal in self.trained.get(producer, ())

    def trained_state(self) -> dict:
        with self._lock:
            return {str(p): s.state() for p, s in sorted(self.trained.items())}

    def received_state(self, producer: int) -> dict:
        with self._lock:
            return self.received.get(producer, OrdinalSet()).state()


@dataclass
class Received:
    """A batch copied out of a ring, with where it came from."""

    batch: PackedBatch
    producer: int
    ordinal: int
    cursor: list
    meta: BatchMeta
    sample_ids: list[int]
    """The batch's documents (``batch`` may carry one more: the padding)."""
    num_tokens: int
    """Real tokens of the batch, padding excluded."""
    prepared: object = None
    """Its anchors and block masks, once the trainer built them ahead of its step."""


@dataclass(frozen=True)
class ProducerReport:
    """A producer as the trainer sees it at a log window: its last heartbeat's statistics, whether it is connected."""

    stats: ProducerStats
    up: bool


def _remote_producers(run_dir: RunDir) -> dict[int, str]:
    """Producer id -> endpoint of the run's producers on other hosts, from its config.toml (the file
    the trainer runs with). Their status files are on their hosts (or, on a shared file system, name
    the address they listen on, not one to connect to), so the config is where they are found."""
    if not run_dir.config.is_file():
        return {}
    return load_config(run_dir.config).launch.remote_producer_ids()


@dataclass
class _Link:
    producer: int
    client: RingClient | None = None
    pid: int | None = None
    down_since: float | None = None
    stats: dict = field(default_factory=dict)
    """Its last heartbeat's statistics as they came (``ProducerStats``' wire map)."""
    endpoint: str | None = None
    """A producer on another host (launch.remote_producers); None: found by its status file."""
    pending: RingClient | None = None
    """A client whose HELLO awaits its producer's WELCOME (the producer may be down or hung)."""
    pending_since: float = 0.0
    pending_endpoint: str | None = None
    """Where the last HELLO went."""


class Feeder:
    """Background thread that keeps ``depth`` batches staged from every producer."""

    def __init__(
        self,
        run_dir: RunDir,
        *,
        consumer_id: str,
        incarnation: int,
        expect: dict,
        commits: Commits,
        device: torch.device,
        credits: int,
        heartbeat_interval_s: float,
        handshake_timeout_s: float,
        depth: int = 4,
        pad_to: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.consumer_id = consumer_id
        self.incarnation = incarnation
        self.expect = expect
        self.commits = commits
        self.device = device
        self.credits = credits
        self.heartbeat_interval_s = heartbeat_interval_s
        self.handshake_timeout_s = handshake_timeout_s
        self.pad_to = pad_to
        self.queue: queue.Queue[Received] = queue.Queue(maxsize=depth)
        self.links: dict[int, _Link] = {p: _Link(p, endpoint=e) for p, e in _remote_producers(run_dir).items()}
        self.refusal: str | None = None
        """Why a producer refused us, or why its ring could not be opened: fatal for the trainer."""
        self.error: BaseException | None = None
        self._replay_log = RateLimitedLog()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._curve: CurveKeys | None = None
        self._thread = threading.Thread(target=self._run, name="feeder", daemon=True)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self) -> None:
        self._thread.start()

    def get(self, timeout: float) -> Received | None:
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def producer_stats(self) -> dict[int, ProducerReport]:
        """Each producer's last statistics and whether it is connected, by id."""
        with self._lock:
            seen = {p: (link.stats, link.client is not None) for p, link in self.links.items()}
        return {p: ProducerReport(ProducerStats.from_wire(stats), up) for p, (stats, up) in seen.items()}

    def close(self) -> None:
        """Stop the thread and say BYE to every producer (their leases go back at once)."""
        self._stop.set()
        if self._thread.ident is not None:  # a trainer may close before it ever trained
            self._thread.join(timeout=30)

    # -- thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        next_discovery = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_discovery:
                    self._discover()
                    next_discovery = now + 1.0
                got_any = False
                for link in list(self.links.values()):
                    if link.client is None:
                        if link.pending is not None:
                            self._await_welcome(link)
                        continue
                    got_any |= self._pump(link)
                if not got_any:
                    time.sleep(0.002)
        except BaseException as exc:  # the trainer's main thread re-raises it
            log.exception("feeder failed")
            self.error = exc
        finally:
            for link in self.links.values():
                for client in (link.client, link.pending):
                    if client is not None:
                        client.close("trainer stopping")
                link.client = link.pending = None

    def _discover(self) -> None:
        """Say HELLO to producers that are up and not connected (first start, or restarted): local
        ones found by their status files, remote ones (other hosts) by the run's
        launch.remote_producers. Never waits: a hung producer that still looks ready must not stall
        the links to the others; its answer is taken by ``_await_welcome`` whenever it comes."""
        for link in self.links.values():
            if link.endpoint is not None and link.client is None:
                self._hello(link, link.endpoint)
        for status in ProducerStatus.read_all(self.run_dir):
            link = self.links.setdefault(status.id, _Link(status.id))
            if link.endpoint is None and link.client is None and status.ready and status.endpoint:
                self._hello(link, status.endpoint)

    def _up(self, link: _Link, client: RingClient, welcome: Welcome) -> None:
        if link.down_since is not None:
            log.warning(
                "producer %d back after %.1fs (pid %s)", link.producer, time.monotonic() - link.down_since, welcome.pid
            )
        link.client, link.pid, link.down_since = client, welcome.pid, None
        log.info("connected to producer %d (pid %d, ring %s)", link.producer, welcome.pid, welcome.ring.get("backend"))

    def _hello(self, link: _Link, endpoint: str) -> None:
        """Say HELLO at ``endpoint``, or say it again when the last one went unanswered for the
        handshake timeout (its committed state is then renewed) or went to an endpoint the producer
        no longer has (a local producer restarted)."""
        now = time.monotonic()
        if link.pending is not None:
            if link.pending.endpoint == endpoint and now - link.pending_since < self.handshake_timeout_s:
                return
            link.pending.close("no answer")
            link.pending = None
            if link.pending_endpoint == endpoint:
                why = (
                    "down, unreachable, or it and this trainer do not share the run's secrets/curve.json"
                    if link.endpoint is not None
                    else "hung, or busy loading"
                )
                log.warning(
                    "producer %d at %s not answering after %.0fs (%s)",
                    link.producer,
                    endpoint,
                    self.handshake_timeout_s,
                    why,
                )
        curve = None
        if link.endpoint is not None:
            if self._curve is None:
                try:
                    self._curve = CurveKeys.load(self.run_dir.curve_keys)
                except SecretsError as exc:
                    self.refusal = f"cannot reach producer {link.producer} at {endpoint}: {exc}"
                    log.error("%s", self.refusal)
                    return
            curve = self._curve
        link.pending = RingClient(
            endpoint,
            self.consumer_id,
            self.incarnation,
            expect=self.expect,
            committed=self.commits.received_state(link.producer),
            credits=self.credits,
            heartbeat_interval_s=self.heartbeat_interval_s,
            accept=check_delivery,  # a batch that breaks the contract is dropped, never trained
            **({"curve": curve, "payload": PAYLOAD_FRAMES} if curve is not None else {}),
        )
        link.pending.hello()
        link.pending_since, link.pending_endpoint = now, endpoint

    def _await_welcome(self, link: _Link) -> None:
        """Take a producer's answer to our HELLO, if it came."""
        client = link.pending
        try:
            welcome = client.await_welcome(0)
            if welcome is not None and welcome.producer_id != link.producer:
                raise HandshakeRefused(
                    f"the producer at {client.endpoint} is producer {welcome.producer_id}, but "
                    + (
                        f"launch.remote_producers makes it producer {link.producer}: start it with --producer-id {link.producer}"
                        if link.endpoint is not None
                        else f"its status file says producer {link.producer}"
                    )
                )
        except HandshakeRefused as exc:
            client.close("refused")
            link.pending = None
            self.refusal = str(exc)
            log.error("%s", exc)
            return
        except RingMemoryError as exc:
            client.close("cannot open ring")
            link.pending = None
            if client.welcome is not None and process_start_ticks(client.welcome.pid) is None:
                # It died between its WELCOME and our attach: the launcher restarts it; try again then.
                log.warning(
                    "producer %d (pid %d) died while its ring was being opened", link.producer, client.welcome.pid
                )
                return
            self.refusal = f"cannot open producer {link.producer}'s ring: {exc}"
            log.error("%s", self.refusal)
            return
        if welcome is not None:
            link.pending = None
            self._up(link, client, welcome)

    def _pump(self, link: _Link) -> bool:
        client = link.client
        timeout = client.welcome.heartbeat_timeout_s
        try:
            deliveries = client.poll(0)
        except (HandshakeRefused, TimeoutError) as exc:
            log.warning("producer %d dropped us: %s", link.producer, exc)
            deliveries, timeout = [], -1.0
        with self._lock:
            link.stats = client.producer_stats
        if client.producer_silent_s() > timeout:
            log.warning(
                "producer %d silent for %.1fs: training on the others until it is back",
                link.producer,
                client.producer_silent_s(),
            )
            client.close("producer silent")
            link.client, link.down_since = None, time.monotonic()
            return False
        for delivery in deliveries:
            meta = BatchMeta.from_wire(delivery.meta)  # checked on arrival (common/batchcheck.py)
            ordinal = meta.ordinal
            if not self.commits.mark_received(link.producer, ordinal, meta.cursor):
                # Never train a batch twice, whatever a producer sends (rate-limited: a hostile
                # producer must not flood the log).
                self._replay_log.warn(f"producer {link.producer} sent batch {ordinal} again; dropped")
                client.ack(delivery)
                client.grant(1)
                continue
            received = self._copy_out(link.producer, delivery, meta)
            client.ack(delivery)
            while not self._stop.is_set():
                try:
                    self.queue.put(received, timeout=0.05)
                    break
                except queue.Full:
                    # Keep our heartbeats going while the step runs, but receive nothing: a batch
                    # taken off the socket here would be leased and never trained.
                    for other in self.links.values():
                        if other.client is not None:
                            other.client.keepalive()
            client.grant(1)
        return bool(deliveries)

    def _copy_out(self, producer: int, delivery: Delivery, meta: BatchMeta) -> Received:
        """Copy the slot's tensors into our memory and wait for the copy: after this the slot is free."""
        sample_ids = delivery.tensors["sample_ids"].tolist()
        num_tokens = int(delivery.tensors["input_ids"].numel())
        if self._copy_stream is not None:
            with torch.cuda.stream(self._copy_stream):
                # copy=True: a ring on our own GPU would otherwise be aliased, not copied.
                tensors = {k: v.to(self.device, non_blocking=True, copy=True) for k, v in delivery.tensors.items()}
                if self.pad_to:
                    tensors = pad_packed(tensors, self.pad_to)
            self._copy_stream.synchronize()
            # The step reads these on the default stream: without this the allocator could hand
            # their memory to the next copy while the step's kernels still read it.
            for tensor in tensors.values():
                tensor.record_stream(torch.cuda.default_stream(self.device))
        else:
            tensors = {k: v.clone() for k, v in delivery.tensors.items()}
            if self.pad_to:
                tensors = pad_packed(tensors, self.pad_to)
        batch = PackedBatch.from_tensors(tensors, epoch=meta.epoch, meta=meta.to_wire())
        return Received(batch, producer, meta.ordinal, meta.cursor, meta, sample_ids, num_tokens)

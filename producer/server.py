"""The producer process: loads one target once and keeps its ring full for as long as it lives.

    python -m producer.server --run-dir DIR --producer-id I [--device cuda:0] [--listen tcp://0.0.0.0:PORT]
    python -m launch.torchrun --standalone --nproc-per-node 2 -m producer.server ... --device cuda:0,cuda:1

Read top to bottom: ``Producer.__init__`` builds its components, each in a module of its own; ``serve_forever`` is
the loop: the jobs' turn, then the next batch of the shard (replays first), packed, through the target's packed
forward that writes the captured features straight into a ring slot (a host ring fed from a GPU gets them copied on
a side stream), and handed to the publisher thread, which announces the slot once its bytes are complete (CUDA
event): the copy of batch k overlaps the forward of batch k + 1. The server thread (common.transport.RingServer)
leases, heartbeats and handshakes; the status thread writes DIR/producers/p{I}.json once a second. The process
around it (command line, keys, tensor-parallel group, signals, exit codes): producer/exits.py.

Several devices (under torchrun, one rank each): the target is sharded over them (producer/target_model/); rank 0 is
this producer, the other ranks run the same forwards. With --listen (a producer of launch.remote_producers, on
another host than the trainer) it serves tcp with the run's CURVE keys from a host ring, shipping each batch's bytes
as ZeroMQ frames; otherwise an ipc socket in DIR/sockets. It never waits for a trainer: with none connected it fills
its ring and then waits (backpressure). A trainer whose target, layers, dtype or label needs differ is refused at
HELLO.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from common import faults
from common.batch import SlotFormat
from common.config import RunConfig
from common.contract import BatchMeta, mismatch
from common.lifecycle import exit_process
from common.protocol import Hello
from common.ring import RingBuffer
from common.rundir import RunDir
from common.slots import SlotState
from common.transport import RingServer
from producer.acceptance.job import AcceptanceJob
from producer.build import shard_plan, shipped_features, start_target
from producer.data.batching import BatchPlan
from producer.exits import Placement, run_producer
from producer.figures import ProducerFigures
from producer.jobs import ProducerJob
from producer.ring import Headroom, open_ring, ring_endpoint
from producer.stream import BatchStream, PlannedBatch, parse_committed
from producer.target_model.capture import Target

log = logging.getLogger(__name__)


@dataclass
class _Filled:
    """A slot filled, or being filled: the publisher announces it once ``done`` (the features' copy) completes."""

    slot: int
    planned: PlannedBatch
    layout: list
    meta: BatchMeta
    done: torch.cuda.Event | None
    keepalive: tuple  # the tensors that copy reads, alive until it is done


class Producer:
    """One target, one ring, one shard of the data (rank 0 of a tensor-parallel producer: the whole
    producer, its followers run each forward with it)."""

    target: Target  # the target, loaded once, its head exported for the trainer (producer/build.py)
    plan: BatchPlan  # this shard's batches in their order (producer/data/build.py, by producer/build.py)
    stream: BatchStream  # the plan as handed out: replays first, committed batches dropped (producer/stream.py)
    slot_format: SlotFormat  # what a slot holds besides the documents: the features' widths and dtype (common/batch.py)
    ring: RingBuffer  # the slots, in host or the target's GPU memory (producer/ring.py)
    server: RingServer  # leases the slots to trainers: handshakes, heartbeats (common/transport.py)
    headroom: Headroom  # ring.headroom_slots, kept free while trainers take batches (producer/ring.py)
    jobs: list[ProducerJob]  # what runs on the target between two batches (producer/jobs.py), made when it serves
    figures: ProducerFigures  # its throughput and its status file (producer/figures.py)

    def __init__(self, cfg: RunConfig, run_dir: RunDir, placement: Placement) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.producer_id, self.group = placement.producer_id, placement.group
        self.stop = threading.Event()
        self.target, self.load_s = start_target(cfg, run_dir, self.producer_id, placement.device, self.group)
        self.plan = shard_plan(cfg, self.target, run_dir, self.producer_id)
        self.stream = BatchStream(self.plan, run_dir.committed_for(self.producer_id))
        sized_by_epochs = cfg.training.max_steps == 0  # the trainer sizes the run from the epoch's batch count
        self.figures = ProducerFigures(self.plan, self.stream, self.plan.epoch_batches() if sized_by_epochs else None)
        target = self.target
        self.slot_format = SlotFormat(target.aux_width, target.hidden_size, target.dtype, cfg.ships_final_hidden)
        self.ring = open_ring(cfg, run_dir, self.producer_id, self.slot_format, target.device, placement.listen)
        self.describe = shipped_features(cfg, target, self.producer_id).to_wire()
        self.server = RingServer(
            ring_endpoint(run_dir, self.producer_id, placement.listen),
            self.ring,
            producer_id=self.producer_id,
            describe=self.describe,
            heartbeat_interval_s=cfg.ring.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.ring.heartbeat_timeout_s,
            check_hello=self._check_hello,
            on_welcome=self._on_welcome,
            stats=self.figures.throughput,
            curve=placement.curve,
        )
        self.headroom = Headroom(cfg.ring, self.server.slots, self.stop)
        self.jobs = []
        self.figures.started(target, self.group, self.ring, self.server.endpoint, self.load_s)
        on_gpu = target.device.type == "cuda"
        self.ring_on_target_device = (self.ring.backend == "cuda") == on_gpu
        self.copy_stream = torch.cuda.Stream(target.device) if on_gpu else None  # a host ring's copies from the GPU
        self._filled: queue.Queue[_Filled | None] = queue.Queue()

    # -- handshake -------------------------------------------------------------------------------

    def _check_hello(self, hello: Hello) -> str | None:
        """Refuse a trainer whose expectations differ from what this producer ships; say which."""
        differs = mismatch(hello.expect, self.describe)
        if differs:
            return differs
        try:
            parse_committed(hello.committed)
        except (TypeError, ValueError) as exc:
            return f"malformed committed state: {exc}"
        return None

    def _on_welcome(self, hello: Hello, new_incarnation: bool) -> None:
        faults.point("producer.handshake")
        if new_incarnation:
            self._reconcile(hello)
        faults.point("trainer.handshake", victim=hello.pid)

    def _reconcile(self, hello: Hello) -> None:
        def ring_ordinals() -> set[int]:
            return {payload[1]["ordinal"] for payload in self.server.slots.payloads(SlotState.READY, SlotState.LEASED)}

        replays = self.stream.reconcile(hello.committed, ring_ordinals)
        committed = self.stream.committed_snapshot()
        dropped = self.server.slots.discard_ready(lambda payload: committed(payload[1]["ordinal"]))
        log.info(
            "trainer incarnation %d: %d committed batches dropped from the ring, %d to recompute",
            hello.incarnation,
            len(dropped),
            replays,
        )

    # -- status ----------------------------------------------------------------------------------

    def write_status(self, ready: bool) -> None:
        jobs = {job.name: job.status() for job in self.jobs}
        path = self.run_dir.producer_status(self.producer_id)
        self.figures.write_status(path, self.producer_id, self.server.stats(), jobs, ready)

    def _status_loop(self) -> None:
        checkpoint = None
        while not self.stop.wait(1.0):
            checkpoint = self._forget_checkpointed(checkpoint)
            self.write_status(ready=True)

    def _forget_checkpointed(self, seen: Path | None) -> Path | None:
        """Prune the stream's record of handed-out batches by what a new checkpoint committed;
        returns the checkpoint now seen. (A HELLO prunes it too, but a trainer may live for days.)"""
        latest = self.run_dir.latest_checkpoint()
        if latest is not None and latest != seen:
            self.stream.forget_committed(self.run_dir.committed_for(self.producer_id))
        return latest

    # -- the loop --------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        threads = self._start_serving()
        try:
            while not self.stop.is_set():
                if self.group is not None:
                    self.group.keepalive()
                for job in self.jobs:
                    job.between_batches()
                if not self.headroom.may_fill():
                    self.headroom.hold_back(0.005)
                    continue
                slot = self.server.acquire(timeout_s=0.2)
                if slot is None:  # the ring is full
                    for job in self.jobs:
                        job.while_ring_full()
                    continue
                try:
                    planned = self.stream.take()
                    faults.point("producer.fill")
                    self._filled.put(self._fill(slot, planned))
                except BaseException:
                    self.server.abort(slot)
                    raise
        finally:
            self._filled.put(None)
            threads[0].join(timeout=30)
            if self.stop.is_set():  # a clean stop: the last figures stay for `status` (a run may end within a period)
                threads[1].join(timeout=5)
                self.write_status(ready=True)
            self.close()

    def _start_serving(self) -> list[threading.Thread]:
        """Open the server, show the producer ready, start the publisher and status threads and producer 0's
        evaluations; the threads."""
        self.server.start()
        self.write_status(ready=True)
        target = self.target
        kernels = f"attention {target.attention}" + (f", Gated-DeltaNet {target.linear}" if target.linear else "")
        log.info(
            f"producer {self.producer_id} ready in {self.load_s:.1f}s: {target.identity}, layers {target.layer_ids}, "
            f"{kernels}{', compiled' if target.compiled else ''}, ring {self.ring.num_slots} x {self.ring.slot_bytes} "
            f"bytes ({self.ring.backend}), endpoint {self.server.endpoint}"
        )
        threads = [
            threading.Thread(target=self._publish_loop, name="publisher", daemon=True),
            threading.Thread(target=self._status_loop, name="status", daemon=True),
        ]
        for thread in threads:
            thread.start()
        if self.producer_id == 0:
            on_change = partial(self.write_status, ready=True)
            self.jobs.append(AcceptanceJob(self.cfg, self.run_dir, self.producer_id, target, self.group, on_change))
        return threads

    def _fill(self, slot: int, planned: PlannedBatch) -> _Filled:
        batch = self.plan.materialize(planned.cursor, planned.sample_ids)
        stats = self.figures.packed(batch)
        if self.target.device.type == "cuda":
            batch = batch.pin_memory()
        layout, views = self.slot_format.lay_out(self.server.slot_view(slot), batch, non_blocking=True)
        done = None
        keepalive: tuple = (batch,)
        if self.ring_on_target_device:
            self.target.capture(batch, out_aux=views["aux_hidden"], out_last=views.get("last_hidden"))
            if self.target.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        else:
            # GPU target, host ring: copy on a side stream so the next forward need not wait for it.
            features = self.target.capture(batch)
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                views["aux_hidden"].copy_(features.aux_hidden, non_blocking=True)
                if features.last_hidden is not None:
                    views["last_hidden"].copy_(features.last_hidden, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            keepalive = (batch, features)
        meta = BatchMeta(
            producer=self.producer_id,
            ordinal=planned.ordinal,
            cursor=list(planned.cursor),
            epoch=planned.cursor.epoch,
            tokens=batch.num_tokens,
            docs=batch.num_docs,
            max_doc_len=stats.max_doc_len,
            replay=planned.replay,
        )
        return _Filled(slot, planned, layout, meta, done, keepalive)

    def _publish_loop(self) -> None:
        while True:
            filled = self._filled.get()
            if filled is None:
                return
            if filled.done is not None:
                filled.done.synchronize()
            published = self.stream.publish(
                filled.planned.ordinal,
                publish=lambda: self.server.publish(filled.slot, filled.layout, filled.meta.to_wire()),
                drop=lambda: self.server.abort(filled.slot),  # a trainer committed it while we computed it
            )
            if published:
                self.figures.published(filled.meta.tokens, self.server.slots.counters.blocked_s)
                faults.point("producer.publish")

    def request_stop(self) -> None:
        """Stop the loop (a signal's handler): it finishes the fill in flight, then closes."""
        self.stop.set()
        self.server.slots.wake()

    def close(self) -> None:
        self.stop.set()
        if self.group is not None:
            self.group.stop_followers()
        self.server.close()
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        self.ring.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m producer.server``: the process (its command line, exit code: producer/exits.py) of a producer."""
    return run_producer(argv, start=Producer)


if __name__ == "__main__":
    exit_process(main())

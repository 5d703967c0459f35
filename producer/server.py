"""The producer process: loads one target once and keeps its ring full for as long as it lives.

    python -m producer.server --run-dir DIR --producer-id I [--device cuda:0] [--listen tcp://0.0.0.0:PORT]
    python -m launch.torchrun --standalone --nproc-per-node 2 -m producer.server ... --device cuda:0,cuda:1

Several devices (under torchrun, one rank each): the target is sharded over them (tensor parallel,
producer/target_model/tensor_parallel.py). Rank 0 is the producer described here; the other ranks only run the
same forwards.

With --listen (a producer on another host than the trainer, listed in launch.remote_producers) it
serves tcp with the run's CURVE keys (DIR/secrets/curve.json) from a host ring, shipping each batch's
bytes as ZeroMQ frames; otherwise an ipc socket in DIR/sockets.

Main thread (compute): take the next batch of this producer's shard (replays first), pack it,
run the target's packed forward writing the captured features straight into a ring slot (or, for
a host ring fed from a GPU, copying them on a side stream), and hand the slot to the publisher.
Publisher thread: waits for the slot's bytes to be complete (CUDA event) and announces it, so the
copy of batch k overlaps the forward of batch k + 1. Server thread (common.transport.RingServer):
leases, heartbeats, handshakes. Status thread: DIR/producers/p{I}.json once a second.

The producer never waits for a trainer: with none connected it fills its ring and then waits
(backpressure). A trainer whose target, layers, dtype or label needs differ is refused at HELLO.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common import faults
from common.batch import SlotFormat
from common.codec import DTYPE_NAMES
from common.config import ConfigError, RunConfig
from common.contract import BatchMeta, Features, mismatch
from common.drafter.draft_config import build_target_layer_ids
from common.lifecycle import EXIT_CONFIG_ERROR, exit_process, start_role, stop_on_signals
from common.naming import owner_identity, run_tag, sweep_stale
from common.protocol import Hello
from common.ring import RingMemoryError, create_ring
from common.rundir import RunDir
from common.slots import SlotState
from common.sockets import CurveKeys, SecretsError, ipc_endpoint
from common.status import ProducerStatus
from common.transport import RingServer
from producer.acceptance.job import AcceptanceJob
from producer.data.batching import BatchPlan, RunningBatchStats, batch_stats
from producer.data.build import build_plan, run_sources
from producer.data.files import DataError
from producer.jobs import ProducerJob
from producer.stream import BatchStream, PlannedBatch, parse_committed
from producer.target_model.capture import Target
from producer.target_model.follower import follow
from producer.target_model.load import build_target_config, check_tensor_parallel
from producer.target_model.tensor_parallel import TensorParallelGroup, split_devices

log = logging.getLogger(__name__)


def feature_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The target layers both sides use: the configured ones, else the docs/dflash.md rule."""
    return list(cfg.drafter.target_layer_ids) or build_target_layer_ids(num_target_layers, cfg.drafter.num_layers)


def export_target_head(target: Target, out_dir: Path) -> None:
    """Save embed_tokens, the final norm and lm_head (and config.json) for the trainer, once.

    Needed when the target has random weights: the drafter must share them bit for bit. A sharded
    target's head is gathered first, always: its followers call ``target.head_tensors()`` with it.
    """
    tensors = target.head_tensors()
    if (out_dir / "model.safetensors").is_file():
        return
    from safetensors.torch import save_file

    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    target.model.config.to_json_file(str(tmp / "config.json"))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another producer got there first; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def device_setting(cfg: RunConfig, producer_id: int) -> str:
    """Where a producer's devices were set, for error messages."""
    if cfg.launch.producer_devices and producer_id < cfg.launch.local_producers:
        return f"launch.producer_devices[{producer_id}]"
    return "--device"


@contextlib.contextmanager
def _unloadable_target_is_a_config_error(cfg: RunConfig):
    """A checkpoint that does not load (missing or corrupt shards, a config its model class rejects) fails the
    same way on every try: ConfigError (exit 2). CUDA out-of-memory is a RuntimeError and passes through."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, KeyError, AttributeError, TypeError, SafetensorError) as exc:
        where = f"target.path: {cfg.target.path}" if cfg.target.path else "target: the configured model"
        raise ConfigError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from None


def load_target(
    cfg: RunConfig, run_dir: RunDir, producer_id: int, device: str | None, group: TensorParallelGroup | None
) -> Target:
    """The producer's target, and with random weights its head exported for the trainer.

    With a tensor-parallel group every rank runs this, in step: it holds every collective of the
    start (sharded loading, the gathers of the identity and of the head); afterwards rank 0 alone
    decides what the group does.
    """
    target_cfg = dataclasses.replace(cfg.target, device=device) if device else cfg.target
    with _unloadable_target_is_a_config_error(cfg):
        config = build_target_config(target_cfg)
    if group is not None:
        try:
            check_tensor_parallel(config, group.size)
        except ValueError as exc:
            raise ConfigError(f"{device_setting(cfg, producer_id)}: {exc}") from None
    layer_ids = feature_layer_ids(cfg, config.num_hidden_layers)
    with _unloadable_target_is_a_config_error(cfg):
        target = Target.load(target_cfg, layer_ids, capture_last_hidden=cfg.ships_final_hidden, group=group)
    if cfg.target.path is None:
        if group is None or group.rank == 0:
            export_target_head(target, run_dir.target_head)
        else:
            target.head_tensors()  # rank 0's export gathers the sharded head: every rank takes part
    if group is not None:
        group.following = True  # from here on the followers wait for rank 0's messages
    return target


def shard_plan(cfg: RunConfig, target: Target, run_dir: RunDir, producer_id: int) -> BatchPlan:
    """This producer's shard of the run's training data (its held-out records left out), in its deterministic order;
    with ``data.regenerate`` their answers written by the target as the stream goes (producer/regenerate.py)."""
    vocab_size = int(target.model.config.vocab_size)
    if cfg.data.regenerate:
        from producer.regenerate import regenerated_source

        source = regenerated_source(cfg, vocab_size, target.model, run_dir, producer_id)
    else:
        source, _ = run_sources(cfg, vocab_size, held_out_file=run_dir.held_out)
    return build_plan(cfg, source, producer_id, cfg.launch.total_producers)


@dataclass
class _Filled:
    slot: int
    planned: PlannedBatch
    layout: list
    meta: BatchMeta
    done: torch.cuda.Event | None
    keepalive: tuple


class Producer:
    """One target, one ring, one shard of the data (rank 0 of a tensor-parallel producer: the whole
    producer, its followers run each forward with it)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir,
        producer_id: int,
        device: str | None,
        listen: str | None = None,
        curve: CurveKeys | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.producer_id = producer_id
        self.group = group
        self.stop = threading.Event()
        self.needs_last = cfg.ships_final_hidden

        started = time.monotonic()
        self.target = load_target(cfg, run_dir, producer_id, group.device if group is not None else device, group)
        self.layer_ids = self.target.layer_ids
        if self.target.device.type == "cuda":
            torch.cuda.set_device(self.target.device)
            self.target.warmup(min(4096, cfg.batching.token_budget))
        self.load_s = time.monotonic() - started

        self.plan = shard_plan(cfg, self.target, run_dir, producer_id)
        self.stream = BatchStream(self.plan, run_dir.committed_for(producer_id))
        # With training.max_steps = 0 the trainer sizes the run from the epoch's batch count.
        self.epoch_batches = (
            sum(len(self.plan.window_batches(0, w)) for w in range(self.plan.num_windows()))
            if cfg.training.max_steps == 0
            else None
        )
        self.batch_stats = RunningBatchStats()
        self.jobs: list[ProducerJob] = []
        """What this producer does on its target between two batches (producer/jobs.py); made when it serves."""

        self.dtype = self.target.dtype
        self.max_docs = cfg.batching.max_docs_per_batch or cfg.batching.token_budget
        self.slot_format = SlotFormat(self.target.aux_width, self.target.hidden_size, self.dtype, self.needs_last)
        self.slot_bytes = self.slot_format.slot_bytes(cfg.batching.token_budget, self.max_docs)
        backend = cfg.ring.backend
        if backend == "auto":
            # Consumers on other hosts need the bytes in host memory (sent as frames from there).
            backend = "cuda" if self.target.device.type == "cuda" and listen is None else "host"
        device_index = (self.target.device.index or 0) if self.target.device.type == "cuda" else 0
        self.ring = create_ring(
            backend,
            num_slots=cfg.ring.num_slots,
            slot_bytes=self.slot_bytes,
            run_tag=run_tag(run_dir.root),
            role=f"p{producer_id}",
            device=device_index,
        )
        self.ring_on_target_device = (backend == "cuda") == (self.target.device.type == "cuda")
        self.copy_stream = torch.cuda.Stream(self.target.device) if self.target.device.type == "cuda" else None

        self.describe = Features(
            producer_id=producer_id,
            target_identity=self.target.identity,
            layer_ids=list(self.layer_ids),
            dtype=DTYPE_NAMES[self.target.dtype],
            last_hidden=self.needs_last,
            hidden_size=self.target.hidden_size,
            vocab_size=int(self.target.model.config.vocab_size),
            token_budget=cfg.batching.token_budget,
        ).to_wire()
        run_dir.sockets.mkdir(parents=True, exist_ok=True, mode=0o700)
        sweep_stale(run_dir.sockets, prefix=f"p{producer_id}.", suffix=".ipc")
        self.endpoint = listen or ipc_endpoint(run_dir.sockets / f"p{producer_id}.{owner_identity()}.ipc")
        self.server = RingServer(
            self.endpoint,
            self.ring,
            producer_id=producer_id,
            describe=self.describe,
            heartbeat_interval_s=cfg.ring.heartbeat_interval_s,
            heartbeat_timeout_s=cfg.ring.heartbeat_timeout_s,
            check_hello=self._check_hello,
            on_welcome=self._on_welcome,
            stats=self._throughput_stats,
            curve=curve,
        )
        self._filled: queue.Queue[_Filled | None] = queue.Queue()
        self._leases_seen, self._last_lease = 0, float("-inf")  # for ring.headroom_slots
        self._published_tokens: deque[tuple[float, int, float]] = deque()
        self._lock = threading.Lock()

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

    # -- statistics ------------------------------------------------------------------------------

    def _throughput_stats(self) -> dict[str, Any]:
        """The producer's figures of its ``ProducerStats`` (common/metrics.py), by field."""
        now = time.monotonic()
        with self._lock:
            while self._published_tokens and now - self._published_tokens[0][0] > 10.0:
                self._published_tokens.popleft()
            window = list(self._published_tokens)
        if len(window) >= 2:
            span = window[-1][0] - window[0][0]
            tokens_per_s = sum(t for _, t, _ in window[1:]) / span if span > 0 else 0.0
            blocked = (window[-1][2] - window[0][2]) / span if span > 0 else 0.0
        else:
            tokens_per_s, blocked = 0.0, 0.0
        return {
            "tokens_per_s": round(tokens_per_s, 1),
            "blocked_fraction": round(min(1.0, blocked), 4),
            "batching": self.batch_stats.as_dict(),
            "data": {**self.plan.source.stats.as_dict(), **self.plan.source.cache.as_dict()},
            "stream": self.stream.position(),
        }

    def write_status(self, ready: bool) -> None:
        group = self.group  # the launcher knows a tensor-parallel producer by the pid of its torchrun
        ProducerStatus.showing(
            self.server.stats(),  # the ring's counts, the server's counters and this producer's throughput
            ring={"backend": self.ring.backend, "slot_bytes": self.slot_bytes},
            id=self.producer_id,
            pid=os.getpid(),
            torchrun_pid=group.torchrun_pid if group else None,
            tensor_parallel={"size": group.size, "pids": group.pids} if group else None,
            ready=ready,
            endpoint=self.endpoint,
            updated=time.time(),
            load_s=round(self.load_s, 2),
            device=",".join(group.devices) if group is not None else str(self.target.device),
            kernels={
                "attention": self.target.attention,
                "linear_attention": self.target.linear,
                "compiled": self.target.compiled,
            },
            jobs={job.name: job.status() for job in self.jobs},
            epoch_batches=self.epoch_batches,
        ).write(self.run_dir.producer_status(self.producer_id))

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

    # -- compute ---------------------------------------------------------------------------------

    def _fill(self, slot: int, planned: PlannedBatch) -> _Filled:
        batch = self.plan.materialize(planned.cursor, planned.sample_ids)
        stats = batch_stats(batch)
        self.batch_stats.update(stats)
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
                with self._lock:
                    self._published_tokens.append(
                        (time.monotonic(), filled.meta.tokens, self.server.slots.counters.blocked_s)
                    )
                faults.point("producer.publish")

    def serve_forever(self) -> None:
        self.server.start()
        self.write_status(ready=True)
        log.info(
            "producer %d ready in %.1fs: %s, layers %s, attention %s%s%s, ring %s x %d bytes (%s), endpoint %s",
            self.producer_id,
            self.load_s,
            self.target.identity,
            self.layer_ids,
            self.target.attention,
            f", Gated-DeltaNet {self.target.linear}" if self.target.linear else "",
            ", compiled" if self.target.compiled else "",
            self.ring.num_slots,
            self.slot_bytes,
            self.ring.backend,
            self.endpoint,
        )
        threads = [
            threading.Thread(target=self._publish_loop, name="publisher", daemon=True),
            threading.Thread(target=self._status_loop, name="status", daemon=True),
        ]
        for thread in threads:
            thread.start()
        if self.producer_id == 0:
            self.jobs.append(
                AcceptanceJob(
                    self.cfg,
                    self.run_dir,
                    self.producer_id,
                    self.target,
                    self.group,
                    on_change=lambda: self.write_status(ready=True),
                )
            )
        try:
            while not self.stop.is_set():
                if self.group is not None:
                    self.group.keepalive()
                for job in self.jobs:
                    job.between_batches()
                if not self._may_fill():
                    self._hold_back(0.005)
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

    def _may_fill(self) -> bool:
        """Whether to fill a slot now: always, unless ring.headroom_slots asks to keep some free
        while the consumers keep taking batches (see RingConfig.headroom_slots)."""
        headroom = self.cfg.ring.headroom_slots
        if headroom == 0:
            return True
        counters = self.server.slots.counters
        now = time.monotonic()
        if counters.leased != self._leases_seen:
            self._leases_seen, self._last_lease = counters.leased, now
        if now - self._last_lease > self.cfg.ring.pause_detect_s:
            return True  # consumers paused or absent: fill the headroom for them
        return self.server.slots.counts()["free"] > headroom

    def _hold_back(self, seconds: float) -> None:
        """Wait while the headroom is kept free; counted as blocked time (the ring is full enough)."""
        self.stop.wait(seconds)
        self.server.slots.counters.blocked_s += seconds  # only this thread writes blocked_s

    def close(self) -> None:
        self.stop.set()
        if self.group is not None:
            self.group.stop_followers()
        self.server.close()
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        self.ring.close()


def remote_keys(cfg: RunConfig, run_dir: RunDir, producer_id: int, listen: str) -> CurveKeys:
    """The run's CURVE keys for a producer serving other hosts on ``listen``; ConfigError says what
    is wrong (not tcp, an id launch.remote_producers does not give, a GPU ring, missing keys)."""
    if not listen.startswith("tcp://"):
        raise ConfigError(
            f"--listen {listen}: must be a tcp:// endpoint (producers on the trainer's host need no --listen)"
        )
    remote = cfg.launch.remote_producer_ids()
    if producer_id not in remote:
        raise ConfigError(
            f"--producer-id {producer_id}: a producer started with --listen must be one of launch.remote_producers, "
            f"whose ids follow the {cfg.launch.local_producers} local ones: {sorted(remote) or 'none listed'}"
        )
    if cfg.ring.backend == "cuda":
        raise ConfigError(
            "ring.backend: a producer serving other hosts (--listen) sends from host memory: use host or auto, not cuda"
        )
    try:
        return CurveKeys.load(run_dir.curve_keys)
    except SecretsError as exc:
        raise ConfigError(
            f"{exc}. Copy the run's secrets/curve.json from the trainer's host into {run_dir.root}/secrets/ "
            "(mode 0600, folder 0700)."
        ) from None


def run_producer(run_dir: str | Path, producer_id: int, device: str | None = None, listen: str | None = None) -> int:
    """Entry point of a producer process (of each rank of a tensor-parallel one); returns its exit code."""
    group = None
    try:
        root, cfg = start_role(run_dir)
        curve = remote_keys(cfg, root, producer_id, listen) if listen else None
        devices = split_devices(device) if device else []
        if len(devices) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            group = TensorParallelGroup.join(devices, device_setting(cfg, producer_id))
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    try:
        if group is not None and group.rank > 0:
            return run_follower(cfg, root, producer_id, group)
        return serve(cfg, root, producer_id, device, listen, curve, group)
    finally:
        if group is not None:
            group.stop_followers()
            group.close()


def serve(
    cfg: RunConfig,
    root: RunDir,
    producer_id: int,
    device: str | None,
    listen: str | None,
    curve: CurveKeys | None,
    group: TensorParallelGroup | None,
) -> int:
    """Run the producer until SIGTERM / SIGINT; the exit code."""
    try:
        producer = Producer(cfg, root, producer_id, device, listen=listen, curve=curve, group=group)
    except (ConfigError, RingMemoryError, ValueError) as exc:
        log.error("cannot start producer %d: %s", producer_id, exc)
        return EXIT_CONFIG_ERROR

    def request_stop(signum: int) -> None:
        log.info("signal %d: stopping", signum)
        producer.stop.set()
        producer.server.slots.wake()

    stop_on_signals(request_stop)
    try:
        producer.serve_forever()
    except (DataError, ConfigError) as exc:  # found while producing (an epoch without a good document, a
        log.error("producer %d: %s", producer_id, exc)  # regeneration cache too large): the same on every try
        return EXIT_CONFIG_ERROR
    log.info("producer %d stopped cleanly", producer_id)
    return 0


def run_follower(cfg: RunConfig, root: RunDir, producer_id: int, group: TensorParallelGroup) -> int:
    """A rank > 0 of a tensor-parallel producer: load this rank's shards, then run rank 0's forwards."""
    try:
        target = load_target(cfg, root, producer_id, group.device, group)
    except (ConfigError, ValueError) as exc:
        log.error("cannot start producer %d rank %d: %s", producer_id, group.rank, exc)
        return EXIT_CONFIG_ERROR
    log.info(
        "producer %d rank %d of %d ready on %s (%s): following rank 0",
        producer_id,
        group.rank,
        group.size,
        group.devices[group.rank],
        target.identity,
    )
    return follow(group, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DFlash producer: one target, one ring, one data shard.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--producer-id", type=int, required=True)
    parser.add_argument(
        "--device",
        default=None,
        help="overrides target.device for this producer; several, comma-separated, under torchrun: tensor parallel",
    )
    parser.add_argument(
        "--listen",
        default=None,
        metavar="tcp://ADDRESS:PORT",
        help="serve consumers on other hosts here (a producer of launch.remote_producers)",
    )
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    name = f"producer-{args.producer_id}" + (f".r{rank}" if rank else "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    return run_producer(args.run_dir, args.producer_id, args.device, args.listen)


if __name__ == "__main__":
    exit_process(main())

"""Trainer checkpoints: a host snapshot taken between two steps, written to disk while training goes on.

A checkpoint is the folder ``checkpoints/step-N``: ``drafter/`` (z-lab format, fp32), ``train_state/``
(optimizer, schedule, RNGs: the tree in ``tree.pt``, its large tensors in ``tensors.safetensors``) and
``trainer_state.json`` (step, committed batches). Written (and pruned to ``keep_last``) by
``CheckpointWriter``, read back by ``load_checkpoint``. It is written under a temporary name, fsynced,
renamed whole, and only then named by ``latest.json``, so a kill at any point leaves the previous
checkpoint as the latest and nothing half-written that a restart would read. (Checkpoints written before
``train_state/`` hold one ``train_state.pt``, and for a while the tensors were in ``tensors-K.safetensors``
shards; ``read_train_state`` reads all of them.)

The weights and the train state's tensors are written by several threads at once, each a contiguous run of
the bytes of both files (trainer/tensor_files.py). The Qwen3-8B draft's 12.6 GB (fp32 weights and AdamW
state) take seconds even so, seconds the GPUs would idle through. Instead the trainer copies the state to host
memory (page-locked buffers, reused, so the copy runs at PCIe speed) and a background thread writes it. A
snapshot is taken after an optimizer step and before the next one, so weights, optimizer state and committed
batches agree, and the exactly-once bookkeeping is the same as for a synchronous save. One write is in
flight at a time: the next checkpoint first waits for the one before, which also frees its buffers. The
one exception is restart-trainer during a write: the state handed over (trainer/handover.py) is later than
the write's, so the old trainer does not wait for it (``supersede``) and leaves under it, as if killed
there; latest.json never goes back to an earlier step (``RunDir.advance_latest``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

from common import faults
from common.acceptance import records
from common.drafter.base import Drafter
from common.drafter.draft_config import DraftConfig
from common.drafter.export import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_METADATA, export_zlab, write_config, zlab_config
from common.rundir import CheckpointError, RunDir, atomic_write_json, fsync_file, read_json, replace_dir
from trainer.ranks import Ranks
from trainer.sharding import is_sharded
from trainer.tensor_files import WRITE_THREADS, TensorFile, write_tensor_files

log = logging.getLogger(__name__)
TRAIN_STATE_DIR = "train_state"
TREE_FILE = "tree.pt"
TENSORS_FILE = "tensors.safetensors"
INLINE_BYTES = 1 << 20
"""Tensors of the train state smaller than this stay in tree.pt (steps, RNG states); larger ones go to TENSORS_FILE."""
_TENSOR_REF = "__safetensors__"


class HostStaging:
    """Host copies of state trees (nested dicts and lists of tensors), in buffers kept between copies.

    Each tensor is copied into a buffer of its shape and dtype, allocated the first time and reused
    after (no page faults over gigabytes at every checkpoint): page-locked for a CUDA tensor, with one
    synchronisation for the whole tree. A CPU tensor is copied too: training goes on changing the
    original in place. A sharded tensor (FSDP's DTensor) is gathered whole first, one at a time, so
    no more than one whole tensor is on the GPU at once.
    """

    shared = False
    """Whether the buffers are in shared memory (trainer/handover.py), so that a successor can map them."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, tree: Any, prefix: str = "", keep: bool = True) -> Any:
        """A copy of ``tree`` whose tensors are whole, on the host and owned by nobody else.

        With sharded tensors in ``tree`` this is a collective: every rank of their group calls it on
        a tree of the same structure. Ranks that do not keep the result pass ``keep=False`` (and get None).
        """
        devices: set[torch.device] = set()
        copied = map_tensors(tree, lambda key, value: self._copy_tensor(key, value, devices, keep), prefix)
        for device in devices:
            torch.cuda.synchronize(device)
        return copied if keep else None

    def _copy_tensor(
        self, key: str, value: torch.Tensor, devices: set[torch.device], keep: bool
    ) -> torch.Tensor | None:
        if is_sharded(value):
            value = value.full_tensor()  # an all-gather: every rank walks the tree in the same order
        if not keep:
            return None
        on_gpu = value.device.type == "cuda"
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = self._buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=on_gpu)
        buffer.copy_(value.detach(), non_blocking=on_gpu)
        if on_gpu:
            devices.add(value.device)
        return buffer


def map_tensors(tree: Any, fn: Callable[[str, torch.Tensor], Any], key: str = "") -> Any:
    """``tree`` (nested dicts, lists and tuples) with each tensor replaced by ``fn(path, tensor)``, in the tree's
    order. A path is ``key`` followed by ``/name`` or ``/index`` per level: the keys of HostStaging's buffers, of
    a handover's segment layouts and of the checkpoint's tensor file. Anything else is kept (numbers, strings, None)."""
    if isinstance(tree, torch.Tensor):
        return fn(key, tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn, f"{key}/{k}") for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn, f"{key}/{i}") for i, v in enumerate(tree))
    return tree


@dataclass
class TrainerState:
    """What a trainer resumes from: a checkpoint folder read back, or the state its predecessor handed over."""

    weights: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    """The train state: optimizer, schedule, RNGs (``read_train_state``)."""
    meta: dict[str, Any]
    """trainer_state.json: step, committed batches, ..."""
    drafter_config: dict[str, Any]
    """The drafter's config.json (z-lab format)."""


def load_checkpoint(path: Path) -> TrainerState:
    """Read checkpoint folder ``path`` (``checkpoints/step-N``) to host memory."""
    drafter = path / "drafter"
    return TrainerState(
        weights=load_file(str(drafter / WEIGHTS_FILE)),
        train_state=read_train_state(path),
        meta=read_json(path / "trainer_state.json"),
        drafter_config=json.loads((drafter / CONFIG_FILE).read_text()),
    )


def read_train_state(path: Path) -> dict[str, Any]:
    """The train state (optimizer, schedule, RNGs) of checkpoint folder ``path``, on the host."""
    folder = path / TRAIN_STATE_DIR
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("tensors*.safetensors")):  # tensors-K.safetensors: shards of 162a542
        tensors.update(load_file(str(shard)))
    return _join_tensors(torch.load(folder / TREE_FILE, map_location="cpu", weights_only=True), tensors)


def _split_tensors(tree: Any, out: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each tensor of INLINE_BYTES or more moved into ``out`` (under its path) and replaced by a reference."""

    def split(key: str, value: torch.Tensor) -> Any:
        if value.numel() * value.element_size() < INLINE_BYTES:
            return value
        out[key] = value
        return {_TENSOR_REF: key}

    return map_tensors(tree, split)


def _join_tensors(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of ``_split_tensors``."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: _join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_join_tensors(v, tensors) for v in value)
    return value


class Checkpointed(Protocol):
    """What a checkpoint (or restart-trainer's handover, trainer/handover.py) is taken of: the trainer's state
    (trainer/train.py ``Trainer``)."""

    drafter: Drafter
    draft_config: DraftConfig
    optimizer: torch.optim.Optimizer
    step: int

    def state_dict(self, optimizer_state: dict | None) -> dict:
        """The train state around ``optimizer_state`` (of the whole drafter): the schedule and the RNGs."""
        ...

    def checkpoint_meta(self) -> dict:
        """trainer_state.json: the step and the batches it committed."""
        ...


@dataclass
class Snapshot:
    """Everything one checkpoint folder holds, already on the host."""

    name: str
    drafter: Drafter
    """For the export's config only (read, never its weights)."""
    weights: dict[str, torch.Tensor]
    train_state: dict[str, Any]
    meta: dict[str, Any]
    """trainer_state.json."""
    stall_s: float = 0.0
    """How long training stood still for this checkpoint."""


@dataclass
class CheckpointRecord:
    """The last checkpoint written: for the status file and the log."""

    name: str
    step: int
    stall_s: float
    write_s: float


class CheckpointWriter:
    """Writes snapshots into the run's checkpoints/ (atomically, keep-last-k), in a background thread when asked."""

    def __init__(
        self, run_dir: RunDir, keep_last: int, staging: HostStaging | None = None, in_background: bool = True
    ) -> None:
        """``in_background``: whether ``save`` writes in the background unless asked to block
        (``training.async_checkpoint``)."""
        self.run_dir, self.root, self.keep_last = run_dir, run_dir.checkpoints, keep_last
        self.staging = staging or HostStaging()
        self.in_background = in_background
        self.write_threads = WRITE_THREADS
        """Threads writing a checkpoint's tensors (launch.bench.checkpoint sets 1 for its baseline)."""
        self.last: CheckpointRecord | None = None
        self.saved_step: int | None = None
        """The step ``save`` last took a checkpoint of, on every rank (rank 0 forgets it when that write fails)."""
        self._thread: threading.Thread | None = None
        self._writing_name: str | None = None
        self._error: CheckpointError | None = None

    def save(self, trained: Checkpointed, ranks: Ranks, blocking: bool, show: Callable[[str], None]) -> float:
        """Checkpoint ``checkpoints/step-N`` of ``trained``'s step, on every rank. Training stands still only while the
        state is copied into the staging's host buffers, reused between checkpoints; the write runs in the background
        unless ``blocking`` or not ``in_background``. Under FSDP every rank joins the gathers of the sharded tensors and rank 0 keeps the whole
        state (the same checkpoint as an unsharded trainer's); under DDP rank 0 holds it all already. A write that
        fails raises CheckpointError (here, or at a later step) and leaves the previous checkpoint and latest.json
        untouched. ``show(state)``: rank 0's status. Returns the seconds training stood still (the previous write's included).
        A step saved already (a stop right after its periodic checkpoint) is not written again: ``blocking`` waits
        for that write."""
        started = time.perf_counter()
        keep = ranks.rank == 0
        if trained.step == self.saved_step:
            if blocking and keep:
                self.wait()
            return time.perf_counter() - started
        self.saved_step = trained.step
        if keep:
            self.wait()  # one write at a time; its host buffers are then free again
            show("checkpointing")
        weights = optimizer_state = None
        if keep or ranks.sharded:
            weights = self.staging.copy(trained.drafter.state_dict(), "drafter", keep)
            optimizer_state = self.staging.copy(trained.optimizer.state_dict(), "optimizer", keep)
        if keep:
            state, meta = trained.state_dict(optimizer_state), trained.checkpoint_meta()
            stall_s = time.perf_counter() - started
            snapshot = Snapshot(f"step-{meta['step']:08d}", trained.drafter, weights, state, meta, stall_s)
            self.write(snapshot, background=self.in_background and not blocking)
            show("training")  # now, not at the next log line: the launcher starts a standby only on "training"
        ranks.barrier()
        return time.perf_counter() - started

    def write_handed_over(self, drafter: Drafter, handed: TrainerState) -> None:
        """The disk checkpoint of a state handed over (trainer/handover.py), from its pages, while training goes on."""
        name = f"step-{handed.meta['step']:08d}"
        self.write(Snapshot(name, drafter, handed.weights, handed.train_state, handed.meta), background=True)

    def write(self, snapshot: Snapshot, background: bool) -> None:
        """Write ``snapshot``; with ``background`` return at once (see ``wait`` and ``raise_failure``)."""
        self.wait()
        if not background:
            self._write(snapshot)
            self.raise_failure()
            return
        self._thread = threading.Thread(
            target=self._write, args=(snapshot,), name=f"checkpoint-{snapshot.name}", daemon=True
        )
        self._writing_name = snapshot.name
        self._thread.start()

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def writing_name(self) -> str | None:
        """The checkpoint being written in the background, if any (for the status file)."""
        return self._writing_name if self.writing else None

    def status(self) -> dict[str, Any]:
        """The status file's part: the last checkpoint written and the one being written."""
        return {"last_checkpoint": vars(self.last) if self.last else None, "checkpoint_writing": self.writing_name}

    def supersede(self) -> str | None:
        """Stop waiting for the write in flight: restart-trainer hands over a later state than the write's, and
        this process may leave before the write ends (the previous checkpoint stays the latest; what the write
        leaves is swept by the next write or start). The write's name, or None if none was in flight."""
        if not self.writing:
            return None
        self._thread = None
        return self._writing_name

    def wait(self) -> None:
        """Block until no write is in flight; raise CheckpointError if the last one failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.raise_failure()

    def raise_failure(self) -> None:
        """Raise the CheckpointError of a failed write (once); a no-op while a write is in flight."""
        if self._error is not None and not self.writing:
            error, self._error = self._error, None
            raise error

    def _write(self, snapshot: Snapshot) -> None:
        started = time.perf_counter()
        name = snapshot.name
        tmp = self.root / f".{name}.{os.getpid()}.tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            drafter_dir, state_dir = tmp / "drafter", tmp / TRAIN_STATE_DIR
            drafter_dir.mkdir(parents=True)
            state_dir.mkdir()
            tensors: dict[str, torch.Tensor] = {}
            tree = _split_tensors(snapshot.train_state, tensors)
            write_tensor_files(
                [
                    TensorFile(drafter_dir / WEIGHTS_FILE, snapshot.weights, WEIGHTS_METADATA),
                    TensorFile(state_dir / TENSORS_FILE, tensors),
                ],
                self.write_threads,
            )
            write_config(zlab_config(snapshot.drafter.config, snapshot.drafter.fc.weight.dtype), drafter_dir)
            torch.save(tree, state_dir / TREE_FILE)
            for small in (drafter_dir / CONFIG_FILE, state_dir / TREE_FILE):
                fsync_file(small)
            atomic_write_json(tmp / "trainer_state.json", {**snapshot.meta, "saved": time.time()})  # fsyncs it
            faults.point("trainer.checkpoint")
            # A folder of the same step (saved again after a resume) is swapped, never missing.
            replace_dir(tmp, self.root / name)
            faults.point("trainer.latest")
            if not self.run_dir.advance_latest(name, snapshot.meta["step"]):
                log.warning(
                    "checkpoint %s written, but latest.json already names a later step (a successor's); left as it is",
                    name,
                )
        except Exception as exc:  # torch and safetensors report a full disk as RuntimeError, not OSError
            shutil.rmtree(tmp, ignore_errors=True)
            latest = self.run_dir.latest_checkpoint()
            message = (
                f"cannot write checkpoint {name} into {self.root}: {exc} "
                f"({shutil.disk_usage(self.root).free} bytes free there). Nothing was lost: "
                f"{latest.name if latest else 'no checkpoint'} stays the latest and a restart resumes from it."
            )
            log.error("%s", message)
            self._error = CheckpointError(message)
            self.saved_step = None  # not saved: the same step may be saved again once there is room
            return
        kept = sorted(p for p in self.root.glob("step-*") if p.is_dir())
        for old in kept[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.run_dir.sweep_partial_checkpoints():  # a superseded write's, its process gone by now
            log.info("cleaned up %s, left by a trainer that exited while checkpointing", leftover.name)
        self.last = CheckpointRecord(name, snapshot.meta["step"], snapshot.stall_s, time.perf_counter() - started)
        log.info(
            "checkpoint %s written in %.1f s; training stood still %.2f s for it",
            name,
            self.last.write_s,
            snapshot.stall_s,
        )


class EvalExportWriter:
    """Exports the drafter for an evaluation request (common/acceptance/records.py) from host copies, in a background
    thread.

    Training stands still only for the copy to host buffers (page-locked, reused); the export and then the
    request are written while the next steps train. A drafter trained under bf16 autocast (on a GPU) is exported
    in bf16, as a server loads it: 2 GB for a Qwen3-8B draft instead of 4 GB of fp32 master weights, for the
    producer to read too. One export is in flight at a time. An export that cannot
    be written becomes a lost evaluation (its result says why); training goes on.
    """

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir = run_dir
        self.staging = HostStaging()
        self._thread: threading.Thread | None = None

    def export(
        self,
        drafter: Drafter,
        weights: dict[str, torch.Tensor],
        request: records.AcceptanceRequest,
        background: bool = True,
    ) -> float:
        """Copy ``weights`` to the host and write them with ``request`` (at once without ``background``).
        The seconds training stood still for it."""
        started = time.perf_counter()
        self.wait()
        host = self.staging.copy(weights, "drafter")
        stall_s = time.perf_counter() - started
        if background:
            self._thread = threading.Thread(
                target=self._write, args=(drafter, host, request), name=f"eval-export-{request.step}", daemon=True
            )
            self._thread.start()
        else:
            self._write(drafter, host, request)
        return stall_s

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, drafter: Drafter, weights: dict[str, torch.Tensor], request: records.AcceptanceRequest) -> None:
        try:
            served = torch.bfloat16 if drafter.fc.weight.device.type == "cuda" else None
            export_zlab(drafter, request.drafter, dtype=served, weights=weights)
            faults.point("trainer.export")
            records.request(self.run_dir, request)
        except Exception as exc:  # auxiliary: a full disk costs this evaluation, never the run
            log.error("cannot export the drafter for the evaluation of step %d: %s", request.step, exc)
            records.finish(
                self.run_dir,
                records.AcceptanceResult(
                    step=request.step, lost=f"the export could not be written: {exc}", incarnation=request.incarnation
                ),
            )

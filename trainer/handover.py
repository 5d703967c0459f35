"""restart-trainer's handover through shared memory: the old trainer's final state, read by its successor
without waiting for a disk checkpoint.

A single-process trainer keeps its checkpoint staging buffers (trainer/checkpoint.py ``HostStaging``) in
/dev/shm: one segment per state tree (``dflash.<run tag>.trainer-<tree>.<pid>-<start>``, the run tag from
common/naming.py ``run_tag``), faulted in once and page-locked for CUDA, reused by every checkpoint. At restart-trainer (the launcher's
``control/handover-<pid>.json``, then SIGTERM) the old trainer copies its final state into them, gives its leases back and writes the handover mark
(``control/trainer-handover.json``) with the segments' layout instead of writing 12.6 GB (a Qwen3-8B
draft's weights and AdamW state) to disk. Its successor maps the segments, loads the state and trains;
the disk checkpoint of that step is written by the successor in the background, from the same pages, and the
segments become the successor's own staging (renamed as its own), so its checkpoints need no new ones.

Exactly-once is kept as by any checkpoint: the mark comes after the state is whole, and only the process
the mark names is believed. The old trainer killed before its mark: the successor resumes from the last
disk checkpoint (the segments of the dead owner are swept). The successor killed before its background
write ends: its own restart resumes from the last disk checkpoint, as after any crash; the steps since
are trained again by that lineage, none twice.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from common import faults
from common.codec import DTYPE_NAMES, DTYPES
from common.control import HandoverMark
from common.drafter.export import zlab_config
from common.naming import SHM_DIR, TRAINER_ROLE_PREFIX, process_start_ticks, segment_name
from common.rundir import RunDir
from trainer.checkpoint import Checkpointed, CheckpointWriter, HostStaging, TrainerState, map_tensors

log = logging.getLogger(__name__)
ALIGN = 4096  # each tensor on its own page boundary
SHM_RESERVE = 1 << 30  # left free in /dev/shm (producers' host rings live there too)


class Handover:
    """The old trainer's side of restart-trainer (a single process): its final state into the shared staging
    segments (``stage``), and at its very end the handover mark that names them to its successor (``leave``)."""

    def __init__(self, run_dir: RunDir, checkpoints: CheckpointWriter, single_process: bool) -> None:
        self.run_dir, self.checkpoints, self.single_process = run_dir, checkpoints, single_process
        self.state: dict[str, Any] | None = None
        """What the mark hands over: the segments' trees and layouts, the checkpoint meta, the drafter's config."""

    def requested(self) -> bool:
        """The launcher asked for this trainer's state (``control/handover-<pid>.json``) and it can hand it over: a
        single process, its staging in shared memory. The request is taken (removed)."""
        request = self.run_dir.handover_request(os.getpid())
        if not (request.is_file() and self.single_process and self.checkpoints.staging.shared):
            return False
        request.unlink()
        return True

    def stage(self, trained: Checkpointed) -> None:
        """Copy the final state into the shared staging segments instead of writing a disk checkpoint; ``leave``
        names them in the mark and the successor writes the checkpoint."""
        started = time.perf_counter()
        staging = self.checkpoints.staging
        superseded = None
        if self.checkpoints.writing and staging.room_for_another_set():
            # A background write still reads the staging: the state goes into new segments instead of waiting
            # for it (up to 20 s for a Qwen3-8B draft). The successor writes this later state's checkpoint; the
            # earlier write is left to end or not as this process exits (like a kill there, which loses nothing).
            superseded = self.checkpoints.supersede()
            staging.detach()
        else:
            self.checkpoints.wait()  # an earlier write reads the same buffers
        faults.point("trainer.stage")
        weights = staging.copy(trained.drafter.state_dict(), "drafter")
        state = trained.state_dict(staging.copy(trained.optimizer.state_dict(), "optimizer"))
        state.update(staging.copy({k: v for k, v in state.items() if k != "optimizer"}, "extras"))
        meta = trained.checkpoint_meta()
        self.state = {
            "trees": {"weights": staging.describe(weights), "train_state": staging.describe(state)},
            "segments": staging.layouts(),
            "meta": meta,
            "drafter_config": zlab_config(trained.draft_config, trained.drafter.fc.weight.dtype),
        }
        log.info(
            "state of step %d handed over in shared memory in %.2f s%s",
            meta["step"],
            time.perf_counter() - started,
            f" (new segments: checkpoint {superseded} was still being written, and is superseded)"
            if superseded
            else "",
        )

    def leave(self, step: int) -> None:
        """The last of a single process's close, after which nothing of the run is touched: the staging goes
        unless it was handed over, and the mark says this process is done (a successor waits for it, or for the
        process to be gone; a torchrun group's successor waits for its exit instead)."""
        if self.state is None:
            self.checkpoints.staging.release()  # nobody takes them over
        faults.point("trainer.handover")
        mark = HandoverMark(os.getpid(), process_start_ticks(os.getpid()), step, time.time(), self.state)
        mark.write(self.run_dir.trainer_handover)


class SharedStaging(HostStaging):
    """HostStaging whose buffers are views into /dev/shm segments, one per ``copy(tree, prefix)`` prefix.

    A segment is made at the first copy of its tree (its pages faulted in once) and kept while the tree's
    layout stays the same; on a CUDA machine it is page-locked (cudaHostRegister) so that copies run at
    PCIe speed, as pinned buffers do.
    """

    shared = True

    def __init__(self, run_tag: str) -> None:
        super().__init__()
        self.run_tag = run_tag
        self.segments: dict[str, dict[str, Any]] = {}
        """prefix -> {"path", "size", "map" and "flat" (the mapped bytes), "layout": {key: [offset, dtype, shape]}}."""
        self._detached: list[dict[str, Any]] = []
        """Segments a superseded checkpoint write still reads (``detach``): kept mapped until the process exits."""

    def copy(self, tree: Any, prefix: str = "", keep: bool = True) -> Any:
        tensors: list[tuple[str, torch.Tensor]] = []
        map_tensors(tree, lambda key, value: tensors.append((key, value)), prefix)  # the keys HostStaging gives
        layout, offset = {}, 0
        for key, t in tensors:
            layout[key] = [offset, DTYPE_NAMES[t.dtype], list(t.shape)]
            offset += (
                max(1, -(-t.numel() * t.element_size() // ALIGN)) * ALIGN
            )  # an empty tensor too: no shared address
        segment = self.segments.get(prefix)
        if self.shared and (segment is None or segment["layout"] != layout):
            segment = self._make_segment(prefix, layout, max(offset, ALIGN), any(t.is_cuda for _, t in tensors))
        if segment is not None:
            for key, t in tensors:
                self._buffers[key] = _tensor(segment["map"], *layout[key])
        return super().copy(tree, prefix, keep)

    def _make_segment(self, prefix: str, layout: dict, size: int, pin: bool) -> dict[str, Any] | None:
        """A new segment for ``prefix``; None (and plain page-locked buffers from now on) when /dev/shm lacks room."""
        self.release(prefix)
        free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
        if size + SHM_RESERVE > free:
            log.warning(
                "/dev/shm has %.1f GB free, the checkpoint staging needs %.1f GB: staging in private memory, "
                "and restart-trainer writes the state to disk",
                free / 1e9,
                size / 1e9,
            )
            self.shared = False
            self.release()
            return None
        role = TRAINER_ROLE_PREFIX + (prefix.strip("/").replace("/", "-") or "state")
        path = SHM_DIR / segment_name(self.run_tag, role)
        with open(path, "w+b") as f:
            f.truncate(size)
            mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
        flat = torch.frombuffer(mapped, dtype=torch.uint8)
        flat.fill_(0)  # fault every page in now, not during the copy of a checkpoint
        if pin and torch.cuda.is_available():
            error = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0)
            if int(error) != 0:  # copies still work, at pageable speed
                log.warning(
                    "cudaHostRegister of %.1f GB in /dev/shm failed (%s): checkpoint copies are pageable",
                    size / 1e9,
                    error,
                )
                pin = False
        segment = {"path": str(path), "size": size, "map": mapped, "flat": flat, "layout": layout, "pinned": pin}
        self.segments[prefix] = segment
        return segment

    def release(self, prefix: str | None = None) -> None:
        """Unmap and remove the segment of ``prefix`` (all with None)."""
        for name in [prefix] if prefix is not None else list(self.segments):
            segment = self.segments.pop(name, None)
            if segment is None:
                continue
            if segment.get("pinning") is not None:
                segment["pinning"].join()
            if segment["pinned"]:
                torch.cuda.cudart().cudaHostUnregister(segment["flat"].data_ptr())
            Path(segment["path"]).unlink(missing_ok=True)
        self._buffers = {k: v for k, v in self._buffers.items() if any(k.startswith(p) for p in self.segments)}

    def room_for_another_set(self) -> bool:
        """Whether /dev/shm has room for a second copy of every segment (``detach``), leaving its reserve."""
        stat = os.statvfs(SHM_DIR)
        needed = sum(segment["size"] for segment in self.segments.values())
        return needed + SHM_RESERVE <= stat.f_bavail * stat.f_frsize

    def detach(self) -> None:
        """Let go of the segments for the next copies, which get new ones: restart-trainer while a checkpoint
        write still reads these. Their names are removed now (the new segments take them); their pages stay
        mapped for that write until this process exits, which frees them. The new segments are made as the
        first ones were, faulted in and page-locked: for a Qwen3-8B draft's 12.6 GB on an H200 host that and
        the copy take 3.5 s, a copy into fresh pageable pages 10-16 s (launch/bench/staging.py)."""
        for segment in self.segments.values():
            Path(segment["path"]).unlink(missing_ok=True)
            self._detached.append(segment)
        self.segments = {}
        self._buffers = {}

    def layouts(self) -> dict[str, dict[str, Any]]:
        """The segments as JSON (prefix -> path, size, layout), for a successor that adopts them (``adopt``)."""
        return {
            prefix: {"path": segment["path"], "size": segment["size"], "layout": segment["layout"]}
            for prefix, segment in self.segments.items()
        }

    def adopt(self, prefix: str, path: str, size: int, layout: dict, mapped: mmap.mmap, pin: bool) -> None:
        """Make a predecessor's segment (mapped shared, renamed as this process's at ``path``) this staging's own
        for ``prefix``: the next checkpoints copy into its pages, already faulted in, instead of new ones. On a
        CUDA machine it is page-locked in a background thread (seconds for gigabytes), copies running pageable
        until then."""
        flat = torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        segment = {"path": path, "size": size, "map": mapped, "flat": flat, "layout": layout, "pinned": False}
        self.segments[prefix] = segment
        if pin and torch.cuda.is_available():

            def register() -> None:
                if int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0)) == 0:
                    segment["pinned"] = True

            segment["pinning"] = threading.Thread(target=register, name=f"pin-{prefix}", daemon=True)
            segment["pinning"].start()

    def describe(self, tree: Any) -> Any:
        """``tree`` (made of this staging's buffers) as JSON: tensors become references into the segments."""
        where = {}
        for prefix, segment in self.segments.items():
            for key, (offset, dtype, shape) in segment["layout"].items():
                where[self._buffers[key].data_ptr()] = {
                    "segment": segment["path"],
                    "offset": offset,
                    "dtype": dtype,
                    "shape": shape,
                }
        return _encode(tree, where)


def _tensor(mapped: mmap.mmap, offset: int, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over the mapped bytes at ``offset``, with a storage of its own (torch.save writes just its bytes)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=DTYPES[dtype])
    return torch.frombuffer(mapped, dtype=DTYPES[dtype], count=count, offset=offset).view(shape)


def _encode(value: Any, where: dict[int, dict]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.data_ptr() not in where:
            raise ValueError("a tensor of the handed-over state is not in a shared segment")
        return {"tensor": where[value.data_ptr()]}
    if isinstance(value, dict):
        return {"items": [[k, _encode(v, where)] for k, v in value.items()]}  # keys may be ints (optimizer state)
    if isinstance(value, (list, tuple)):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v, where) for v in value]}
    return {"value": value}


def _decode(value: dict, segments: dict[str, mmap.mmap]) -> Any:
    if "tensor" in value:
        ref = value["tensor"]
        return _tensor(segments[ref["segment"]], ref["offset"], ref["dtype"], ref["shape"])
    if "items" in value:
        return {k: _decode(v, segments) for k, v in value["items"]}
    if "list" in value:
        return [_decode(v, segments) for v in value["list"]]
    if "tuple" in value:
        return tuple(_decode(v, segments) for v in value["tuple"])
    return value["value"]


def take(state: dict[str, Any], staging: SharedStaging | None = None, pin: bool = False) -> TrainerState | None:
    """Map the segments a handover mark's ``state`` names. With ``staging`` (and a mark that lists their layouts)
    they become its own: mapped shared, renamed as this process's, reused by its checkpoints (``adopt``).
    Otherwise they are mapped copy-on-write and their names removed (the mapping stays this process's). None,
    with a warning, when they cannot be read: the caller resumes from the disk checkpoint.

    Either way nothing writes the pages while the state's tensors are read: the caller copies them (onto its
    device, into its modules and optimizer) or clones them, and its first checkpoint copy waits for the
    background write of the state taken."""
    paths = sorted({ref for ref in _segment_paths(state["trees"])})
    layouts = state.get("segments") if staging is not None else None
    adopted = layouts is not None and sorted(entry["path"] for entry in layouts.values()) == paths
    try:
        segments = {p: _map_shared(p) if adopted else _map_private(p) for p in paths}
        trees = {name: _decode(tree, segments) for name, tree in state["trees"].items()}
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        log.warning("the state handed over cannot be read (%s); resuming from the last disk checkpoint", exc)
        return None
    if adopted:
        for prefix, entry in layouts.items():
            own = SHM_DIR / segment_name(staging.run_tag, _role_of(entry["path"]))
            os.rename(entry["path"], own)  # this process's name now: a sweep sees a live owner
            staging.adopt(prefix, str(own), int(entry["size"]), entry["layout"], segments[entry["path"]], pin)
    else:
        for p in paths:
            Path(p).unlink(missing_ok=True)
    faults.point("trainer.taken")
    # Its tensors are mapped from the segments, copy-on-write: read by this process only.
    return TrainerState(trees["weights"], trees["train_state"], state["meta"], state["drafter_config"])


def _map_shared(path: str) -> mmap.mmap:
    """The segment's pages, shared: adopted as this process's staging (its previous owner has exited)."""
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), os.path.getsize(path), flags=mmap.MAP_SHARED)


def _role_of(path: str) -> str:
    """The role of a segment named ``dflash.<run tag>.<role>.<pid>-<start>`` (common/naming.py)."""
    return Path(path).name.rsplit(".", 1)[0].split(".", 2)[2]


def _map_private(path: str) -> mmap.mmap:
    """The segment's pages, copy-on-write: this process may change its copy, never the owner's."""
    with open(path, "rb") as f:
        return mmap.mmap(
            f.fileno(), os.path.getsize(path), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )


def _segment_paths(tree: Any):
    if isinstance(tree, dict):
        if "tensor" in tree:
            yield tree["tensor"]["segment"]
            return
        for v in tree.values():
            yield from _segment_paths(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _segment_paths(v)

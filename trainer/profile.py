"""A few training steps under torch.profiler, summarised per step: where a step's wall time goes.

At small shapes a step's cost is often not its arithmetic but the host issuing its kernels, host reads of device
values (each a synchronisation on CUDA) and a long tail of small kernels. The summary says how many kernels a step
launches, how many host reads and synchronisations it makes, and how long the device was busy against the step's
wall time (the rest are gaps where the device waited for the host, or for another process on the card). The
trainer writes one for ``logging.profile_steps`` steps of a real run (``StepProfiler``); ``launch.bench.step
--profile`` writes one for its benchmark's step.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
"""Runtime calls that make the host wait for the device."""
SYNC_CAUSES = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero")
"""Operators that read a device value on the host (each one a synchronisation on CUDA)."""
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_profiler(device: torch.device) -> profile:
    """A started torch.profiler recording the host's operators (and on CUDA the device's kernels)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)  # the steps profiled start with nothing of earlier steps queued
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def stop_and_write(profiler: profile, device: torch.device, steps: int, wall_s: float, path: Path, name: str) -> dict:
    """Stop ``profiler`` after ``steps`` steps that took ``wall_s`` (the device synchronised at both ends), write
    ``path``: the per-step summary, then the operators and kernels by self time and by calls; the summary."""
    profiler.stop()
    events = profiler.key_averages()
    cuda = device.type == "cuda"
    counts = {e.key: e.count for e in events}
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
    busy_us = union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    summary: dict[str, Any] = {
        "name": name,
        "steps": steps,
        "wall_ms_per_step": wall_s * 1e3 / steps,
        "device_busy_ms_per_step": busy_us / 1e3 / steps if cuda else float("nan"),
        "kernels_per_step": len(kernels) / steps if cuda else float("nan"),
        "launches_per_step": sum(counts.get(k, 0) for k in LAUNCHES) / steps,
        "aten_ops_per_step": sum(e.count for e in events if e.key.startswith("aten::")) / steps,
        "syncs_per_step": {k: counts[k] / steps for k in SYNC_EVENTS + SYNC_CAUSES if counts.get(k)},
        "memcpy_dtoh_per_step": sum(e.count for e in events if "Memcpy DtoH" in e.key) / steps,
    }
    sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    by_time = events.table(sort_by=sort_key, row_limit=100, max_name_column_width=70)
    # By calls too: at small shapes the cost is often a long tail of small kernels, each below the top by time.
    by_calls = events.table(sort_by="count", row_limit=60, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n\n" + by_time + "\n\nBy calls:\n" + by_calls + "\n")
    return summary


def union_us(ranges: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) ranges (the device's busy time, overlapping streams counted once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(ranges):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


class StepProfiler:
    """``steps`` steps of a real run under torch.profiler (``logging.profile_steps``), once ``after`` steps are
    trained (the trainer's start plus ``logging.profile_after``: compilation and the rings' filling behind it), on
    rank 0: ``path`` (logs/trainer-profile.txt) and a line of trainer.log. Each step profiled is a whole iteration of
    the loop: its wait for a batch, the step, the bookkeeping."""

    def __init__(self, steps: int, after: int, path: Path, device: torch.device, enabled: bool) -> None:
        self.steps, self.after, self.path, self.device = steps, after, path, device
        self.pending = enabled and steps > 0
        self._profiler: profile | None = None
        self._first = 0
        self._started = 0.0

    def step_starts(self, done: int) -> None:
        """Before a loop iteration, ``done`` steps trained: starts the profile once ``done`` reaches ``after``."""
        if self.pending and self._profiler is None and done >= self.after:
            try:
                self._profiler = start_profiler(self.device)
            except RuntimeError as exc:  # another profiler in the process, no CUPTI: the run trains on unprofiled
                log.warning(f"logging.profile_steps: the profiler did not start ({exc}); no profile this run")
                self.pending = False
                return
            self._first, self._started = done, time.perf_counter()

    def step_ended(self, done: int, last: bool) -> dict | None:
        """After a loop iteration, ``done`` steps trained: the summary once ``steps`` steps (or the run's ``last``)
        are profiled, else None."""
        steps = done - self._first
        if self._profiler is None or steps == 0 or (steps < self.steps and not last):
            return None
        _synchronize(self.device)
        wall = time.perf_counter() - self._started
        name = f"steps {self._first + 1}-{done}"
        summary = stop_and_write(self._profiler, self.device, steps, wall, self.path, name)
        self._profiler, self.pending = None, False
        busy = summary["device_busy_ms_per_step"]
        log.info(
            f"profiled {summary['name']}: {summary['wall_ms_per_step']:.1f} ms a step, device busy "
            + (f"{busy:.1f} ms, {summary['kernels_per_step']:.0f} kernels" if busy == busy else "(no device)")
            + f", {summary['aten_ops_per_step']:.0f} operators, host reads {summary['syncs_per_step'] or 'none'} "
            f"a step ({self.path})"
        )
        return summary

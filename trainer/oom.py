"""A trainer step that ran out of device memory: what the rank saw goes to the run's out-of-memory log, and the
trainer exits with EXIT_OUT_OF_MEMORY, so that the launcher can stop a run whose step does not fit instead of
restarting it again and again (common/lifecycle.py ``OutOfMemory``)."""

from __future__ import annotations

import logging
import os
import resource
import time

import torch

from common.lifecycle import EXIT_OUT_OF_MEMORY, OUT_OF_MEMORY_LOG, OutOfMemory
from common.rundir import RunDir

log = logging.getLogger(__name__)


def memory_seen(device: torch.device) -> tuple[int | None, int | None, int | None]:
    """(peak allocated, peak reserved, total) bytes of ``device``; on the CPU the process's peak resident memory and
    the host's memory, with nothing reserved."""
    if device.type == "cuda":
        return (
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            torch.cuda.get_device_properties(device).total_memory,
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return peak_kib * 1024, None, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def out_of_memory(run: RunDir, step: int, rank: int, device: torch.device, error: BaseException) -> int:
    """Record the step's out-of-memory error and what the device held; the trainer's exit code."""
    record = OutOfMemory(step, rank, str(device), *memory_seen(device), os.getpid(), time.time(), str(error)[:500])
    record.write(run)
    log.error(
        "out of memory in step %d: %s (recorded in logs/%s); exiting with %d",
        step,
        record.seen(),
        OUT_OF_MEMORY_LOG,
        EXIT_OUT_OF_MEMORY,
    )
    return EXIT_OUT_OF_MEMORY

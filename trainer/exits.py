"""How the trainer process ends: its run to an exit code, whichever way it ends.

0 when it finished or stopped (SIGTERM or Ctrl-C: the step in flight finishes, then the checkpoint or the
handover), EXIT_CONFIG_ERROR for a configuration the run cannot train with, EXIT_OUT_OF_MEMORY for a step that ran
out of device memory: what the rank saw goes to the run's out-of-memory log, so that the launcher can stop a run
whose step does not fit instead of restarting it again and again (common/lifecycle.py ``OutOfMemory``).
"""

from __future__ import annotations

import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from common.config import ConfigError, RunConfig
from common.lifecycle import (
    EXIT_CONFIG_ERROR,
    EXIT_OUT_OF_MEMORY,
    OUT_OF_MEMORY_LOG,
    OutOfMemory,
    start_role,
    stop_on_signals,
)
from common.rundir import RunDir

log = logging.getLogger(__name__)


class Run(Protocol):
    """What of a trainer its process's end reads (trainer/train.py ``Trainer``)."""

    stop_requested: bool
    state: str
    step: int
    rank: int
    device: torch.device

    def run(self) -> str: ...

    def close(self) -> None: ...


def run_to_exit(run_dir: str | Path, start: Callable[[RunDir, RunConfig], Run]) -> int:
    """Start the trainer's role in ``run_dir``, its trainer (``start``) and its run; the process's exit code."""
    try:
        root, cfg = start_role(run_dir)
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    trainer = None

    def request_stop(signum: int) -> None:
        log.info("signal %d: finishing the step, then checkpoint (or hand over, for restart-trainer) and exit", signum)
        if trainer is None:
            raise KeyboardInterrupt
        trainer.stop_requested = True

    stop_on_signals(request_stop)
    try:
        trainer = start(root, cfg)
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 0
    try:
        state = trainer.run()
    except ConfigError as exc:
        log.error("%s", exc)
        trainer.state = "stopped"
        return EXIT_CONFIG_ERROR
    except torch.OutOfMemoryError as exc:  # recorded for the launcher, which stops a run whose step never fits
        return out_of_memory(root, trainer.step + 1, trainer.rank, trainer.device, exc)
    finally:
        trainer.close()
    log.info("trainer %s at step %d", state, trainer.step)
    return 0


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

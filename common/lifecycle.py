"""How our role processes (producer, trainer, synthesis) start and end: one skeleton.

Each starts the same way (``start_role``: die with the launcher, refuse a run directory of another format, read the
run's configuration), turns SIGTERM and SIGINT into its own stop (``stop_on_signals``), answers an error that would
repeat on every try with ``EXIT_CONFIG_ERROR`` so that the launcher stops the run instead of restarting it, and
ends without Python's finalization racing torch.distributed's threads (``exit_process``). ``run_role`` is the whole
skeleton for a role that is one object with ``run`` and ``request_stop``. A trainer whose step runs out of device
memory says so (``OutOfMemory``, ``EXIT_OUT_OF_MEMORY``), so that the launcher tells one that repeats at the same step
from one that may not.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

from common.config import ConfigError, RunConfig, load_config
from common.rundir import RunDir

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

EXIT_CONFIG_ERROR = 2
"""The exit code of an error that repeats on every try (a bad config key, a missing or unusable file): the
launcher stops the run at once instead of restarting the process."""

EXIT_OUT_OF_MEMORY = 3
"""The exit code of a trainer whose step ran out of device memory (what it saw: ``OutOfMemory``). The launcher
restarts it once, since a fragmented allocator may not fail again; out of memory at the same step again stops the
run (EXIT_CONFIG_ERROR). Under torchrun the group exits 1: the launcher goes by the records."""
OUT_OF_MEMORY_LOG = "out-of-memory.jsonl"
"""In the run's logs folder: one ``OutOfMemory`` per line, appended by every trainer rank that ran out."""


@dataclass(frozen=True)
class OutOfMemory:
    """What a trainer rank knew when its step ran out of memory (bytes; None where the device does not say)."""

    step: int
    """The step that failed (the steps done before it, plus one)."""
    rank: int
    device: str
    peak_allocated: int | None
    """The most memory its tensors held at once (on the CPU: the process's peak resident memory)."""
    peak_reserved: int | None
    """The most the CUDA caching allocator held at once (None on the CPU)."""
    total: int | None
    """The card's memory (on the CPU: the host's)."""
    pid: int
    time: float
    error: str

    def seen(self) -> str:
        """The memory this rank saw, in words."""
        if self.device.startswith("cuda"):
            held = f"peak {_gib(self.peak_reserved)} reserved ({_gib(self.peak_allocated)} allocated) on {self.device}"
            return f"{held}, of the card's {_gib(self.total)}"
        return f"peak {_gib(self.peak_allocated)} resident on {self.device}, of the host's {_gib(self.total)}"

    def write(self, run: RunDir) -> None:
        """Append this record to the run's out-of-memory log, on disk before it returns (the process exits next)."""
        with open(run.logs / OUT_OF_MEMORY_LOG, "a") as f:
            f.write(json.dumps(dataclasses.asdict(self)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def since(cls, run: RunDir, started: float) -> list[OutOfMemory]:
        """The records written at ``started`` (wall clock) or later, i.e. by the trainer started then."""
        try:
            lines = (run.logs / OUT_OF_MEMORY_LOG).read_text().splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            try:
                record = cls(**json.loads(line))
            except (ValueError, TypeError):
                continue  # a line cut by a kill while it was written
            if record.time >= started:
                records.append(record)
        return records


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / 2**30:.1f} GiB"


class Role(Protocol):
    """A role process's work: ``run`` until done or stopped (its exit code); ``request_stop`` from a signal."""

    def run(self) -> int: ...

    def request_stop(self) -> None: ...


def start_role(run_dir: str | Path) -> tuple[RunDir, RunConfig]:
    """What every role process does first: die with its launcher, refuse a run directory another version made
    (before reading anything in it), and read the run's configuration. ConfigError where either fails."""
    die_with_parent()
    run = RunDir(run_dir)
    run.check_format()
    return run, load_config(run.config)


def stop_on_signals(stop: Callable[[int], None]) -> None:
    """SIGTERM (the launcher's stop) and SIGINT (Ctrl-C) call ``stop(signum)``: finish what is in hand, then end."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda number, _frame: stop(number))


def run_role(
    run_dir: str | Path,
    build: Callable[[RunConfig, RunDir], Role],
    repeating: tuple[type[Exception], ...] = (),
) -> int:
    """The whole skeleton: start, build the role, run it until done or stopped; its exit code. A ConfigError, or
    one of ``repeating`` (errors of the role's own inputs, e.g. bad data), is logged and gives EXIT_CONFIG_ERROR."""
    fatal = (ConfigError, *repeating)
    try:
        run, cfg = start_role(run_dir)
        role = build(cfg, run)
    except fatal as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    stop_on_signals(lambda _signum: role.request_stop())
    try:
        return role.run()
    except fatal as exc:
        log.error("%s", exc)
        return EXIT_CONFIG_ERROR


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the launcher dies, so no orphan holds a GPU (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def exit_process(code: int) -> NoReturn:
    """Exit a role process (producer, trainer, a torchrun rank) once it has closed what it owns, skipping
    Python's finalization.

    Two reasons. A torchrun rank: the collective backend's threads free finished work lazily, and a thread
    that frees a tensor still tied to a Python object after finalization began can no longer take the GIL:
    it unwinds, C++ calls std::terminate, and a rank that ended cleanly dies by SIGABRT, which torchrun and
    the supervisor take for a crash (gloo on torch 2.13: about one exit in ten on 2 CPUs;
    tests/test_lifecycle.py). Any process: tearing down torch and transformers takes a second or more after
    the work is done (about 1.1 s for a tiny producer here), and the launcher, a restart or a stop waits for
    it. Log handlers and the standard streams are flushed first; atexit handlers do not run (wandb is
    finished explicitly before, sockets and shared memory are closed by their owners).
    """
    end_now(code)


def end_now(code: int) -> NoReturn:
    """Flush logs and standard streams, then leave without finalization (see ``exit_process``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

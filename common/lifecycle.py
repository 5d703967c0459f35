"""How our worker processes end: with their launcher, and without Python's finalization racing
torch.distributed's threads."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1

EXIT_CONFIG_ERROR = 2
"""The exit code of an error that repeats on every try (a bad config key, a missing or unusable file): the
launcher stops the run at once instead of restarting the process."""


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

"""A CUDA MPS control daemon of the run's own (``launch.mps``), and of the benchmarks that share one GPU.

Processes that share a GPU without MPS take turns on it: the GPU time-slices between their contexts,
so a producer's forward and a trainer rank's step never overlap, and a rank that waits in an
all-reduce holds its turn (BENCHMARKS.md: 94% of the ideal on one shared GPU, 67% with two shared
DDP ranks). Under MPS their kernels share the GPU's SMs.

The daemon's pipe directory is named after the run, so runs and other users' daemons stay apart, and
it is short, because the daemon's unix socket lives in it. Every child of the launcher gets the
directory in its environment and so connects to this daemon.

Whoever starts the daemon stops it (``quit``) on every way out. The daemon leaves the starter's process group
(it is a daemon), so a TERM to that group never reaches it: a starter that left SIGTERM and SIGHUP at their
default (a benchmark) gets them turned into SystemExit, which runs its ``finally`` blocks and ``with`` exits, and
an interpreter exit runs ``quit`` too (atexit); Ctrl-C is a KeyboardInterrupt already. A starter with its own
handlers (the launcher) keeps them and quits in its own stop. Only a SIGKILL leaves the daemon behind: the next
start of the same pipe directory finds it, says so and tells it to quit before starting its own.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import FrameType

from common.config import ConfigError

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"
"""The control daemon's pid, in its pipe directory."""
LEFTOVERS = ("control", PID_FILE)
"""What a control daemon killed with -9 leaves in its pipe directory."""
STALE_EXIT_WAIT_S = 30.0
"""How long a start waits for a stale daemon to exit after its quit (it ends its server first)."""
GUARDED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    """Unwind (``finally``, ``with``, atexit) instead of dying where the signal lands: the daemon gets its quit."""
    log.info("%s: stopping; the MPS control daemon is told to quit", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


class MpsDaemon:
    """Starts and stops ``nvidia-cuda-mps-control -d`` with the run's pipe and log directories."""

    def __init__(self, run_root: Path, logs: Path) -> None:
        binary = shutil.which(MPS_CONTROL)
        if binary is None:
            raise ConfigError(
                f"launch.mps: {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities); "
                "install it or set launch.mps = false"
            )
        self.binary = binary
        key = hashlib.sha1(str(run_root.resolve()).encode()).hexdigest()[:12]
        self.pipe = Path(tempfile.gettempdir()) / f"dflash-mps-{key}"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs / "mps")}
        self._guarded: list[int] = []
        """The signals whose default this daemon's start replaced (restored by ``quit``)."""

    def __enter__(self) -> MpsDaemon:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.quit()

    def start(self) -> None:
        """Clear a daemon of this pipe directory left running, then start this one; every exit of this process
        quits it from now on (see the module's docstring)."""
        self._clear_stale()
        for directory in self.env.values():
            Path(directory).mkdir(parents=True, exist_ok=True)
        self._guard_exits()  # before -d: a TERM while it starts quits it too
        try:
            subprocess.run([self.binary, "-d"], env=self._environ(), check=True, timeout=30)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"{MPS_CONTROL} -d exited with {exc.returncode} (pipe {self.pipe}); if a daemon of that pipe still "
                f"runs, stop it: echo quit | CUDA_MPS_PIPE_DIRECTORY={self.pipe} {MPS_CONTROL}"
            ) from None
        log.info("started the MPS control daemon (pipe %s)", self.pipe)

    def quit(self) -> None:
        """Tell this run's daemon to quit, if one is listening; it ends its server after the last client."""
        self._unguard_exits()
        if self._listening() and self._send_quit():
            log.info("asked the MPS control daemon (pipe %s) to quit", self.pipe)

    # -- a daemon left behind

    def _clear_stale(self) -> None:
        """A daemon of this pipe directory is one an earlier starter could not stop (killed with -9): it would serve
        this run's clients with its settings, or refuse our start. Tell it to quit and wait until it is gone; files
        of a daemon that is gone already are removed."""
        if not self._listening():
            return
        pid = self._pid()
        log.warning(
            "an MPS control daemon of pipe %s (%s) is still running, left by an earlier run that could not stop it: "
            "telling it to quit before starting this one",
            self.pipe,
            f"pid {pid}" if pid else "pid unknown",
        )
        if self._send_quit():
            deadline = time.monotonic() + STALE_EXIT_WAIT_S
            while self._alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(pid):
                raise RuntimeError(
                    f"the MPS control daemon pid {pid} of pipe {self.pipe} did not exit within {STALE_EXIT_WAIT_S:.0f} s "
                    "of its quit (its server waits for clients that still run?): stop them, or the daemon"
                )
        else:
            log.warning("no MPS control daemon answered on pipe %s: removing what one left there", self.pipe)
        for name in LEFTOVERS:
            (self.pipe / name).unlink(missing_ok=True)

    def _listening(self) -> bool:
        return (self.pipe / "control").exists()

    def _pid(self) -> int | None:
        try:
            return int((self.pipe / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(pid: int | None) -> bool:
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _send_quit(self) -> bool:
        """``quit`` to the daemon of this pipe; whether one took it."""
        try:
            done = subprocess.run(
                [self.binary],
                input="quit\n",
                text=True,
                env=self._environ(),
                timeout=30,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def _environ(self) -> dict[str, str]:
        return {**os.environ, **self.env}

    # -- every way out quits

    def _guard_exits(self) -> None:
        atexit.register(self.quit)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can be set from the main thread only; atexit still quits
        for signum in GUARDED_SIGNALS:
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, _exit_on_signal)
                self._guarded.append(signum)

    def _unguard_exits(self) -> None:
        atexit.unregister(self.quit)
        if threading.current_thread() is threading.main_thread():
            for signum in self._guarded:
                signal.signal(signum, signal.SIG_DFL)
            self._guarded = []

"""The launcher's children: which processes a run has (devices, commands, environments, CPU threads), and
``ManagedProcess``, one child in its own process group with its log, restarts and backoff. The supervisor and
``run_all.sh synthesize`` both run their children through these.

Testing hook: DFLASH_PRODUCER_CMD / DFLASH_TRAINER_CMD, when set, replace the program part of the role commands
(``python -m producer.server`` / ``python -m trainer.train``, shell-split); the launcher's own arguments follow
unchanged. With the trainer hook set, torchrun is not used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.naming import process_start_ticks
from common.status import ChildRecord
from launch.preload_client import PreloadedProcess, Preloader
from launch.runs import REPO_ROOT

log = logging.getLogger("launch.supervisor")  # the launcher's log names its children's restarts

PRODUCER_CMD_ENV = "DFLASH_PRODUCER_CMD"
TRAINER_CMD_ENV = "DFLASH_TRAINER_CMD"
HEALTHY_UPTIME_S = 60.0  # a process up this long has recovered: its crash count and backoff reset
PRODUCER_STOP_TIMEOUT_S = 30.0


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
"""A machine without any of these (NVIDIA's driver, WSL's, ROCm's) has no GPU that torch could see."""


def detect_cuda() -> bool:
    """Whether torch sees a CUDA device; asked in a subprocess so the supervisor never holds torch or a CUDA context,
    and only where a GPU driver's device file exists (importing torch to learn there is none costs a second or more)."""
    if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return False
    try:
        result = subprocess.run(
            [sys.executable, "-c", "import torch; print(int(torch.cuda.is_available()))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.stdout.strip() == "1"


def producer_devices(cfg: RunConfig, has_cuda: Callable[[], bool]) -> list[str]:
    """One entry per producer: launch.producer_devices (an entry may name several devices, comma-separated:
    a tensor-parallel producer), else num_producers on cpu (cuda:0 with CUDA)."""
    if cfg.launch.producer_devices:
        return list(cfg.launch.producer_devices)
    return ["cuda:0" if has_cuda() else "cpu"] * cfg.launch.num_producers


def trainer_devices(cfg: RunConfig, has_cuda: Callable[[], bool]) -> list[str]:
    """launch.trainer_devices, else one rank on cpu (cuda:0 with CUDA)."""
    if cfg.launch.trainer_devices:
        return list(cfg.launch.trainer_devices)
    return ["cuda:0" if has_cuda() else "cpu"]


def _hooked_program(env_name: str, default: list[str]) -> list[str]:
    hook = os.environ.get(env_name, "").strip()
    return shlex.split(hook) if hook else default


def producer_command(run_dir: Path, producer_id: int, device: str) -> list[str]:
    """The producer for one entry of launch.producer_devices; under torchrun (launch.torchrun, which keeps a
    rank's configuration error as exit 2) when the entry names several devices. The testing hook never
    uses torchrun."""
    program = [sys.executable, "-m", "producer.server"]
    ranks = len(device.split(","))
    if ranks > 1:
        program = [
            sys.executable,
            "-m",
            "launch.torchrun",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "producer.server",
        ]
    return [
        *_hooked_program(PRODUCER_CMD_ENV, program),
        "--run-dir",
        str(run_dir),
        "--producer-id",
        str(producer_id),
        "--device",
        device,
    ]


def producer_environment(device: str) -> dict[str, str]:
    """The environment of the producer for one entry of launch.producer_devices."""
    if "," not in device:
        return child_environment()
    # torchrun gives its ranks this long after forwarding SIGTERM; keep it below our own wait.
    extra = {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get(
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(PRODUCER_STOP_TIMEOUT_S) - 5)
        )
    }
    if set(device.split(",")) == {"cpu"}:
        # transformers puts rank r of a group on accelerator r wherever it sees one: a CPU group on a GPU host must
        # see none from its first import, before anything has asked CUDA how many devices there are.
        extra["CUDA_VISIBLE_DEVICES"] = ""
    return child_environment(extra)


def trainer_command(run_dir: Path, devices: list[str]) -> list[str]:
    if os.environ.get(TRAINER_CMD_ENV, "").strip():
        return [*_hooked_program(TRAINER_CMD_ENV, []), "--run-dir", str(run_dir)]
    if len(devices) > 1:
        # launch.torchrun is torchrun (without relying on PATH) that keeps a rank's configuration error as exit 2.
        return [
            sys.executable,
            "-m",
            "launch.torchrun",
            "--standalone",
            "--nproc-per-node",
            str(len(devices)),
            "-m",
            "trainer.train",
            "--run-dir",
            str(run_dir),
        ]
    return [sys.executable, "-m", "trainer.train", "--run-dir", str(run_dir)]


def cpu_processes(device_entries: list[str]) -> int:
    """Processes that compute on the CPU among these device entries: one per ``cpu`` (``cpu,cpu`` is two ranks)."""
    return sum(entry.split(",").count("cpu") for entry in device_entries)


def cpu_threads(processes: int) -> int | None:
    """Torch threads for each of ``processes`` processes that compute on the CPU, so that together they fit
    ``os.cpu_count()`` (at least 1 each): more threads than cores made the tiny quickstart on two cores 7x slower
    (658 s against 92 s), each process's threads waiting for cores that another's hold. None when no process
    computes on the CPU or the user set OMP_NUM_THREADS (theirs wins)."""
    if processes < 1 or os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, (os.cpu_count() or 1) // processes)


def thread_environment(threads: int | None) -> dict[str, str]:
    """What makes a child's torch use ``threads`` intra-op threads (OpenMP and MKL, read when torch is imported);
    nothing for None, and a user's own MKL_NUM_THREADS is kept."""
    if threads is None:
        return {}
    return {
        name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if not os.environ.get(name, "").strip()
    }


def threads_message(processes: int, threads: int) -> str:
    return f"{processes} CPU processes on {os.cpu_count() or 1} cores: {threads} threads each"


def child_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment (NCCL_*, CUDA_*, WANDB_* pass through) plus the repo on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("PYTHONUNBUFFERED", "1")  # log lines reach logs/*.log as they happen
    env.update(extra or {})
    return env


# -- one supervised child ------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def terminate_with_parent(parent_pid: int) -> Callable[[], None]:
    """preexec_fn: the child gets SIGTERM if the supervisor dies (even by SIGKILL), so no orphans hold GPUs."""

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log file, indented, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "".join(f"\n    | {line}" for line in text)


class ManagedProcess:
    """One supervised child: command, log file, process group, crash count and backoff."""

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        devices: list[str],
        preloader: Preloader | None = None,
    ) -> None:
        self.name = name
        self.command = command
        self.devices = devices
        self.env = env
        self.log_path = log_path
        self.preloader = preloader
        """Where it is forked from instead of started as a fresh interpreter (``launch.preload``), if anywhere."""
        self.proc: subprocess.Popen | PreloadedProcess | None = None
        self.start_ticks: int | None = None
        self.started_wall = 0.0
        self.started_mono = 0.0
        self.status_since = 0.0
        self.incarnation = 0
        self.restarts = 0  # all restarts of the run, for launcher.json
        self.crashes_in_a_row = 0
        self.restart_at: float | None = None  # monotonic time of a scheduled restart
        self.ready = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_mono

    def start(self) -> None:
        self.incarnation += 1
        self.restart_at = None
        self.ready = False
        self.started_wall = time.time()
        self.started_mono = time.monotonic()
        self.status_since = self.started_wall
        """Status files written since then are this process's (later for a trainer started beside the one it replaces)."""
        with self.log_path.open("ab") as log_file:
            header = f"==== {self.name} start {self.incarnation} at {datetime.now().isoformat(timespec='seconds')}: {shlex.join(self.command)}\n"
            log_file.write(header.encode())
            log_file.flush()
            # Own process group: a Ctrl-C in the terminal reaches only the supervisor, which then
            # stops the children in order (trainer first). Same session, so /dev/tty stays usable.
            preloaded = self.preloader.spawn(self.command, self.env, log_file) if self.preloader else None
            self.proc = preloaded or subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                process_group=0,
                preexec_fn=terminate_with_parent(os.getpid()),
            )
        self.start_ticks = process_start_ticks(self.proc.pid)

    def poll(self) -> int | None:
        """The exit code once the child has exited (its leftover group members are then killed), else None."""
        if self.proc is None:
            return None
        returncode = self.proc.poll()
        if returncode is not None:
            self._kill_group()
        return returncode

    def _kill_group(self) -> None:
        # E.g. torchrun's ranks after torchrun itself died: they must not keep GPUs and leases.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def send(self, sig: signal.Signals) -> None:
        """Signal the leader only: torchrun forwards SIGTERM to its ranks itself."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout_s: float, on_poll: Callable[[], None] = lambda: None) -> int | None:
        """Wait for the exit up to ``timeout_s`` (calling ``on_poll`` between polls); the exit code, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            returncode = self.poll()
            if returncode is not None:
                return returncode
            on_poll()
            time.sleep(0.05)
        return self.poll()

    def kill(self) -> int:
        """SIGKILL the whole group and reap the leader."""
        self._kill_group()
        return self.proc.wait()

    def stop(self, timeout_s: float, on_poll: Callable[[], None] = lambda: None) -> None:
        """SIGTERM, then wait for the exit (SIGKILL of the group after ``timeout_s``)."""
        self.send(signal.SIGTERM)
        self.await_exit(timeout_s, on_poll)

    def await_exit(self, timeout_s: float, on_poll: Callable[[], None] = lambda: None) -> None:
        """Wait up to ``timeout_s`` for a process already told to stop, then SIGKILL its group; forget it.

        Never a second SIGTERM: one arriving while Python shuts down (handlers back to default)
        kills a process that was exiting cleanly.
        """
        returncode = self.wait(timeout_s, on_poll=on_poll)
        if returncode is None:
            log.warning("%s pid %d did not exit in time: SIGKILL", self.name, self.pid)
            returncode = self.kill()
        log.info("%s pid %d exited (%s)", self.name, self.pid, describe_exit(returncode))
        self.clear()

    def clear(self) -> None:
        """Forget the exited process (its pid no longer describes anything)."""
        self.proc = None
        self.start_ticks = None
        self.ready = False

    def schedule_restart(self, backoff_s: float, max_restarts: int, made_progress: bool = False) -> float | None:
        """Count a crash; the backoff before the restart, or None when the crash budget is spent. A
        process that ran long enough, or made lasting progress (a trainer that wrote a checkpoint),
        was not in a crash loop: the count starts again."""
        if self.uptime_s >= HEALTHY_UPTIME_S or made_progress:
            self.crashes_in_a_row = 0
        self.crashes_in_a_row += 1
        if self.crashes_in_a_row > max_restarts:
            return None
        delay = backoff_s * 2 ** (self.crashes_in_a_row - 1)
        self.restart_at = time.monotonic() + delay
        self.restarts += 1
        return delay

    def restart_if_due(self, before: Callable[[], None] = lambda: None) -> None:
        """Start the exited process again once its scheduled restart is due (``before`` just ahead of it)."""
        if self.proc is None and self.restart_at is not None and time.monotonic() >= self.restart_at:
            before()
            self.start()
            log.info("restarted %s pid %d (restart %d)", self.name, self.pid, self.restarts)

    def after_crash(
        self, returncode: int, backoff_s: float, max_restarts: int, made_progress: bool = False, resumes: str = ""
    ) -> bool:
        """Count a crash and schedule the restart (True), or log that the crash budget is spent (False: the caller
        gives up). ``resumes``: how the restarted process carries on, for the log."""
        delay = self.schedule_restart(backoff_s, max_restarts, made_progress)
        if delay is None:
            log.error(
                "%s crashed (%s) %d times in a row, more than launch.max_restarts=%d: giving up. See %s%s",
                self.name,
                describe_exit(returncode),
                self.crashes_in_a_row,
                max_restarts,
                self.log_path,
                log_tail(self.log_path),
            )
            return False
        log.warning(
            "%s crashed (%s), restarting in %.1f s (crash %d in a row)%s. See %s%s",
            self.name,
            describe_exit(returncode),
            delay,
            self.crashes_in_a_row,
            f"; {resumes}" if resumes else "",
            self.log_path,
            log_tail(self.log_path, 3),
        )
        return True

    def record(self, **role: Any) -> ChildRecord:
        """It as launcher.json keeps it, with ``role``'s own fields (a producer's id, a trainer's devices)."""
        return ChildRecord(
            pid=self.pid,
            start_ticks=self.start_ticks,
            started=self.started_wall if self.proc else None,
            status_since=self.status_since if self.proc else None,
            incarnation=self.incarnation,
            restarts=self.restarts,
            **role,
        )

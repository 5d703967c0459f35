"""The launcher: start the producers once, supervise the trainer, restart what crashes.

    python -m launch.supervisor run [--run-dir DIR] [--config FILE] [key=value ...]
    python -m launch.supervisor restart-trainer --run-dir DIR [key=value ...]
    python -m launch.supervisor stop --run-dir DIR
    python -m launch.supervisor status --run-dir DIR [--json]

(``launch/run_all.sh`` is the user-facing wrapper.) Lifecycle of ``run``:

1. Resolve the config (the run dir's config.toml when resuming, else --config or launch/tiny.toml,
   then the overrides) and save it. A ConfigError prints its message and exits 2; nothing starts.
2. Remove socket files of dead owners in DIR/sockets, start one producer per entry of
   launch.producer_devices (each in its own process group, output appended to logs/producer-{I}.log;
   an entry naming several devices is one tensor-parallel producer under torchrun, one rank per
   device) and wait until every producers/p{I}.json says ready with the right pid (torchrun's, for a
   tensor-parallel one).
3. Start the trainer (torchrun when launch.trainer_devices lists several devices).
4. Poll every 0.2 s. A crashed process is restarted after launch.restart_backoff_s, doubling per
   crash in a row (the count resets after a minute of uptime, or for the trainer after a new checkpoint); after launch.max_restarts crashes
   in a row the run stops. Producers are never restarted because of the trainer.
5. Trainer exit 0 with trainer.json state "finished": stop the producers and exit 0. A trainer
   that stopped with a checkpoint (state "stopped") without being asked is replaced at once.
   Exit 2 from any child is a configuration error: stop everything and exit 2.
6. SIGINT / SIGTERM / SIGHUP: stop the trainer (SIGTERM, up to 60 s for its checkpoint, then
   SIGKILL of its process group), then the producers; exit 130 / 0 / 129. A second signal (Ctrl-C
   again) only says that the stop is under way: skipping it would lose the steps since the last
   checkpoint and leave the rings in /dev/shm. SIGUSR1 means "a restart-trainer request is in DIR/control". Children get SIGTERM
   from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so none is left behind.

Exit codes: 0 finished or stopped, 1 gave up (crash loop, producer never ready), 2 configuration
error or launcher already running, 129/130 hang-up/interrupted.

Testing hook: DFLASH_PRODUCER_CMD / DFLASH_TRAINER_CMD, when set, replace the program part of the
role commands (``python -m producer.server`` / ``python -m trainer.train``, shell-split); the
launcher's own arguments follow unchanged. With the trainer hook set, torchrun is not used.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from common.config import ConfigError, RunConfig, fixed_while_producers_run, load_config, readers, save_config, to_dict
from common.lifecycle import EXIT_CONFIG_ERROR
from common.naming import process_alive, process_start_ticks, run_tag, sweep_stale, sweep_stale_trainer_staging
from common.rundir import RunDir, atomic_write_json, read_json
from common.status import TrainerStatus
from launch import status as status_cmd
from launch.mps import MpsDaemon
from launch.progress import ProgressView, ViewHandler, run_summary

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "launch" / "tiny.toml"
PRODUCER_CMD_ENV = "DFLASH_PRODUCER_CMD"
TRAINER_CMD_ENV = "DFLASH_TRAINER_CMD"
TRAINER_DEVICES_ENV = "DFLASH_TRAINER_DEVICES"

POLL_INTERVAL_S = 0.2
PREDECESSOR_ENV = "DFLASH_TRAINER_AFTER"  # trainer.train.PREDECESSOR_ENV (the launcher imports no trainer code)
STOP_SIGNAL_EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGHUP: 129}  # SIGTERM: asked to stop
HEALTHY_UPTIME_S = 60.0  # a process up this long has recovered: its crash count and backoff reset
TRAINER_STOP_TIMEOUT_S = 60.0  # time for the trainer's final checkpoint before SIGKILL
PRODUCER_STOP_TIMEOUT_S = 30.0
RESTART_RESULT_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + 60.0
STOP_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + PRODUCER_STOP_TIMEOUT_S + 30.0
# Producer socket names ("p{I}.<pid>-<start ticks>.ipc" or alike) need room after DIR/sockets/.
SOCKET_NAME_ROOM = 40
MAX_IPC_PATH = 100

# Keys restart-trainer may change: the producers never read them. Everything else (target, data,
# batching, drafter, ring, launch.num_producers/producer_devices) shapes what producers ship.


class UsageError(Exception):
    """The command cannot run as asked (e.g. a launcher already runs on this run dir); exit 2."""


# -- configuration -------------------------------------------------------------------------------


def _has_trained(run: RunDir) -> bool:
    """Whether the run dir holds training progress: a checkpoint, a ledger line, or a trainer that took a step."""
    if run.latest_checkpoint() is not None or (run.ledger.is_file() and run.ledger.stat().st_size > 0):
        return True
    return bool(TrainerStatus.read(run.trainer_status).step)


def resolve_run(run_dir: Path | None, config_file: Path | None, overrides: list[str]) -> tuple[RunDir, RunConfig, bool]:
    """The run directory, its resolved config and whether it resumes an existing run.

    An existing run dir (one with config.toml) keeps its config: the overrides apply on top of it.
    ``--config`` is then only accepted when it resolves to the same config, so that a stale command
    line cannot silently replace the settings of a run that has checkpoints. A run dir that never
    trained a step (its first start failed) takes the new ``--config`` and overrides instead.
    """
    if run_dir is None:
        run_dir = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
        while run_dir.exists():
            run_dir = run_dir.with_name(run_dir.name + "-1")
    run = RunDir(run_dir.resolve())
    run.check_format()  # before reading anything of a folder another version made
    resumed = run.config.is_file()
    if resumed and config_file is not None and not _has_trained(run):
        resumed = False  # a first start that failed before any step: its config is no one's to keep
    if resumed:
        if config_file is not None and to_dict(load_config(config_file)) != to_dict(load_config(run.config)):
            raise ConfigError(
                f"--config {config_file} differs from the config of the existing run {run.config}; resume without "
                "--config and give key=value overrides to change settings, or use a new --run-dir"
            )
        cfg = load_config(run.config, overrides)
    else:
        if config_file is None and not DEFAULT_CONFIG.is_file():
            raise ConfigError(f"no --config given and the embedded default {DEFAULT_CONFIG} is missing")
        cfg = load_config(config_file or DEFAULT_CONFIG, overrides)
    if len(str(run.sockets)) + SOCKET_NAME_ROOM > MAX_IPC_PATH:
        raise ConfigError(
            f"--run-dir: {run.root} is too long for ipc socket paths (limit {MAX_IPC_PATH} characters with the "
            "socket name); use a shorter run directory"
        )
    return run, cfg, resumed


def changed_keys(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted ``section.key`` names whose values differ."""
    old_data, new_data = to_dict(old), to_dict(new)
    return [
        f"{section}.{key}"
        for section, values in new_data.items()
        for key, value in values.items()
        if old_data[section][key] != value
    ]


def refused_trainer_changes(
    changed: list[str], old: RunConfig | None = None, new: RunConfig | None = None
) -> list[str]:
    """Messages for the changed keys that restart-trainer must refuse: those a producer or the drafter's
    checkpoint holds (each field's readers, ``READ_BY`` in common/config.py)."""
    refusals = []
    for key in changed:
        if (
            key == "training.max_steps"
            and new is not None
            and old is not None
            and new.training.max_steps == 0
            and old.training.max_steps != 0
        ):
            # A trainer sized by epochs reads each producer's epoch batch count, which producers write only
            # when they themselves started with max_steps 0: it would wait for counts that never come.
            refusals.append(
                "training.max_steps=0 (size the run by training.epochs) needs the producers started with "
                f"max_steps 0, and they run with {old.training.max_steps}"
            )
        elif fixed_while_producers_run(key):
            held_by = (
                "the producers read it at their start"
                if "producer" in readers(key)
                else "the drafter's checkpoint fixes it"
            )
            refusals.append(f"{key} cannot change while the producers run ({held_by})")
    return refusals


# -- devices and commands ------------------------------------------------------------------------


def detect_cuda() -> bool:
    """Whether torch sees a CUDA device; asked in a subprocess so the supervisor never holds torch or a CUDA context."""
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
    return child_environment(
        {
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get(
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(PRODUCER_STOP_TIMEOUT_S) - 5)
            )
        }
    )


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


def _terminate_with_parent(parent_pid: int) -> Callable[[], None]:
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

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path, devices: list[str]) -> None:
        self.name = name
        self.command = command
        self.devices = devices
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
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
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                process_group=0,
                preexec_fn=_terminate_with_parent(os.getpid()),
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

    def record(self) -> dict:
        return {
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "started": self.started_wall if self.proc else None,
            "status_since": self.status_since if self.proc else None,
            "incarnation": self.incarnation,
            "restarts": self.restarts,
        }


# -- the supervisor ------------------------------------------------------------------------------


def _sm_cap(percent: int | None, shared_devices: set[str]) -> dict[str, str]:
    """The MPS client setting that caps a process at ``percent`` of a GPU's SMs, where it shares a GPU."""
    if percent is None or not any(d.startswith("cuda") for d in shared_devices):
        return {}
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}


class Supervisor:
    """Starts the producers, then the trainer, and keeps them running until the run ends."""

    def __init__(self, run: RunDir, cfg: RunConfig, has_cuda: Callable[[], bool] = detect_cuda) -> None:
        self.run = run
        self.cfg = cfg
        self.producers_cfg = cfg
        """The config the producers were started with (restart-trainer may change only the trainer's)."""
        self.has_cuda = functools.cache(has_cuda)  # asked at most once: detection imports torch (seconds)
        self.mps = MpsDaemon(run.root, run.logs) if cfg.launch.mps else None
        self.cpu_processes = cpu_processes(
            [*producer_devices(cfg, self.has_cuda), ",".join(trainer_devices(cfg, self.has_cuda))]
        )
        self.cpu_threads = cpu_threads(self.cpu_processes)
        """Torch threads of each child that computes on the CPU (None: the user's OMP_NUM_THREADS, or no such child)."""
        self.producers = [
            ManagedProcess(
                f"producer-{i}",
                producer_command(run.root, i, device),
                {
                    **producer_environment(device),
                    **self._mps_env(),
                    **self._producer_mps_limit(device),
                    **self._thread_env(device.split(",")),
                },
                run.log(f"producer-{i}"),
                device.split(","),
            )
            for i, device in enumerate(producer_devices(cfg, self.has_cuda))
        ]
        self.trainer = self._make_trainer()
        self.spare: ManagedProcess | None = None
        """A trainer started ahead (``--standby``): imported and waiting, it takes over at restart-trainer."""
        self.trainer_started_once = False
        self.trainer_checkpoint_at_start = -1
        """The latest checkpoint's step when the current trainer started (a crash after a newer one is progress)."""
        self.state = "starting"
        self.outcome = "stopped"  # the state launcher.json keeps once everything is stopped
        self.started_wall = time.time()
        self.start_ticks = process_start_ticks(os.getpid())
        self.signals: list[int] = []
        self._signals_answered = 0
        self.restart_requested = False
        self._last_record: dict | None = None
        self.view = ProgressView(run, enabled=cfg.logging.progress)

    def _thread_env(self, devices: list[str]) -> dict[str, str]:
        """The torch thread limit of a child on ``devices``, when it computes on the CPU."""
        return thread_environment(self.cpu_threads) if "cpu" in devices else {}

    def _mps_env(self) -> dict[str, str]:
        """What makes a child a client of the run's MPS daemon (nothing without launch.mps)."""
        return self.mps.env if self.mps else {}

    def _producer_mps_limit(self, device: str) -> dict[str, str]:
        """launch.mps_producer_sm_percent for a producer that shares a GPU with a trainer rank."""
        shared = set(device.split(",")) & set(trainer_devices(self.cfg, self.has_cuda))
        return _sm_cap(self.cfg.launch.mps_producer_sm_percent, shared)

    def _trainer_mps_limit(self, devices: list[str]) -> dict[str, str]:
        """launch.mps_trainer_sm_percent for a trainer whose ranks share a GPU with a producer."""
        producing = {d for entry in producer_devices(self.cfg, self.has_cuda) for d in entry.split(",")}
        return _sm_cap(self.cfg.launch.mps_trainer_sm_percent, set(devices) & producing)

    def _make_trainer(self) -> ManagedProcess:
        devices = trainer_devices(self.cfg, self.has_cuda)
        extra = {
            TRAINER_DEVICES_ENV: ",".join(devices),
            **self._mps_env(),
            **self._trainer_mps_limit(devices),
            **self._thread_env(devices),
        }
        if len(devices) > 1:
            # torchrun gives its ranks this long after forwarding SIGTERM; keep it below our own wait.
            extra["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = os.environ.get(
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(TRAINER_STOP_TIMEOUT_S) - 5)
            )
        return ManagedProcess(
            "trainer",
            trainer_command(self.run.root, devices),
            child_environment(extra),
            self.run.log("trainer"),
            devices,
        )

    # signals only set flags; the poll loop acts on them
    def _on_stop_signal(self, signum: int, _frame: object) -> None:
        self.signals.append(signum)

    def _on_restart_signal(self, _signum: int, _frame: object) -> None:
        self.restart_requested = True

    def _say_still_stopping(self) -> None:
        """A stop signal that came while stopping (a second Ctrl-C) changes nothing: the trainer's checkpoint
        and the producers' clean exits are what a resume and /dev/shm need. Say so, once per signal."""
        while len(self.signals) > self._signals_answered:
            self._signals_answered += 1
            if self._signals_answered > 1:
                log.warning(
                    "already stopping in order: the trainer writes its checkpoint, then the producers free "
                    "their rings (each has a time limit); waiting"
                )

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_stop_signal)  # the terminal went away
        signal.signal(signal.SIGUSR1, self._on_restart_signal)

    def run_until_done(self) -> int:
        """Start everything, supervise, stop everything; the launcher's exit code."""
        removed = sweep_stale(self.run.sockets)
        if removed:
            log.info("removed %d stale socket(s) of dead processes in %s", len(removed), self.run.sockets)
        if self.cpu_threads is not None:
            log.info("%s", threads_message(self.cpu_processes, self.cpu_threads))
        exit_code: int | None = None
        try:
            if self.mps:
                self.mps.start()
            for producer in self.producers:
                producer.start()
                log.info("started %s pid %d on %s", producer.name, producer.pid, ",".join(producer.devices))
            self._write_launcher_json()
            while exit_code is None:
                if self.signals:
                    name = signal.Signals(self.signals[0]).name
                    log.info("received %s: stopping the run", name)
                    exit_code = STOP_SIGNAL_EXIT_CODES[self.signals[0]]
                    break
                exit_code = self._check_producers()
                if exit_code is None:
                    exit_code = self._check_trainer()
                if exit_code is None and self.restart_requested:
                    self._handle_restart_request()
                self._write_launcher_json()
                self._maybe_start_spare()
                self.view.update(self.trainer.status_since, self.trainer.proc is not None)
                if exit_code is None:
                    time.sleep(POLL_INTERVAL_S)
        finally:
            self.view.close()
            self._stop_all()
            # Nobody of this run can take a dead trainer's state over now: a trainer killed with -9 as the
            # last one of the run would otherwise keep its weights and optimizer state in /dev/shm until reboot.
            for leftover in sweep_stale_trainer_staging(run_tag(self.run.root)):
                log.info("removed %s, the staging of a trainer that did not exit cleanly", leftover.name)
            if self.mps:
                self.mps.quit()
            self.state = self.outcome
            self._write_launcher_json(exit_code)
            if self.outcome == "finished":
                print(run_summary(self.run, self.cfg.drafter.block_size, self.cfg.target.path), flush=True)
        return exit_code

    # -- producers

    def _check_producers(self) -> int | None:
        now = time.monotonic()
        for i, producer in enumerate(self.producers):
            if producer.proc is None:
                if producer.restart_at is not None and now >= producer.restart_at:
                    producer.start()
                    log.info("restarted %s pid %d (restart %d)", producer.name, producer.pid, producer.restarts)
                continue
            returncode = producer.poll()
            if returncode is None:
                if not producer.ready:
                    result = self._check_producer_ready(i, producer)
                    if result is not None:
                        return result
                continue
            producer.clear()
            self._mark_not_ready(i)
            if returncode == EXIT_CONFIG_ERROR:
                log.error(
                    "%s: configuration error (exit 2); stopping the run. See %s%s",
                    producer.name,
                    producer.log_path,
                    log_tail(producer.log_path),
                )
                self.outcome = "failed"
                return EXIT_CONFIG_ERROR
            # Exit 0 too: the launcher did not ask it to stop, and the run still needs it.
            result = self._after_crash(producer, returncode)
            if result is not None:
                return result
        if not self.trainer_started_once and all(p.ready for p in self.producers):
            self.state = "running"
            self._start_trainer()
        return None

    def _mark_not_ready(self, producer_id: int) -> None:
        """Make a dead producer's status file say so. It still says ready, with the dead endpoint:
        a trainer would connect there and wait for a WELCOME that never comes (its other producers
        waiting too) until the replacement is ready and rewrites the file."""
        path = self.run.producer_status(producer_id)
        status = read_json(path)
        if status is not None and status.get("ready"):
            atomic_write_json(path, {**status, "ready": False})

    def _check_producer_ready(self, producer_id: int, producer: ManagedProcess) -> int | None:
        status = read_json(self.run.producer_status(producer_id))
        # A tensor-parallel producer's file is written by rank 0, a child of the torchrun we started.
        written_by_it = status is not None and producer.pid in (status.get("pid"), status.get("torchrun_pid"))
        if written_by_it and status.get("ready") is True:
            producer.ready = True
            log.info("%s ready in %.1f s (%s)", producer.name, producer.uptime_s, status.get("endpoint", "?"))
            return None
        if producer.uptime_s <= self.cfg.launch.ready_timeout_s:
            return None
        if not self.trainer_started_once:
            log.error(
                "%s not ready after %.0f s (launch.ready_timeout_s); stopping the run. See %s%s",
                producer.name,
                self.cfg.launch.ready_timeout_s,
                producer.log_path,
                log_tail(producer.log_path),
            )
            self.outcome = "failed"
            return 1
        # Mid-run a producer that hangs while loading is treated like a crashed one.
        log.warning("%s not ready after %.0f s: killing it", producer.name, self.cfg.launch.ready_timeout_s)
        returncode = producer.kill()
        producer.clear()
        return self._after_crash(producer, returncode)

    def _after_crash(self, process: ManagedProcess, returncode: int, made_progress: bool = False) -> int | None:
        """Schedule the restart of a crashed process, or give up on the run (exit 1)."""
        delay = process.schedule_restart(self.cfg.launch.restart_backoff_s, self.cfg.launch.max_restarts, made_progress)
        if delay is None:
            log.error(
                "%s crashed (%s) %d times in a row, more than launch.max_restarts=%d: giving up. See %s%s",
                process.name,
                describe_exit(returncode),
                process.crashes_in_a_row,
                self.cfg.launch.max_restarts,
                process.log_path,
                log_tail(process.log_path),
            )
            self.outcome = "failed"
            return 1
        log.warning(
            "%s crashed (%s), restarting in %.1f s (crash %d in a row). See %s%s",
            process.name,
            describe_exit(returncode),
            delay,
            process.crashes_in_a_row,
            process.log_path,
            log_tail(process.log_path, 3),
        )
        return None

    # -- trainer

    def _checkpoint_step(self) -> int:
        """The step of the run's latest checkpoint (-1: none)."""
        pointer = read_json(self.run.checkpoints / "latest.json") or {}
        step = pointer.get("step")
        return step if isinstance(step, int) else -1

    def _maybe_start_spare(self) -> None:
        """Start a trainer ahead of need (``trainer.train --standby``) once the current one has trained for
        ``launch.standby_trainer_after_s`` (so that its imports slow neither that one's start nor a short
        run): a restart-trainer then costs no imports. Only for a single-process trainer of the real program
        (a torchrun group's successor starts as before)."""
        if self.spare is not None and self.spare.poll() is not None:
            log.warning(
                "the standby trainer pid %d exited (%s); another is started later",
                self.spare.pid,
                describe_exit(self.spare.poll()),
            )
            self.spare.clear()
            self.spare = None
        after = self.cfg.launch.standby_trainer_after_s
        if (
            self.spare is not None
            or self.trainer.proc is None
            or len(self.trainer.devices) > 1
            or after < 0
            or self.trainer.uptime_s < after
            or os.environ.get(TRAINER_CMD_ENV, "").strip()
        ):
            return
        status = self._trainer_final_state()  # this trainer's own status: it has trained, so its start is over
        if not status.step or status.state != "training":
            return
        spare = self._make_trainer()
        spare.name = "standby trainer"  # in the launcher's log; its output goes to trainer.log, which it takes over
        spare.command = [*spare.command, "--standby"]
        spare.start()
        self.spare = spare
        log.info("started a standby trainer pid %d (it takes over at the next restart-trainer)", spare.pid)

    def _start_trainer(self) -> None:
        self.trainer_checkpoint_at_start = self._checkpoint_step()
        self.trainer.start()
        self.trainer_started_once = True
        log.info("started trainer pid %d on %s", self.trainer.pid, ",".join(self.trainer.devices))

    def _trainer_final_state(self) -> TrainerStatus:
        """trainer.json, if this incarnation wrote it (under torchrun its pid is rank 0's, so compare times); else
        an empty record."""
        status = TrainerStatus.read(self.run.trainer_status)
        if status.pid == self.trainer.pid or status.updated >= self.trainer.status_since:
            return status
        return TrainerStatus()

    def _check_trainer(self) -> int | None:
        if not self.trainer_started_once:
            return None
        if self.trainer.proc is None:
            if self.trainer.restart_at is not None and time.monotonic() >= self.trainer.restart_at:
                self.trainer_checkpoint_at_start = self._checkpoint_step()
                self.trainer.start()
                log.info("restarted trainer pid %d (restart %d)", self.trainer.pid, self.trainer.restarts)
            return None
        returncode = self.trainer.poll()
        if returncode is None:
            return None
        status = self._trainer_final_state()
        self.trainer.clear()
        state = status.state
        if returncode == 0 and state == "finished":
            log.info("training finished at step %s: stopping the producers", status.step)
            self.outcome = "finished"
            return 0
        if state == "stopped" and returncode != EXIT_CONFIG_ERROR:
            # Stopped from outside (SIGTERM to its pid): it checkpointed; replace it at once. Any exit
            # code: torchrun reports the SIGTERM it forwarded to its ranks as exit 1.
            log.info(
                "trainer stopped with a checkpoint at step %s without being asked: starting a new one",
                status.step,
            )
            self.trainer.restart_at = time.monotonic()
            self.trainer.restarts += 1
            return None
        if returncode == EXIT_CONFIG_ERROR:
            log.error(
                "trainer: configuration error (exit 2); stopping the run. See %s%s",
                self.trainer.log_path,
                log_tail(self.trainer.log_path),
            )
            self.outcome = "failed"
            return EXIT_CONFIG_ERROR
        # A trainer killed again and again that checkpoints in between is no crash loop (e.g. a
        # flaky node, preemptions): it resumes further on each time.
        return self._after_crash(
            self.trainer, returncode, made_progress=self._checkpoint_step() > self.trainer_checkpoint_at_start
        )

    def _handle_restart_request(self) -> None:
        """Apply a restart-trainer request: validate, save config.toml, replace the trainer."""
        self.restart_requested = False
        request = read_json(self.run.restart_request)
        if request is None:
            return
        request_id = request.get("request_id")
        overrides = [str(o) for o in request.get("overrides") or []]
        try:
            new_cfg = load_config(self.run.config, overrides)
        except ConfigError as exc:
            self._answer_restart(request_id, error=str(exc))
            return
        changed = changed_keys(self.cfg, new_cfg)
        refusals = refused_trainer_changes(changed, self.producers_cfg, new_cfg)
        if refusals:
            self._answer_restart(
                request_id, error="; ".join(refusals) + ". Stop the run and resume it with the new value instead."
            )
            return
        save_config(new_cfg, self.run.config)
        self.cfg = new_cfg
        log.info("restart-trainer: %s", ", ".join(overrides) if changed else "no config change")
        old = self.trainer if self.trainer.proc is not None else None
        successor = self._make_trainer()  # devices may have changed
        if old is not None:
            # One process to one process: the old trainer hands its state over in shared memory
            # (trainer/handover.py) and its successor writes the checkpoint; a torchrun group on either side
            # checkpoints to disk first. The word is a file, read once the step in flight is done: SIGUSR1
            # instead never reached the trainer's handler on an H200 machine (cause not found).
            hand_over = len(old.devices) == 1 and len(successor.devices) == 1
            if hand_over:
                atomic_write_json(self.run.handover_request(old.pid), {"successor_devices": successor.devices})
            log.info(
                "stopping trainer pid %d (waiting up to %.0f s for its %s)",
                old.pid,
                TRAINER_STOP_TIMEOUT_S,
                "handover" if hand_over else "checkpoint",
            )
            old.send(signal.SIGTERM)
        successor.restarts = old_restarts = (old or self.trainer).restarts
        if self.trainer_started_once:
            successor.restarts = old_restarts + 1
            # The successor waits for the old one's handover (its checkpoint, leases and status done) before
            # it reads the checkpoint (trainer.train.wait_for_predecessor); meanwhile it imports, or it did
            # already, as the spare started ahead.
            predecessor = f"{old.pid}:{old.start_ticks}" if old is not None else None
            spare, self.spare = self.spare, None
            if (
                spare is not None
                and spare.proc is not None
                and spare.poll() is None
                and spare.devices == successor.devices
            ):
                atomic_write_json(self.run.standby_go(spare.pid), {"predecessor": predecessor})
                spare.command = successor.command  # a crash restart of it is an ordinary trainer start
                spare.name = successor.name
                spare.restarts = successor.restarts
                self.trainer = spare
                self.trainer_checkpoint_at_start = self._checkpoint_step()
                log.info("trainer pid %d, started ahead, takes over", spare.pid)
            else:
                if spare is not None:
                    self._stop_process(spare, 10.0)
                if predecessor:
                    successor.env = {**successor.env, PREDECESSOR_ENV: predecessor}
                self.trainer = successor
                self._start_trainer()
        else:
            self.trainer = successor
        if old is not None:
            self._await_exit(old, TRAINER_STOP_TIMEOUT_S)
            self.run.handover_request(old.pid).unlink(missing_ok=True)  # unread if it died first
            self.trainer_checkpoint_at_start = (
                self._checkpoint_step()
            )  # the old one's final checkpoint counts as before
            self.trainer.status_since = time.time()  # trainer.json was the old one's until now
        self._write_launcher_json()
        self._answer_restart(request_id, trainer_pid=self.trainer.pid, changed=changed)

    def _answer_restart(
        self,
        request_id: object,
        error: str | None = None,
        trainer_pid: int | None = None,
        changed: list[str] | None = None,
    ) -> None:
        if error:
            log.error("restart-trainer refused: %s", error)
        atomic_write_json(
            self.run.restart_result,
            {
                "request_id": request_id,
                "ok": error is None,
                "error": error,
                "trainer_pid": trainer_pid,
                "changed": changed or [],
                "answered": time.time(),
            },
        )

    # -- shutdown

    def _stop_process(self, process: ManagedProcess, timeout_s: float) -> None:
        """SIGTERM, then wait for the exit (SIGKILL of the group after ``timeout_s``)."""
        process.send(signal.SIGTERM)
        self._await_exit(process, timeout_s)

    def _await_exit(self, process: ManagedProcess, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a process already told to stop, then SIGKILL its group.

        Never a second SIGTERM: one arriving while Python shuts down (handlers back to default)
        kills a process that was exiting cleanly.
        """
        returncode = process.wait(timeout_s, on_poll=self._say_still_stopping)
        if returncode is None:
            log.warning("%s pid %d did not exit in time: SIGKILL", process.name, process.pid)
            returncode = process.kill()
        log.info("%s pid %d exited (%s)", process.name, process.pid, describe_exit(returncode))
        process.clear()

    def _stop_all(self) -> None:
        """Trainer first (so it checkpoints while the producers still answer), then all producers at once."""
        self.state = "stopping"
        self._write_launcher_json()
        if self.spare is not None and self.spare.proc is not None:
            self._stop_process(self.spare, 10.0)
            self.spare = None
        if self.trainer.proc is not None:
            log.info(
                "stopping trainer pid %d (waiting up to %.0f s for its checkpoint)",
                self.trainer.pid,
                TRAINER_STOP_TIMEOUT_S,
            )
            self._stop_process(self.trainer, TRAINER_STOP_TIMEOUT_S)
        running = [p for p in self.producers if p.proc is not None]
        for producer in running:
            producer.send(signal.SIGTERM)
        deadline = time.monotonic() + PRODUCER_STOP_TIMEOUT_S
        for producer in running:
            self._await_exit(producer, max(0.0, deadline - time.monotonic()))

    def _write_launcher_json(self, exit_code: int | None = None) -> None:
        record = {
            "pid": os.getpid(),
            "start_ticks": self.start_ticks,
            "started": self.started_wall,
            "run_dir": str(self.run.root),
            "state": self.state,
            "exit_code": exit_code,
            "producers": [
                {"id": i, "device": ",".join(p.devices), "ready": p.ready, **p.record()}
                for i, p in enumerate(self.producers)
            ],
            "trainer": {"devices": self.trainer.devices, **self.trainer.record()},
            "standby_trainer": self.spare.record() if self.spare is not None and self.spare.proc is not None else None,
        }
        if record != self._last_record:
            self._last_record = record
            atomic_write_json(self.run.launcher, {**record, "updated": time.time()})


# -- entry points --------------------------------------------------------------------------------


def _setup_logging(run: RunDir, view: ProgressView | None = None) -> None:
    log.setLevel(logging.INFO)
    log.propagate = False
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    terminal = ViewHandler(view) if view is not None else logging.StreamHandler(sys.stdout)
    terminal.setFormatter(logging.Formatter("[launch %(asctime)s] %(message)s", "%H:%M:%S"))
    to_file = logging.FileHandler(run.log("launcher"))
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(terminal)
    log.addHandler(to_file)
    logging.getLogger("common.naming").addHandler(to_file)


def _refuse_if_running(run: RunDir) -> None:
    """A run dir has one launcher; leftovers of a dead one must be stopped before a resume."""
    record = read_json(run.launcher)
    if record is None:
        return
    if process_alive(record.get("pid"), record.get("start_ticks")):
        raise UsageError(
            f"a launcher (pid {record['pid']}) already runs {run.root}; use restart-trainer, stop or status"
        )
    leftovers = [c["pid"] for c in _children(record) if process_alive(c.get("pid"), c.get("start_ticks"))]
    if leftovers:
        raise UsageError(
            f"processes of the previous launcher still run (pids {leftovers}); "
            f"run: {shlex.join(['launch/run_all.sh', 'stop', '--run-dir', str(run.root)])}"
        )


def _children(record: dict) -> list[dict]:
    """Child records of launcher.json, trainer first (the order they are stopped in)."""
    trainers = [record.get(key) for key in ("trainer", "standby_trainer")]
    return [t for t in trainers if isinstance(t, dict)] + [
        p for p in record.get("producers") or [] if isinstance(p, dict)
    ]


def run_supervisor(
    run_dir: Path | None, config_file: Path | None, overrides: list[str], has_cuda: Callable[[], bool] = detect_cuda
) -> int:
    """Start (or resume) a run in the foreground; the exit code (see the module docstring)."""
    try:
        run, cfg, resumed = resolve_run(run_dir, config_file, overrides)
        _refuse_if_running(run)
    except (ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    run.create()
    save_config(cfg, run.config)
    _setup_logging(run)
    try:
        supervisor = Supervisor(run, cfg, has_cuda)
    except ConfigError as exc:  # what the config asks for does not exist on this host
        log.error("configuration error: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    _setup_logging(run, supervisor.view)  # the terminal's log lines now go above the progress bar
    supervisor.install_signal_handlers()
    log.info("%s run %s (launcher pid %d)", "resuming" if resumed else "starting", run.root, os.getpid())
    exit_code = supervisor.run_until_done()
    log.info("launcher exits with %d", exit_code)
    return exit_code


def _running_launcher(run: RunDir) -> dict | None:
    record = read_json(run.launcher)
    if record is not None and process_alive(record.get("pid"), record.get("start_ticks")):
        return record
    return None


def request_trainer_restart(run_dir: Path, overrides: list[str], timeout_s: float = RESTART_RESULT_TIMEOUT_S) -> int:
    """Ask the running launcher to replace its trainer; prints the outcome. 0 done, 1 no launcher, 2 refused."""
    run = RunDir(run_dir.resolve())
    record = _running_launcher(run)
    if record is None:
        print(f"error: no launcher is running for {run.root}", file=sys.stderr)
        return 1
    request_id = uuid.uuid4().hex
    run.restart_result.unlink(missing_ok=True)
    atomic_write_json(run.restart_request, {"request_id": request_id, "overrides": overrides, "requested": time.time()})
    os.kill(record["pid"], signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = read_json(run.restart_result)
        if result is not None and result.get("request_id") == request_id:
            if not result.get("ok"):
                print(f"error: restart-trainer refused: {result.get('error')}", file=sys.stderr)
                return EXIT_CONFIG_ERROR
            changed = ", ".join(result.get("changed") or []) or "none"
            if result.get("trainer_pid") is None:
                print(f"config saved (changed: {changed}); the trainer starts once the producers are ready")
            else:
                print(f"trainer restarted: pid {result['trainer_pid']} (changed: {changed})")
            return 0
        if not process_alive(record["pid"], record.get("start_ticks")):
            print("error: the launcher exited before answering", file=sys.stderr)
            return 1
        time.sleep(0.1)
    print(f"error: no answer from the launcher within {timeout_s:.0f} s", file=sys.stderr)
    return 1


def stop_run(run_dir: Path, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """Stop the run cleanly (SIGTERM to the launcher, which stops its children in order) and wait."""
    run = RunDir(run_dir.resolve())
    record = _running_launcher(run)
    if record is not None:
        print(f"stopping launcher pid {record['pid']} ...")
        os.kill(record["pid"], signal.SIGTERM)
        if _wait_gone(record["pid"], record.get("start_ticks"), timeout_s):
            print("stopped")
            return 0
        print(f"error: launcher pid {record['pid']} still runs after {timeout_s:.0f} s", file=sys.stderr)
        return 1
    # The launcher died without stopping its children (e.g. SIGKILL before they noticed): stop them.
    leftovers = [
        c for c in _children(read_json(run.launcher) or {}) if process_alive(c.get("pid"), c.get("start_ticks"))
    ]
    if not leftovers:
        print(f"no launcher is running for {run.root}")
        return 1
    for child in leftovers:
        print(f"stopping leftover process pid {child['pid']} ...")
        os.kill(child["pid"], signal.SIGTERM)
        if not _wait_gone(child["pid"], child.get("start_ticks"), TRAINER_STOP_TIMEOUT_S):
            os.killpg(child["pid"], signal.SIGKILL)
    print("stopped")
    return 0


def _wait_gone(pid: int, start_ticks: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid, start_ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


COMMANDS = ("run", "restart-trainer", "stop", "status")


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"launch/run_all.sh {command}")
    if command == "run":
        parser.description = "Start (or resume) a run in the foreground."
        parser.add_argument(
            "--run-dir", type=Path, help="run directory (default: a fresh runs/<timestamp>); an existing one is resumed"
        )
        parser.add_argument("--config", type=Path, help="TOML config of a new run (default: launch/tiny.toml)")
    else:
        parser.add_argument("--run-dir", type=Path, required=True)
    if command in ("run", "restart-trainer"):
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. training.lr=3e-4")
    if command == "restart-trainer":
        parser.description = (
            "Replace the trainer of a running pipeline (only training.*, logging.* and launcher-only keys may change)."
        )
    if command == "stop":
        parser.description = "Stop a running pipeline cleanly and wait for it."
    if command == "status":
        parser.description = "Show the live state of a pipeline."
        parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m launch.supervisor {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    command = argv[0]
    # Intermixed: overrides may come before or after --run-dir.
    args = _command_parser(command).parse_intermixed_args(argv[1:])
    if command == "run":
        return run_supervisor(args.run_dir, args.config, args.overrides)
    if command == "restart-trainer":
        return request_trainer_restart(args.run_dir, args.overrides)
    if command == "stop":
        return stop_run(args.run_dir)
    return status_cmd.show_status(args.run_dir, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())

"""The launcher: start the producers once, supervise the trainer, restart what crashes.

Its command line is launch/commands.py (``launch/run_all.sh`` the user-facing wrapper); the run directory and
configuration a command resolves, launch/runs.py; its children's commands and processes, launch/processes.py, and
where they compute, launch/placement.py. The loop here drives two roles: the producers' pool
(launch/producer_pool.py) and the trainer's slot (launch/trainer_slot.py: its restarts, the standby trainer, the
out-of-memory stop, restart-trainer). Lifecycle of ``run``:

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
   in a row the run stops. Producers are never restarted because of the trainer. A trainer whose step ran out
   of memory (logs/out-of-memory.jsonl, common/lifecycle.py) is restarted once, like a crash; out of memory
   again at a step that ran out before is what the config does on this card at every try: the run stops with
   exit 2, naming the peak memory seen, the card's and the keys that lower it.
5. Trainer exit 0 with trainer.json state "finished": stop the producers and exit 0. A trainer
   that stopped with a checkpoint (state "stopped") without being asked is replaced at once.
   Exit 2 from any child is a configuration error: stop everything and exit 2.
6. SIGINT / SIGTERM / SIGHUP: stop the trainer (SIGTERM, up to 60 s for its checkpoint, then
   SIGKILL of its process group), then the producers; exit 130 / 0 / 129. A second signal (Ctrl-C
   again) only says that the stop is under way: skipping it would lose the steps since the last
   checkpoint and leave the rings in /dev/shm. SIGUSR1 means "a restart-trainer request is in DIR/control". Children get SIGTERM
   from the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so none is left behind.

Exit codes: 0 finished or stopped, 1 gave up (crash loop, producer never ready), 2 configuration
error, out of memory at the same step twice, or launcher already running, 129/130 hang-up/interrupted.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from common.config import ConfigError, RunConfig, save_config
from common.control import RestartRequest, RestartResult
from common.lifecycle import EXIT_CONFIG_ERROR
from common.naming import process_alive, process_start_ticks, run_tag, sweep_stale, sweep_stale_trainer_staging
from common.rundir import RunDir
from common.status import LauncherRecord
from launch.placement import Placement
from launch.processes import PRODUCER_STOP_TIMEOUT_S, detect_cuda, threads_message
from launch.producer_pool import ProducerPool
from launch.progress import ProgressView, ViewHandler, run_summary
from launch.runs import UsageError, resolve_run
from launch.trainer_slot import TRAINER_STOP_TIMEOUT_S, TrainerSlot

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2
STOP_SIGNAL_EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGHUP: 129}  # SIGTERM: asked to stop
RESTART_RESULT_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + 60.0
STOP_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + PRODUCER_STOP_TIMEOUT_S + 30.0


class Supervisor:
    """The launcher's loop over the run's two roles: the producers' pool and the trainer's slot, on one placement.
    It starts them, polls their health, serves restart-trainer, and stops them in order."""

    def __init__(self, run: RunDir, cfg: RunConfig, has_cuda: Callable[[], bool] = detect_cuda) -> None:
        self.run = run
        self.placement = Placement(run.root, run.logs, cfg, has_cuda)
        self.producers = ProducerPool(run, cfg, self.placement)
        self.trainer = TrainerSlot(run, cfg, self.placement, while_waiting=self._say_still_stopping)
        self.view = ProgressView(run, enabled=cfg.logging.progress)
        self.state = "starting"
        self.outcome = "stopped"  # the state launcher.json keeps once everything is stopped
        self.started_wall = time.time()
        self.start_ticks = process_start_ticks(os.getpid())
        self.signals: list[int] = []
        self._signals_answered = 0
        self.restart_requested = False
        self._last_record: LauncherRecord | None = None

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
        if self.placement.cpu_threads is not None:
            log.info("%s", threads_message(self.placement.cpu_processes, self.placement.cpu_threads))
        exit_code: int | None = None
        try:
            self.placement.start()
            self.producers.start()
            self._write_launcher_json()
            while exit_code is None:
                if self.signals:
                    log.info("received %s: stopping the run", signal.Signals(self.signals[0]).name)
                    exit_code = STOP_SIGNAL_EXIT_CODES[self.signals[0]]
                    break
                exit_code = self._poll()
                if exit_code is None:
                    time.sleep(POLL_INTERVAL_S)
        finally:
            self.view.close()
            self._stop_all()
            # Nobody of this run can take a dead trainer's state over now: a trainer killed with -9 as the
            # last one of the run would otherwise keep its weights and optimizer state in /dev/shm until reboot.
            for leftover in sweep_stale_trainer_staging(run_tag(self.run.root)):
                log.info("removed %s, the staging of a trainer that did not exit cleanly", leftover.name)
            self.placement.close()
            self.state = self.outcome
            self._write_launcher_json(exit_code)
            if self.outcome == "finished":
                print(run_summary(self.run), flush=True)
        return exit_code

    def _poll(self) -> int | None:
        """One round: the producers' health, the trainer's start once they are ready, its health, a restart-trainer
        request, launcher.json, the standby trainer, the progress view. The run's exit code where it ends."""
        exit_code = self.producers.check(mid_run=self.trainer.started_once)
        if exit_code is None and not self.trainer.started_once and self.producers.ready:
            self.state = "running"
            self.trainer.start()
        if exit_code is None:
            exit_code = self.trainer.check()
        if exit_code is not None:
            self.outcome = "finished" if exit_code == 0 else "failed"
        if exit_code is None and self.restart_requested:
            self._serve_restart_request()
        self._write_launcher_json()
        self.trainer.keep_standby()
        trainer = self.trainer.process
        self.view.update(trainer.status_since, trainer.proc is not None)
        return exit_code

    def _serve_restart_request(self) -> None:
        """Answer a restart-trainer request: the trainer's slot applies it; the producers follow the new config's
        launcher settings."""
        self.restart_requested = False
        request = RestartRequest.read(self.run.restart_request)
        if request is None:
            return
        result = self.trainer.restart(request, self.producers.started_with)
        if result.ok:
            self.producers.cfg = self.trainer.cfg
            self._write_launcher_json()
        result.write(self.run.restart_result)

    def _stop_all(self) -> None:
        """Trainer first (so it checkpoints while the producers still answer), then all producers at once."""
        self.state = "stopping"
        self._write_launcher_json()
        self.trainer.stop()
        self.producers.stop(on_poll=self._say_still_stopping)

    def _write_launcher_json(self, exit_code: int | None = None) -> None:
        record = LauncherRecord(
            pid=os.getpid(),
            start_ticks=self.start_ticks,
            started=self.started_wall,
            run_dir=str(self.run.root),
            state=self.state,
            exit_code=exit_code,
            producers=self.producers.records(),
            trainer=self.trainer.record(),
            standby_trainer=self.trainer.standby_record(),
        )
        if record != self._last_record:  # written when something changed, stamped with when
            self._last_record = record
            record.write(self.run.launcher)


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
    record = LauncherRecord.read(run.launcher)
    if record is None:
        return
    if process_alive(record.pid, record.start_ticks):
        raise UsageError(f"a launcher (pid {record.pid}) already runs {run.root}; use restart-trainer, stop or status")
    leftovers = [c.pid for c in record.children() if process_alive(c.pid, c.start_ticks)]
    if leftovers:
        raise UsageError(
            f"processes of the previous launcher still run (pids {leftovers}); "
            f"run: {shlex.join(['launch/run_all.sh', 'stop', '--run-dir', str(run.root)])}"
        )


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


def _running_launcher(run: RunDir) -> LauncherRecord | None:
    record = LauncherRecord.read(run.launcher)
    if record is not None and process_alive(record.pid, record.start_ticks):
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
    RestartRequest(request_id, list(overrides)).write(run.restart_request)
    os.kill(record.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = RestartResult.read(run.restart_result)
        if result is not None and result.request_id == request_id:
            if not result.ok:
                print(f"error: restart-trainer refused: {result.error}", file=sys.stderr)
                return EXIT_CONFIG_ERROR
            changed = ", ".join(result.changed) or "none"
            if result.trainer_pid is None:
                print(f"config saved (changed: {changed}); the trainer starts once the producers are ready")
            else:
                print(f"trainer restarted: pid {result.trainer_pid} (changed: {changed})")
            return 0
        if not process_alive(record.pid, record.start_ticks):
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
        print(f"stopping launcher pid {record.pid} ...")
        os.kill(record.pid, signal.SIGTERM)
        if _wait_gone(record.pid, record.start_ticks, timeout_s):
            print("stopped")
            return 0
        print(f"error: launcher pid {record.pid} still runs after {timeout_s:.0f} s", file=sys.stderr)
        return 1
    # The launcher died without stopping its children (e.g. SIGKILL before they noticed): stop them.
    last = LauncherRecord.read(run.launcher) or LauncherRecord()
    leftovers = [c for c in last.children() if process_alive(c.pid, c.start_ticks)]
    if not leftovers:
        print(f"no launcher is running for {run.root}")
        return 1
    for child in leftovers:
        print(f"stopping leftover process pid {child.pid} ...")
        os.kill(child.pid, signal.SIGTERM)
        if not _wait_gone(child.pid, child.start_ticks, TRAINER_STOP_TIMEOUT_S):
            os.killpg(child.pid, signal.SIGKILL)
    print("stopped")
    return 0


def _wait_gone(pid: int, start_ticks: int | None, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid, start_ticks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True

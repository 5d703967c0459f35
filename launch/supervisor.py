"""The launcher: start the producers once, supervise the trainer, restart what crashes.

Its command line is launch/commands.py (``launch/run_all.sh`` the user-facing wrapper); the run directory and
configuration a command resolves, launch/runs.py; its children's commands and processes, launch/processes.py.
Lifecycle of ``run``:

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

import functools
import logging
import os
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from common.config import ConfigError, RunConfig, load_config, save_config
from common.control import PREDECESSOR_ENV, HandoverRequest, RestartRequest, RestartResult, StandbyGo
from common.lifecycle import EXIT_CONFIG_ERROR, OUT_OF_MEMORY_LOG, OutOfMemory
from common.naming import process_alive, process_start_ticks, run_tag, sweep_stale, sweep_stale_trainer_staging
from common.rundir import RunDir, read_json
from common.status import LauncherRecord, ProducerStatus, TrainerStatus
from launch.mps import MpsDaemon
from launch.preload_client import Preloader
from launch.processes import (
    PRODUCER_STOP_TIMEOUT_S,
    TRAINER_CMD_ENV,
    ManagedProcess,
    child_environment,
    cpu_processes,
    cpu_threads,
    describe_exit,
    detect_cuda,
    log_tail,
    producer_command,
    producer_devices,
    producer_environment,
    terminate_with_parent,
    thread_environment,
    threads_message,
    trainer_command,
    trainer_devices,
)
from launch.progress import ProgressView, ViewHandler, run_summary
from launch.runs import UsageError, changed_keys, refused_trainer_changes, resolve_run

log = logging.getLogger(__name__)

TRAINER_DEVICES_ENV = "DFLASH_TRAINER_DEVICES"
POLL_INTERVAL_S = 0.2
STOP_SIGNAL_EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGHUP: 129}  # SIGTERM: asked to stop
TRAINER_STOP_TIMEOUT_S = 60.0  # time for the trainer's final checkpoint before SIGKILL
RESTART_RESULT_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + 60.0
STOP_TIMEOUT_S = TRAINER_STOP_TIMEOUT_S + PRODUCER_STOP_TIMEOUT_S + 30.0
MEMORY_KEYS = (
    "batching.token_budget or drafter.num_anchors (what one step holds), launch.num_producers (or the entries of "
    "launch.producer_devices that share the trainer's GPU), or spread the trainer over more GPUs "
    "(launch.trainer_devices)"
)


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
        self.preloader: Preloader | None = None
        """Where children on the CPU are forked from (launch.preload), made at the first such start."""
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
                self._preloader_for(device.split(",")),
            )
            for i, device in enumerate(producer_devices(cfg, self.has_cuda))
        ]
        self.trainer = self._make_trainer()
        self.spare: ManagedProcess | None = None
        """A trainer started ahead (``--standby``): imported and waiting, it takes over at restart-trainer."""
        self.trainer_started_once = False
        self.trainer_checkpoint_at_start = -1
        """The latest checkpoint's step when the current trainer started (a crash after a newer one is progress)."""
        self.out_of_memory: dict[int, list[OutOfMemory]] = {}
        """The trainer's out-of-memory records by the step that failed, since this launcher (or its config) started."""
        self.state = "starting"
        self.outcome = "stopped"  # the state launcher.json keeps once everything is stopped
        self.started_wall = time.time()
        self.start_ticks = process_start_ticks(os.getpid())
        self.signals: list[int] = []
        self._signals_answered = 0
        self.restart_requested = False
        self._last_record: LauncherRecord | None = None
        self.view = ProgressView(run, enabled=cfg.logging.progress)

    def _preloader_for(self, devices: list[str]) -> Preloader | None:
        """The preloader that starts a child on ``devices`` under launch.preload: children on the CPU alone, without
        MPS (launch/preload.py); None otherwise."""
        if not self.cfg.launch.preload or self.mps or any(d != "cpu" for d in devices):
            return None
        if self.preloader is None:
            self.preloader = Preloader(child_environment(self._thread_env(["cpu"])), terminate_with_parent(os.getpid()))
        return self.preloader

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
            self._preloader_for(devices),
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
            if self.preloader:
                self.preloader.close()
            if self.mps:
                self.mps.quit()
            self.state = self.outcome
            self._write_launcher_json(exit_code)
            if self.outcome == "finished":
                print(run_summary(self.run), flush=True)
        return exit_code

    # -- producers

    def _check_producers(self) -> int | None:
        for i, producer in enumerate(self.producers):
            if producer.proc is None:
                producer.restart_if_due()
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
        status = ProducerStatus.read(path)
        if status is not None and status.ready:
            status.ready = False
            status.write(path)

    def _check_producer_ready(self, producer_id: int, producer: ManagedProcess) -> int | None:
        status = ProducerStatus.read(self.run.producer_status(producer_id))
        if status is not None and status.written_by(producer.pid) and status.ready:
            producer.ready = True
            log.info("%s ready in %.1f s (%s)", producer.name, producer.uptime_s, status.endpoint or "?")
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
        launch = self.cfg.launch
        if process.after_crash(returncode, launch.restart_backoff_s, launch.max_restarts, made_progress):
            return None
        self.outcome = "failed"
        return 1

    # -- trainer

    def _note_checkpoint_at_start(self) -> None:
        """A trainer that writes a checkpoint past this one made progress: its crash count starts again."""
        self.trainer_checkpoint_at_start = self._checkpoint_step()

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
            self.trainer.restart_if_due(before=self._note_checkpoint_at_start)
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
        ran_out = OutOfMemory.since(self.run, self.trainer.status_since)
        if ran_out:  # whatever the exit code: under torchrun the group exits 1
            return self._after_out_of_memory(ran_out, returncode)
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

    def _after_out_of_memory(self, records: list[OutOfMemory], returncode: int) -> int | None:
        """A trainer whose step ran out of memory: restarted once (a fragmented allocator need not fail again), or,
        at a step that ran out before, the run stops with exit 2 (it would at every restart)."""
        step = min(r.step for r in records)
        before = self.out_of_memory.get(step, [])
        self.out_of_memory.setdefault(step, []).extend(records)
        if before:
            log.error(
                "trainer: out of memory at step %d again, after a restart (%s): it would be at every restart, so the "
                "run stops. Lower %s. See %s and logs/%s%s",
                step,
                memory_seen([*before, *records]),
                MEMORY_KEYS,
                self.trainer.log_path,
                OUT_OF_MEMORY_LOG,
                log_tail(self.trainer.log_path),
            )
            self.outcome = "failed"
            return EXIT_CONFIG_ERROR
        log.warning(
            "trainer: out of memory at step %d (%s); restarted once, as it may not repeat: a second one at step %d "
            "stops the run",
            step,
            memory_seen(records),
            step,
        )
        return self._after_crash(self.trainer, returncode)

    def _handle_restart_request(self) -> None:
        """Apply a restart-trainer request: validate, save config.toml, replace the trainer."""
        self.restart_requested = False
        request = RestartRequest.read(self.run.restart_request)
        if request is None:
            return
        request_id = request.request_id
        overrides = [str(o) for o in request.overrides]
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
        self.out_of_memory.clear()  # a step that ran out of memory may fit the new config
        log.info("restart-trainer: %s", ", ".join(overrides) if changed else "no config change")
        old = self.trainer if self.trainer.proc is not None else None
        successor = self._make_trainer()  # devices may have changed
        if old is not None:
            # One process to one process: the old trainer hands its state over in shared memory
            # (trainer/handover.py) and its successor writes the checkpoint; a torchrun group on either side
            # checkpoints to disk first. The word is a file, read once the step in flight is done: unlike a
            # signal it needs no handler to be installed in time and is not lost while the process is busy.
            hand_over = len(old.devices) == 1 and len(successor.devices) == 1
            if hand_over:
                HandoverRequest(successor.devices).write(self.run.handover_request(old.pid))
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
                StandbyGo(predecessor).write(self.run.standby_go(spare.pid))
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
        request_id: str,
        error: str | None = None,
        trainer_pid: int | None = None,
        changed: list[str] | None = None,
    ) -> None:
        if error:
            log.error("restart-trainer refused: %s", error)
        RestartResult(request_id, error is None, error, trainer_pid, changed or []).write(self.run.restart_result)

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
        record = LauncherRecord(
            pid=os.getpid(),
            start_ticks=self.start_ticks,
            started=self.started_wall,
            run_dir=str(self.run.root),
            state=self.state,
            exit_code=exit_code,
            producers=[p.record(id=i, device=",".join(p.devices), ready=p.ready) for i, p in enumerate(self.producers)],
            trainer=self.trainer.record(devices=self.trainer.devices),
            standby_trainer=self.spare.record() if self.spare is not None and self.spare.proc is not None else None,
        )
        if record != self._last_record:  # written when something changed, stamped with when
            self._last_record = record
            record.write(self.run.launcher)


def memory_seen(records: list[OutOfMemory]) -> str:
    """The largest peak memory of ``records`` and its device's memory, in words."""
    return max(records, key=lambda r: r.peak_reserved or r.peak_allocated or 0).seen()


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

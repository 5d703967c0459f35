"""The trainer's slot: the run's one trainer (a process, or a torchrun group over launch.trainer_devices), started
once the producers are ready and restarted when it crashes; a standby trainer started ahead of need; the stop after
the same out-of-memory step twice; and restart-trainer, which replaces the trainer with a successor that takes
its state over (trainer/handover.py, trainer/takeover.py)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from common.config import ConfigError, RunConfig, load_config, save_config
from common.control import PREDECESSOR_ENV, HandoverRequest, RestartRequest, RestartResult, StandbyGo
from common.lifecycle import EXIT_CONFIG_ERROR, OUT_OF_MEMORY_LOG, OutOfMemory
from common.rundir import RunDir, read_json
from common.status import ChildRecord, TrainerStatus
from launch.placement import Placement
from launch.processes import (
    TRAINER_CMD_ENV,
    ManagedProcess,
    child_environment,
    describe_exit,
    log_tail,
    trainer_command,
)
from launch.runs import changed_keys, refused_trainer_changes

log = logging.getLogger("launch.supervisor")  # the launcher's log

TRAINER_DEVICES_ENV = "DFLASH_TRAINER_DEVICES"
TRAINER_STOP_TIMEOUT_S = 60.0  # time for the trainer's final checkpoint before SIGKILL
STANDBY_STOP_TIMEOUT_S = 10.0  # a standby trainer has nothing to save
GAVE_UP = 1
"""The run's exit code when the trainer crashed more than launch.max_restarts times in a row."""
MEMORY_KEYS = (
    "batching.token_budget or drafter.num_anchors (what one step holds), launch.num_producers (or the entries of "
    "launch.producer_devices that share the trainer's GPU), or spread the trainer over more GPUs "
    "(launch.trainer_devices)"
)


class TrainerSlot:
    """The run's trainer (see the module's docstring)."""

    def __init__(self, run: RunDir, cfg: RunConfig, placement: Placement, while_waiting: Callable[[], None]) -> None:
        self.run = run
        self.cfg = cfg
        """The run's config as the trainer has it: restart-trainer replaces it."""
        self.placement = placement
        self.while_waiting = while_waiting
        """Called between polls while the launcher waits for a trainer's exit (it answers a second stop signal)."""
        self.process = self._make()
        self.spare: ManagedProcess | None = None
        """A trainer started ahead (``--standby``): imported and waiting, it takes over at restart-trainer."""
        self.started_once = False
        self.checkpoint_at_start = -1
        """The latest checkpoint's step when the current trainer started (a crash after a newer one is progress)."""
        self.out_of_memory: dict[int, list[OutOfMemory]] = {}
        """The trainer's out-of-memory records by the step that failed, since this launcher (or its config) started."""

    def _make(self) -> ManagedProcess:
        devices = self.placement.trainer_devices(self.cfg)
        extra = {TRAINER_DEVICES_ENV: ",".join(devices), **self.placement.for_trainer(self.cfg, devices)}
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
            self.placement.preloader_for(self.cfg, devices),
        )

    def start(self) -> None:
        self.checkpoint_at_start = self._checkpoint_step()
        self.process.start()
        self.started_once = True
        log.info("started trainer pid %d on %s", self.process.pid, ",".join(self.process.devices))

    def _note_checkpoint_at_start(self) -> None:
        """A trainer that writes a checkpoint past this one made progress: its crash count starts again."""
        self.checkpoint_at_start = self._checkpoint_step()

    def _checkpoint_step(self) -> int:
        """The step of the run's latest checkpoint (-1: none)."""
        pointer = read_json(self.run.checkpoints / "latest.json") or {}
        step = pointer.get("step")
        return step if isinstance(step, int) else -1

    def _final_state(self) -> TrainerStatus:
        """trainer.json, if this incarnation wrote it (under torchrun its pid is rank 0's, so compare times); else
        an empty record."""
        status = TrainerStatus.read(self.run.trainer_status)
        if status.pid == self.process.pid or status.updated >= self.process.status_since:
            return status
        return TrainerStatus()

    # -- its health

    def check(self) -> int | None:
        """Restart the trainer when due, and act on its exit; the run's exit code where it must stop (0: training
        finished)."""
        trainer = self.process
        if not self.started_once:
            return None
        if trainer.proc is None:
            trainer.restart_if_due(before=self._note_checkpoint_at_start)
            return None
        returncode = trainer.poll()
        if returncode is None:
            return None
        status = self._final_state()
        trainer.clear()
        if returncode == 0 and status.state == "finished":
            log.info("training finished at step %s: stopping the producers", status.step)
            return 0
        ran_out = OutOfMemory.since(self.run, trainer.status_since)
        if ran_out:  # whatever the exit code: under torchrun the group exits 1
            return self._after_out_of_memory(ran_out, returncode)
        if status.state == "stopped" and returncode != EXIT_CONFIG_ERROR:
            # Stopped from outside (SIGTERM to its pid): it checkpointed; replace it at once. Any exit
            # code: torchrun reports the SIGTERM it forwarded to its ranks as exit 1.
            log.info(
                "trainer stopped with a checkpoint at step %s without being asked: starting a new one", status.step
            )
            trainer.restart_at = time.monotonic()
            trainer.restarts += 1
            return None
        if returncode == EXIT_CONFIG_ERROR:
            log.error(
                "trainer: configuration error (exit 2); stopping the run. See %s%s",
                trainer.log_path,
                log_tail(trainer.log_path),
            )
            return EXIT_CONFIG_ERROR
        # A trainer killed again and again that checkpoints in between is no crash loop (e.g. a
        # flaky node, preemptions): it resumes further on each time.
        return self._after_crash(returncode, made_progress=self._checkpoint_step() > self.checkpoint_at_start)

    def _after_crash(self, returncode: int, made_progress: bool) -> int | None:
        """Schedule the trainer's restart, or give up on the run."""
        launch = self.cfg.launch
        restarts = self.process.after_crash(returncode, launch.restart_backoff_s, launch.max_restarts, made_progress)
        return None if restarts else GAVE_UP

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
                self.process.log_path,
                OUT_OF_MEMORY_LOG,
                log_tail(self.process.log_path),
            )
            return EXIT_CONFIG_ERROR
        log.warning(
            "trainer: out of memory at step %d (%s); restarted once, as it may not repeat: a second one at step %d "
            "stops the run",
            step,
            memory_seen(records),
            step,
        )
        return self._after_crash(returncode, made_progress=False)

    # -- the standby trainer

    def keep_standby(self) -> None:
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
            or self.process.proc is None
            or len(self.process.devices) > 1
            or after < 0
            or self.process.uptime_s < after
            or os.environ.get(TRAINER_CMD_ENV, "").strip()
        ):
            return
        status = self._final_state()  # this trainer's own status: it has trained, so its start is over
        if not status.step or status.state != "training":
            return
        spare = self._make()
        spare.name = "standby trainer"  # in the launcher's log; its output goes to trainer.log, which it takes over
        spare.command = [*spare.command, "--standby"]
        spare.start()
        self.spare = spare
        log.info("started a standby trainer pid %d (it takes over at the next restart-trainer)", spare.pid)

    # -- restart-trainer

    def restart(self, request: RestartRequest, producers_cfg: RunConfig) -> RestartResult:
        """Apply a restart-trainer request: validate it against the config the producers run with, save
        config.toml, replace the trainer; the answer to the command."""
        overrides = [str(o) for o in request.overrides]
        try:
            new_cfg = load_config(self.run.config, overrides)
        except ConfigError as exc:
            return _refused(request, str(exc))
        changed = changed_keys(self.cfg, new_cfg)
        refusals = refused_trainer_changes(changed, producers_cfg, new_cfg)
        if refusals:
            return _refused(request, "; ".join(refusals) + ". Stop the run and resume it with the new value instead.")
        save_config(new_cfg, self.run.config)
        self.cfg = new_cfg
        self.out_of_memory.clear()  # a step that ran out of memory may fit the new config
        log.info("restart-trainer: %s", ", ".join(overrides) if changed else "no config change")
        self._replace()
        return RestartResult(request.request_id, True, None, self.process.pid, changed)

    def _replace(self) -> None:
        """Stop the running trainer, if any, and put a successor (or the standby trainer) in its place."""
        old = self.process if self.process.proc is not None else None
        successor = self._make()  # devices may have changed
        if old is not None:
            self._ask_to_hand_over(old, successor)
        successor.restarts = old_restarts = (old or self.process).restarts
        if self.started_once:
            successor.restarts = old_restarts + 1
            # The successor waits for the old one's handover (its checkpoint, leases and status done) before
            # it reads the checkpoint (trainer.train.wait_for_predecessor); meanwhile it imports, or it did
            # already, as the spare started ahead.
            predecessor = f"{old.pid}:{old.start_ticks}" if old is not None else None
            self._start_successor(successor, predecessor)
        else:
            self.process = successor
        if old is not None:
            handover_request = self.run.handover_request(old.pid)  # named before the exit, which forgets the pid
            old.await_exit(TRAINER_STOP_TIMEOUT_S, self.while_waiting)
            handover_request.unlink(missing_ok=True)  # unread if it died first
            self.checkpoint_at_start = self._checkpoint_step()  # the old one's final checkpoint counts as before
            self.process.status_since = time.time()  # trainer.json was the old one's until now

    def _ask_to_hand_over(self, old: ManagedProcess, successor: ManagedProcess) -> None:
        """One process to one process: the old trainer hands its state over in shared memory (trainer/handover.py)
        and its successor writes the checkpoint; a torchrun group on either side checkpoints to disk first. The word
        is a file, read once the step in flight is done: unlike a signal it needs no handler to be installed in time
        and is not lost while the process is busy."""
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

    def _start_successor(self, successor: ManagedProcess, predecessor: str | None) -> None:
        """The standby trainer takes over where one waits on the successor's devices; else ``successor`` starts."""
        spare, self.spare = self.spare, None
        if spare is not None and spare.proc is not None and spare.poll() is None and spare.devices == successor.devices:
            StandbyGo(predecessor).write(self.run.standby_go(spare.pid))
            spare.command = successor.command  # a crash restart of it is an ordinary trainer start
            spare.name = successor.name
            spare.restarts = successor.restarts
            self.process = spare
            self.checkpoint_at_start = self._checkpoint_step()
            log.info("trainer pid %d, started ahead, takes over", spare.pid)
            return
        if spare is not None:
            spare.stop(STANDBY_STOP_TIMEOUT_S, self.while_waiting)
        if predecessor:
            successor.env = {**successor.env, PREDECESSOR_ENV: predecessor}
        self.process = successor
        self.start()

    # -- the run's end

    def stop(self) -> None:
        """Stop the standby trainer, then the trainer (up to TRAINER_STOP_TIMEOUT_S for its checkpoint)."""
        if self.spare is not None and self.spare.proc is not None:
            self.spare.stop(STANDBY_STOP_TIMEOUT_S, self.while_waiting)
            self.spare = None
        if self.process.proc is not None:
            log.info(
                "stopping trainer pid %d (waiting up to %.0f s for its checkpoint)",
                self.process.pid,
                TRAINER_STOP_TIMEOUT_S,
            )
            self.process.stop(TRAINER_STOP_TIMEOUT_S, self.while_waiting)

    def record(self) -> ChildRecord:
        return self.process.record(devices=self.process.devices)

    def standby_record(self) -> ChildRecord | None:
        return self.spare.record() if self.spare is not None and self.spare.proc is not None else None


def _refused(request: RestartRequest, error: str) -> RestartResult:
    log.error("restart-trainer refused: %s", error)
    return RestartResult(request.request_id, False, error, None, [])


def memory_seen(records: list[OutOfMemory]) -> str:
    """The largest peak memory of ``records`` and its device's memory, in words."""
    return max(records, key=lambda r: r.peak_reserved or r.peak_allocated or 0).seen()

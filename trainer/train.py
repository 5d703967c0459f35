"""The trainer process: the drafter's training loop, fed by the producers' rings.

    python -m trainer.train --run-dir DIR                       # standalone
    torchrun --nproc-per-node N -m trainer.train --run-dir DIR  # DDP (or FSDP), one rank per GPU

Read top to bottom: ``Trainer.__init__`` builds its components (each in a module of its own: the batches' source,
the drafter, the optimizer, the checkpoints, the metrics, the handover) and resumes the latest checkpoint; ``run``
is the loop: take a batch the ranks agree on, one optimizer step, the ledger line, metrics every ``log_every``
steps, a checkpoint every ``checkpoint_every`` steps and at the end. SIGTERM or Ctrl-C: the step in flight
finishes, a checkpoint is written (or, for restart-trainer, the state handed over), the leases are given back
(BYE) and the process exits 0 (trainer/exits.py), leaving the producers' rings full for the next trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import time
from functools import partial
from pathlib import Path

import torch

from common import faults
from common.config import ConfigError, RunConfig
from common.drafter.base import Drafter
from common.lifecycle import exit_process
from common.rundir import CheckpointError, RunDir
from common.status import TrainerStatus
from trainer.acceptance import AcceptanceClient
from trainer.budget import TimeBudget
from trainer.build import DrafterStart, StartClock, WarmStart, fitting_warm_start, start_drafter
from trainer.checkpoint import CheckpointWriter
from trainer.exits import run_to_exit
from trainer.feeder import Commits, Received
from trainer.handover import Handover
from trainer.metrics import Metrics, StatusFile, StepFlops
from trainer.optim import Optimization
from trainer.profile import StepProfiler
from trainer.ranks import Ranks
from trainer.sharding import full_model_state, parallelize
from trainer.source import Batches, BatchSource, RingSource, SourceFactory, epoch_batches, wait_until
from trainer.takeover import start_as_standby, wait_for_predecessor

log = logging.getLogger(__name__)
EVAL_RESULT_WAIT_S = 300.0  # how long a finished trainer waits for the evaluation of its last step


class Trainer:
    """The drafter's training loop over the batches of its source (the producers' rings)."""

    ranks: Ranks  # this process among the trainer's ranks: its device, the bookkeeping's collectives
    source: BatchSource  # where batches come from and evaluations run (trainer/source.py)
    drafter: Drafter  # the drafter being trained (trainer/build.py); ``model`` is it as DDP or FSDP runs it
    optim: Optimization  # the optimizer, its schedule and the RNGs (trainer/optim.py)
    budget: TimeBudget  # training.max_minutes' clock (trainer/budget.py)
    batches: Batches  # each step's batch, agreed between the ranks and recorded as trained (trainer/source.py)
    checkpoints: CheckpointWriter  # checkpoints, written in the background (trainer/checkpoint.py)
    metrics: Metrics  # the log window, metrics.jsonl and wandb (trainer/metrics.py)
    status: StatusFile  # rank 0's trainer.json (trainer/metrics.py)
    handover: Handover  # restart-trainer's handover of the final state to a successor (trainer/handover.py)
    evals: AcceptanceClient  # the acceptance evaluations asked for (trainer/acceptance.py, or the source's alike)
    profiler: StepProfiler  # logging.profile_steps of the run's steps under torch.profiler (trainer/profile.py)

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir,
        source: SourceFactory = RingSource,
        handed_over: dict | None = None,
        warm: WarmStart | None = None,
    ) -> None:
        """``source``: builds where the batches come from and where evaluations run (the coupled baseline's runs the
        target in this process). ``handed_over``: the ``state`` of the predecessor's handover mark, if it left
        one. ``warm``: the head and drafter built ahead of this start (trainer/warm.py)."""
        self.cfg, self.run_dir = cfg, run_dir
        self.ranks = Ranks.join(cfg)
        self.rank, self.world_size, self.device = self.ranks.rank, self.ranks.world_size, self.ranks.device
        self.stop_requested = False
        self.wait_for = partial(wait_until, timeout_s=cfg.launch.ready_timeout_s, stop=lambda: self.stop_requested)
        self.state = "taking over" if handed_over else "starting"
        self.incarnation = self.ranks.broadcast(time.time_ns() // 1000)  # producers drop older incarnations' leases
        if self.rank == 0:  # status and progress show the start (or the handover) before anything is built
            TrainerStatus.starting(os.getpid(), self.incarnation, self.state).write(run_dir.trainer_status)
        self.source = source(cfg, run_dir, self.ranks)
        clock = StartClock()
        start = self._start_drafter(handed_over, warm, clock)
        self._start_training_state(start)
        clock.lap("optimizer")
        self.metrics = Metrics(cfg, run_dir, self.rank, self.drafter.logged_metrics, self.wandb_id)
        clock.lap("wandb")
        self._start_batches_and_checkpoints(start)
        clock.lap("the rest")
        log.info(
            f"trainer rank {self.rank}/{self.world_size} ({self.ranks.parallelism}) on {self.device}, incarnation "
            f"{self.incarnation}, {start.origin} at step {self.step} of {self.max_steps}; "
            f"{self.status.sharding(self.rank)}; built in {clock}"
            + (f" (warm start: {warm.seconds:.1f} s ahead)" if start.warmed else "")
        )

    def _start_drafter(self, handed_over: dict | None, warm: WarmStart | None, clock: StartClock) -> DrafterStart:
        """The drafter, sharing the target's frozen embedding, final norm and lm_head (trainer/build.py)."""
        warm = fitting_warm_start(warm, self.cfg, self.ranks, self.source.takes_warm_start)
        start = start_drafter(self.cfg, self.run_dir, self.ranks, handed_over, warm, self.wait_for, clock.lap)
        self.drafter, self.draft_config, self.compiled = start.drafter, start.draft_config, start.compiled
        self.model = parallelize(self.drafter, self.device, self.world_size, self.ranks.sharded)
        self.status = StatusFile(self.run_dir, self.incarnation, self.cfg, self.ranks, self.drafter)
        return start

    def _start_training_state(self, start: DrafterStart) -> None:
        """The optimizer, the schedule, the RNGs and the bookkeeping: fresh, or those of the state resumed."""
        meta = start.resumed.meta if start.resumed else {}  # the trainer_state.json resumed
        self.max_steps = self.cfg.training.max_steps or self._steps_from_epochs()
        self.budget = TimeBudget(self.cfg.training.max_minutes, meta.get("trained_s", 0.0))
        self.optim = Optimization(self.cfg, self.drafter, self.ranks, self.max_steps, self.budget)
        self.optimizer, self.scheduler = self.optim.optimizer, self.optim.scheduler
        self.step = self.start_step = int(meta.get("step", 0))
        self.commits = Commits.from_checkpoint(meta["committed"]) if meta else Commits()
        self.wandb_id = meta.get("wandb_id")
        if meta:
            self.optim.load_state_dict(start.train_state_to_load(self.device), meta["step"])

    def _start_batches_and_checkpoints(self, start: DrafterStart) -> None:
        """Where batches come from, checkpoints go and evaluations are asked for."""
        cfg = self.cfg.training
        pad_to = self.cfg.batching.token_budget if self.compiled else None
        feeder = self.source.feeder(self.incarnation, start.expect, self.commits, pad_to)
        self.batches = Batches(feeder, self.ranks, self.commits, self.run_dir.ledger, stop=lambda: self.stop_requested)
        self.checkpoints = CheckpointWriter(self.run_dir, cfg.keep_last, start.staging, cfg.async_checkpoint)
        self.handover = Handover(self.run_dir, self.checkpoints, single_process=self.world_size == 1)
        if start.handed is not None:
            self.checkpoints.write_handed_over(self.drafter, start.handed)
        self.evals = self.source.evaluations(
            self.incarnation, self.draft_config.block_size, self.metrics.file, self.metrics.wandb
        )
        if self.rank == 0:
            self.evals.adopt(self.step)
        self.flops = StepFlops(self.draft_config, self.cfg.drafter.num_anchors)
        logging_cfg = self.cfg.logging
        self.profiler = StepProfiler(
            logging_cfg.profile_steps,
            self.step + logging_cfg.profile_after,  # this trainer's steps: a resumed one compiles again
            self.run_dir.logs / "trainer-profile.txt",
            self.device,
            enabled=self.rank == 0,
        )

    def _steps_from_epochs(self) -> int:
        """training.epochs in optimizer steps: each producer counts its shard's batches into its status file."""
        if self.cfg.launch.remote_producers:  # those of remote producers are on their hosts
            raise ConfigError(
                "training.max_steps: must be > 0 with launch.remote_producers (the epoch size of a "
                "remote producer's shard is not known here); set the number of optimizer steps"
            )
        per_epoch = epoch_batches(self.run_dir, self.cfg.launch.local_producers, self.wait_for)
        return max(1, math.ceil(self.cfg.training.epochs * per_epoch / self.world_size))

    @property
    def done(self) -> bool:
        """The run's last step is trained: ``max_steps`` of them, or the time budget spent."""
        return self.step >= self.max_steps or self.budget.spent

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> str:
        self.batches.feeder.start()
        self._show("training")
        self.metrics.new_window()
        while not self.done:
            self.profiler.step_starts(self.step)  # the whole iteration: its wait for a batch, its bookkeeping
            # A stop is agreed in the claim, not read here: a rank that left on its own flag would wait in the
            # checkpoint's barrier while the others wait in this step's agreement.
            received, starved, everyone = self.batches.claim()
            if received is None:  # a rank was asked to stop: every rank stops after the same step
                break
            faults.point("trainer.batch", stop=lambda: self.stop_requested)  # a test's hold ends on a stop
            started = time.perf_counter()
            metrics = self.train_step(received)
            self.step += 1
            self.budget.tick(self.ranks.broadcast)
            self.batches.record(self.step, self.incarnation, everyone)
            flops = self.flops(received, metrics)
            self.metrics.window.add(received, metrics, starved, time.perf_counter() - started, flops)
            self.after_step()
            self.profiler.step_ended(self.step, last=self.done or self.stop_requested)
        finished = self.done
        if not finished and self.handover.requested():  # restart-trainer: a successor waits for the state
            self._show("handing over")
            self.handover.stage(self)
        else:
            self.save_checkpoint(blocking=True)  # always on the last step, and on a requested stop
        if finished and self.evals.in_flight:
            self._show("final evaluation")  # the progress line says what the run waits for
            self.collect_evaluations(wait_s=EVAL_RESULT_WAIT_S)  # the last step's evaluation, while the producers run
        self.state = "finished" if finished else "stopped"
        return self.state

    def train_step(self, received: Received) -> dict[str, torch.Tensor]:
        """Forward, backward, clip, optimizer and scheduler step; metrics stay on the device."""
        self.model.train()
        num_anchors, generator = self.cfg.drafter.num_anchors, self.optim.generator
        progress = max(self.step / max(1, self.max_steps), self.budget.fraction)
        with self.ranks.autocast():
            loss, metrics = self.model(received.batch, num_anchors, generator, progress, received.prepared)
        loss.backward()
        faults.point("trainer.step")
        # The next batch's anchors and masks while the GPU still runs this backward: off the critical path.
        self.batches.prepare_upcoming(lambda batch: self.drafter.prepare(batch, num_anchors, generator))
        metrics["grad_norm"] = self.optim.step(clip=self.cfg.training.grad_clip or float("inf"))
        return metrics

    def after_step(self) -> None:
        """What a step's end may bring: evaluations' results, the log line, an evaluation asked, a checkpoint."""
        if self.evals.in_flight and self.step % max(1, self.cfg.logging.log_every // 4) == 0:
            self.collect_evaluations()
        if self.step % self.cfg.logging.log_every == 0 or self.done:
            self.log_metrics()
            if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                self.evaluate()  # before the window restarts, so the evaluation stays out of tokens/s
            self.metrics.new_window()
        self.checkpoints.raise_failure()  # a background write that failed stops the run now (only rank 0 writes)
        if self.step % self.cfg.training.checkpoint_every == 0 and not self.done:
            self.metrics.window.checkpoint_s += self.save_checkpoint()

    def state_dict(self, optimizer_state: dict | None) -> dict:
        """A checkpoint's train_state/: ``optimizer_state`` (of the whole drafter), the schedule and the RNGs."""
        return self.optim.state_dict(optimizer_state)

    def checkpoint_meta(self) -> dict:
        """trainer_state.json: the step and the batches it committed."""
        return {
            "step": self.step,
            "max_steps": self.max_steps,
            "trained_s": self.budget.seconds,
            "incarnation": self.incarnation,
            "committed": self.commits.trained_state(),
            "wandb_id": self.metrics.wandb_id,
            "lr": self.cfg.training.lr,
        }

    def save_checkpoint(self, blocking: bool = False) -> float:
        """Checkpoint checkpoints/step-N (trainer/checkpoint.py ``CheckpointWriter.save``), in the background unless
        ``blocking`` or ``training.async_checkpoint`` is off; the seconds training stood still for it."""
        return self.checkpoints.save(self, self.ranks, blocking, self._show)

    def evaluate(self) -> None:
        """Ask producer 0 to evaluate this step's weights and go on training (trainer/acceptance.py)."""
        weights = full_model_state(self.drafter) if self.ranks.sharded else None  # every rank helps gather them
        if self.rank == 0:
            self.evals.ask(self.step, self.drafter, weights, final=self.done)
            self.write_status()

    def collect_evaluations(self, wait_s: float = 0.0) -> None:
        """Log the results of the evaluations asked for that have come back (waiting up to ``wait_s`` for all)."""
        if self.rank == 0 and self.evals.collect(self.step, wait_s, stop=lambda: self.stop_requested):
            self.write_status()  # called every few steps while one is out: the status changes only when a result comes

    def log_metrics(self) -> None:
        """The window's record: a line of metrics.jsonl, a wandb step, the status file and a line of trainer.log."""
        if self.rank == 0:
            producers = self.batches.feeder.producer_stats()
            record = self.metrics.log_window(self.step, self.optim.lr, self.device, producers)
            self.write_status()
            print(f"step {self.step}/{self.max_steps}{self.budget.line()}{self.metrics.line(record)}", flush=True)

    def _show(self, state: str) -> None:
        self.state = state
        self.write_status()

    def write_status(self) -> None:
        """Rank 0's trainer.json (every step while an evaluation is out)."""
        if self.rank == 0:
            parts = {**self.metrics.status(), **self.evals.status(), **self.checkpoints.status()}
            self.status.write(self.state, self.step, self.start_step, self.max_steps, self.budget.seconds, **parts)

    def close(self) -> None:
        self.evals.close()
        with contextlib.suppress(CheckpointError):  # logged by the writer; the previous checkpoint stays the latest
            self.checkpoints.wait()  # a background write finishes, whatever ends the trainer
        self.batches.close()
        self.write_status()
        self.metrics.close()
        self.ranks.close()
        if self.world_size == 1:  # the last word: a torchrun group's successor waits for its exit instead
            self.handover.leave(self.step)


def run_trainer(run_dir: str | Path, source: SourceFactory = RingSource, warm_start: WarmStart | None = None) -> int:
    """The trainer process's run, to its exit code (trainer/exits.py)."""
    pending = [warm_start]
    del warm_start  # the start pops it: what the trainer does not take is freed

    def start(root: RunDir, cfg: RunConfig) -> Trainer:
        mark, warm = wait_for_predecessor(root, pending.pop())
        return Trainer(cfg, root, source, handed_over=mark.state if mark else None, warm=warm)

    return run_to_exit(run_dir, start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DFlash trainer: trains the drafter from the producers' rings.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--standby", action="store_true", help="started ahead by the launcher (restart-trainer)")
    args = parser.parse_args(argv)
    role = f"trainer-r{os.environ.get('RANK', 0)}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    return run_trainer(args.run_dir, warm_start=start_as_standby(RunDir(args.run_dir), role) if args.standby else None)


if __name__ == "__main__":
    exit_process(main())

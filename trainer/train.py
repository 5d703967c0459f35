"""The trainer process: the drafter's training loop, fed by the producers' rings.

    python -m trainer.train --run-dir DIR                       # standalone
    torchrun --nproc-per-node N -m trainer.train --run-dir DIR  # DDP (or FSDP), one rank per GPU

Read top to bottom: ``Trainer.__init__`` builds its components (each in a module of its own: the batches'
source, the drafter, the optimizer, the checkpoints, the metrics, the handover) and resumes the latest
checkpoint; ``run`` is the loop: take a batch the ranks agree on, one optimizer step, the ledger line, metrics
every ``log_every`` steps, a checkpoint every ``checkpoint_every`` steps and at the end. SIGTERM or Ctrl-C: the
step in flight finishes, a checkpoint is written (or, for restart-trainer, the state handed over), the leases
are given back (BYE) and the process exits 0, leaving the producers' rings full for the next trainer.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from common import faults
from common.config import ConfigError, RunConfig
from common.drafter.base import Drafter
from common.lifecycle import EXIT_CONFIG_ERROR, die_with_parent, exit_process, start_role, stop_on_signals
from common.rundir import CheckpointError, RunDir
from common.status import ProducerStatus, TrainerStatus
from trainer import build
from trainer.budget import TimeBudget
from trainer.build import WarmStart
from trainer.checkpoint import CheckpointWriter, Snapshot
from trainer.feeder import Commits, Received
from trainer.handover import Handover
from trainer.metrics import Metrics, StepFlops, producer_metrics
from trainer.oom import out_of_memory
from trainer.optim import Optimization
from trainer.ranks import Ranks
from trainer.sharding import full_model_state, local_parameter_count, parallelize
from trainer.source import Batches, BatchSource, RingSource, SourceFactory
from trainer.takeover import wait_for_predecessor, wait_for_takeover

log = logging.getLogger(__name__)
EVAL_RESULT_WAIT_S = 300.0  # how long a finished trainer waits for the evaluation of its last step


class Trainer:
    """The drafter's training loop over the batches of its source (the producers' rings)."""

    ranks: Ranks
    """This process among the trainer's ranks: its device, and the collectives of the bookkeeping."""
    source: BatchSource
    """Where batches come from and evaluations run (trainer/source.py)."""
    drafter: Drafter
    """The drafter being trained (trainer/build.py builds it); ``model`` is it as DDP or FSDP runs it."""
    model: nn.Module
    optim: Optimization
    """The optimizer, its schedule and the RNGs (trainer/optim.py)."""
    batches: Batches
    """Each step's batch, agreed between the ranks and recorded as trained (trainer/source.py)."""
    checkpoints: CheckpointWriter
    """Checkpoints written in the background (trainer/checkpoint.py)."""
    metrics: Metrics
    """The log window, metrics.jsonl and wandb (trainer/metrics.py)."""
    handover: Handover
    """restart-trainer's handover of the final state to a successor (trainer/handover.py)."""
    evals: Any
    """The acceptance evaluations asked for (trainer/acceptance.py)."""

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
        self.state = "taking over" if handed_over else "starting"
        # The incarnation orders trainer lifetimes: producers drop leases of older ones.
        self.incarnation = self.ranks.broadcast(time.time_ns() // 1000)
        if self.rank == 0:  # status and progress show the start (or the handover) before anything is built
            TrainerStatus.starting(os.getpid(), self.incarnation, self.state).write(run_dir.trainer_status)
        self.source = source(cfg, run_dir, self.ranks)
        clock = build.StartClock()
        start = self._start_drafter(handed_over, warm, clock)
        self._start_training_state(start)
        clock.lap("optimizer")
        self.metrics = Metrics(cfg, run_dir, self.rank, self.drafter.logged_metrics, self.wandb_id)
        clock.lap("wandb")
        self._start_batches_and_checkpoints(start)
        clock.lap("the rest")
        log.info(
            "trainer rank %d/%d (%s) on %s, incarnation %d, %s at step %d of %d; drafter %.1fM parameters, "
            "%.0f%% of them on this rank; built in %s%s",
            self.rank,
            self.world_size,
            self.ranks.parallelism,
            self.device,
            self.incarnation,
            start.origin,
            self.step,
            self.max_steps,
            self.drafter_params_total / 1e6,
            100 * self.drafter_params_per_rank[self.rank] / self.drafter_params_total,
            clock,
            f" (warm start: {warm.seconds:.1f} s ahead)" if start.warmed else "",
        )

    def _start_drafter(self, handed_over: dict | None, warm: WarmStart | None, clock: build.StartClock):
        """The drafter, sharing the target's frozen embedding, final norm and lm_head (trainer/build.py)."""
        if warm is not None and not (
            self.world_size == 1 and self.source.takes_warm_start and warm.fits(self.cfg, self.device)
        ):
            log.info("the warm start does not fit the configuration of this start; building anew")
            warm = None
        start = build.start_drafter(self.cfg, self.run_dir, self.ranks, handed_over, warm, self._wait_for, clock.lap)
        self.drafter, self.draft_config, self.compiled = start.drafter, start.draft_config, start.compiled
        self.model = parallelize(self.drafter, self.device, self.world_size, self.ranks.sharded)
        # How much of the drafter each rank holds, for the status file (shows the sharding).
        self.drafter_params_total = self.drafter.num_trainable_parameters()
        self.drafter_params_per_rank = self.ranks.gather(local_parameter_count(self.drafter))
        cuda = self.device.type == "cuda"
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
        return start

    def _start_training_state(self, start: build.DrafterStart) -> None:
        """The optimizer, the schedule, the RNGs and the bookkeeping: fresh, or those of the state resumed."""
        cfg, resumed = self.cfg, start.resumed
        self.max_steps = cfg.training.max_steps or self._steps_from_epochs()
        if cfg.training.optimizer_fallback and self.rank == 0:
            log.warning(cfg.training.optimizer_fallback)
        self.budget = TimeBudget(cfg.training.max_minutes, resumed.meta.get("trained_s", 0.0) if resumed else 0.0)
        self.optim = Optimization(cfg, self.drafter, self.ranks, self.max_steps, self.budget)
        self.step, self.commits, self.wandb_id = 0, Commits(), None
        if resumed is not None:
            # On a GPU the optimizer copies its state to the device; on the CPU it would keep a handed-over
            # state's shared pages as its own and change them under the background write of their checkpoint.
            train_state = (
                resumed.train_state
                if self.device.type == "cuda" or resumed is not start.handed
                else tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, resumed.train_state)
            )
            self.optim.load_state_dict(train_state, resumed.meta["step"])
            self.step = int(resumed.meta["step"])
            self.commits = Commits.from_checkpoint(resumed.meta["committed"])
            self.wandb_id = resumed.meta.get("wandb_id")
        self.start_step = self.step

    def _start_batches_and_checkpoints(self, start: build.DrafterStart) -> None:
        """Where batches come from, checkpoints go and evaluations are asked for."""
        pad_to = self.cfg.batching.token_budget if self.compiled else None
        feeder = self.source.feeder(self.incarnation, start.expect, self.commits, pad_to)
        ledger = open(self.run_dir.ledger, "a") if self.rank == 0 else None
        self.batches = Batches(feeder, self.ranks, self.commits, ledger, stop=lambda: self.stop_requested)
        self.checkpoints = CheckpointWriter(self.run_dir, self.cfg.training.keep_last, start.staging)
        self.handover = Handover(self.run_dir, self.checkpoints, single_process=self.world_size == 1)
        if (handed := start.handed) is not None:  # its disk checkpoint, from its pages, while training goes on
            self.checkpoints.write(
                Snapshot(f"step-{self.step:08d}", self.drafter, handed.weights, handed.train_state, handed.meta),
                background=True,
            )
        self.evals = self.source.evaluations(
            self.incarnation, self.draft_config.block_size, self.metrics.file, self.metrics.wandb
        )
        if self.rank == 0:
            self.evals.adopt(self.step)
        self.flops = StepFlops(self.draft_config, self.cfg.drafter.num_anchors)

    def _steps_from_epochs(self) -> int:
        if self.cfg.launch.remote_producers:
            # Each producer counts its shard's batches into its status file, and those of remote
            # producers are on their hosts.
            raise ConfigError(
                "training.max_steps: must be > 0 with launch.remote_producers (the epoch size of a "
                "remote producer's shard is not known here); set the number of optimizer steps"
            )
        expected = self.cfg.launch.local_producers
        self._wait_for(
            lambda: len([s for s in ProducerStatus.read_all(self.run_dir) if s.epoch_batches is not None]) >= expected,
            "the producers' epoch sizes",
        )
        per_epoch = sum(s.epoch_batches or 0 for s in ProducerStatus.read_all(self.run_dir))
        return max(1, math.ceil(self.cfg.training.epochs * per_epoch / self.world_size))

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.launch.ready_timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what} after {self.cfg.launch.ready_timeout_s:.0f}s")
            if self.stop_requested:
                raise KeyboardInterrupt
            time.sleep(0.2)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optim.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self.optim.scheduler

    @property
    def done(self) -> bool:
        """The run's last step is trained: ``max_steps`` of them, or the time budget spent."""
        return self.step >= self.max_steps or self.budget.spent

    def _agree(self, seconds: float) -> float:
        """Rank 0's clock reading on every rank (only a budget reads it, so only then a collective)."""
        return self.ranks.broadcast(seconds) if self.budget.minutes else seconds

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> str:
        self.batches.feeder.start()
        self.state = "training"
        self.write_status()
        self.metrics.new_window()
        while not self.done and not self.stop_requested:
            received, starved, everyone = self.batches.claim()
            if received is None:
                break
            faults.point("trainer.batch", stop=lambda: self.stop_requested)  # a test's hold ends on a stop
            started = time.perf_counter()
            metrics = self.train_step(received)
            self.step += 1
            self.budget.tick(self._agree)
            self.batches.record(self.step, self.incarnation, everyone)
            flops = self.flops(received, metrics)
            self.metrics.window.add(received, metrics, starved, time.perf_counter() - started, flops)
            self.after_step()
        finished = self.done
        if not finished and self.handover.requested():  # restart-trainer: a successor waits
            self.hand_over()
        else:
            self.save_checkpoint(blocking=True)  # always on the last step, and on a requested stop
        if finished:
            self.collect_evaluations(wait_s=EVAL_RESULT_WAIT_S)  # the last step's evaluation, while the producers run
        self.state = "finished" if finished else "stopped"
        return self.state

    def train_step(self, received: Received) -> dict[str, torch.Tensor]:
        """Forward, backward, clip, optimizer and scheduler step; metrics stay on the device."""
        self.model.train()
        num_anchors, generator = self.cfg.drafter.num_anchors, self.optim.generator
        progress = max(self.step / max(1, self.max_steps), self.budget.fraction)
        with self.autocast:
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
        if self.rank == 0:
            self.checkpoints.raise_failure()  # a background write that failed stops the run now
        if self.step % self.cfg.training.checkpoint_every == 0 and not self.done:
            self.metrics.window.checkpoint_s += self.save_checkpoint()

    # -- checkpoints and the handover ---------------------------------------------------------------

    def state_dict(self, optimizer_state: dict | None) -> dict:
        """The train state of a checkpoint (its train_state/): ``optimizer_state`` (of the whole drafter), the
        schedule and the RNGs."""
        return self.optim.state_dict(optimizer_state)

    def _checkpoint_meta(self) -> dict:
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
        """Checkpoint checkpoints/step-N (trainer/checkpoint.py). Training stands still only while the state is
        copied to the host; the write runs in the background unless ``blocking`` or ``training.async_checkpoint``
        is off. A write that fails raises CheckpointError (here, or at a later step) and leaves the previous
        checkpoint and latest.json untouched. Returns the seconds training stood still for it (waiting for the
        previous write included)."""
        started = time.perf_counter()
        if self.rank == 0:
            self.checkpoints.wait()  # one write at a time; its host buffers are then free again
            self.state = "checkpointing"
            self.write_status()
        # Into host buffers reused between checkpoints. Under FSDP every rank joins the gathers of the sharded
        # tensors and rank 0 keeps the whole state (the same checkpoint as an unsharded trainer's); under DDP
        # rank 0 holds it all already.
        staging, keep = self.checkpoints.staging, self.rank == 0
        weights = optimizer_state = None
        if keep or self.ranks.sharded:
            weights = staging.copy(self.drafter.state_dict(), "drafter", keep)
            optimizer_state = staging.copy(self.optimizer.state_dict(), "optimizer", keep)
        if self.rank == 0:
            train_state, meta = self.state_dict(optimizer_state), self._checkpoint_meta()
            stall_s = time.perf_counter() - started
            snapshot = Snapshot(f"step-{self.step:08d}", self.drafter, weights, train_state, meta, stall_s=stall_s)
            self.checkpoints.write(snapshot, background=self.cfg.training.async_checkpoint and not blocking)
            # Written now, not at the next log_every: the launcher starts a standby only on "training".
            self.state = "training"
            self.write_status()
        if self.world_size > 1:
            dist.barrier()
        return time.perf_counter() - started

    def hand_over(self) -> None:
        """restart-trainer of a single process: the final state into the shared staging segments instead of a
        disk checkpoint; ``close`` names them in the handover mark and the successor writes the checkpoint."""
        self.state = "handing over"
        self.write_status()
        self.handover.stage(self.drafter, self.draft_config, self.optimizer, self.state_dict, self._checkpoint_meta())

    # -- evaluations, metrics and status ------------------------------------------------------------

    def evaluate(self) -> None:
        """Ask for an acceptance evaluation of this step's weights and go on training (trainer/acceptance.py:
        producer 0 evaluates them between two of its batches). Under FSDP every rank helps gather the weights."""
        weights = full_model_state(self.drafter) if self.ranks.sharded else None
        if self.rank != 0:
            return
        self.evals.ask(self.step, self.drafter, weights)
        self.write_status()

    def collect_evaluations(self, wait_s: float = 0.0) -> None:
        """Log the results of the evaluations asked for that have come back (waiting up to ``wait_s`` for all)."""
        if self.rank != 0:
            return
        if self.evals.collect(self.step, wait_s, stop=lambda: self.stop_requested):
            self.write_status()  # called every few steps while one is out: the status changes only when a result comes

    def log_metrics(self) -> None:
        """The window's record: a line of metrics.jsonl, a wandb step, the status file and a line of trainer.log."""
        if self.rank != 0:
            return
        record = {"step": self.step, "lr": self.optim.lr, **self.metrics.window.summary(), "time": time.time()}
        if self.device.type == "cuda":
            # Since the start: a count that rises means the caching allocator had to free its cache and try again
            # (memory pressure, e.g. from a producer sharing the GPU), which costs a synchronisation each time.
            record["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        record.update(producer_metrics(self.batches.feeder.producer_stats()))
        self.metrics.log(record)
        self.write_status()
        budget = f"  {self.budget.seconds / 60:.1f}/{self.budget.minutes:g} min" if self.budget.minutes else ""
        print(f"step {self.step}/{self.max_steps}{budget}{self.metrics.line(record)}", flush=True)

    def write_status(self) -> None:
        if self.rank != 0:
            return
        TrainerStatus(
            pid=os.getpid(),
            incarnation=self.incarnation,
            state=self.state,
            updated=time.time(),
            step=self.step,
            start_step=self.start_step,
            max_steps=self.max_steps,
            trained_s=self.budget.seconds,
            max_minutes=self.cfg.training.max_minutes,
            kind=self.cfg.drafter.kind,
            **self.metrics.status(),
            **self.evals.status(),
            parallelism=self.ranks.parallelism,
            drafter_params_total=self.drafter_params_total,
            drafter_params_per_rank=self.drafter_params_per_rank,
            last_checkpoint=vars(self.checkpoints.last) if self.checkpoints.last else None,
            checkpoint_writing=self.checkpoints.writing_name,
        ).write(self.run_dir.trainer_status)  # every step while an evaluation is out

    def close(self) -> None:
        self.evals.close()
        try:
            self.checkpoints.wait()  # a background write finishes whatever ends the trainer (unless a handover superseded it)
        except CheckpointError:
            pass  # logged by the writer; the previous checkpoint stays the latest
        self.batches.close()
        self.write_status()
        self.metrics.close()
        if self.world_size > 1:
            dist.destroy_process_group()
        else:  # nothing of the run is touched after this (a torchrun group's successor waits for its exit instead)
            self.handover.leave(self.step)


def run_trainer(run_dir: str | Path, source: SourceFactory = RingSource, warm_start: WarmStart | None = None) -> int:
    try:
        root, cfg = start_role(run_dir)
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    trainer = None

    def request_stop(signum: int) -> None:
        log.info("signal %d: finishing the step, then checkpoint (or hand over, for restart-trainer) and exit", signum)
        if trainer is not None:
            trainer.stop_requested = True
        else:
            raise KeyboardInterrupt

    stop_on_signals(request_stop)
    try:
        mark, warm_start = wait_for_predecessor(root, warm_start)
        trainer = Trainer(cfg, root, source, handed_over=mark.state if mark else None, warm=warm_start)
        del warm_start  # what the trainer did not take is freed
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="DFlash trainer: trains the drafter from the producers' rings.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument(
        "--standby",
        action="store_true",
        help="started ahead by the launcher: import, then wait until told to take over (restart-trainer)",
    )
    args = parser.parse_args(argv)
    role = f"trainer-r{os.environ.get('RANK', 0)}"
    # A standby writes into trainer.log beside the running trainer until it takes over: its lines say so.
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {'standby-' + role if args.standby else role} %(levelname)s %(message)s",
    )
    warm_start = None
    if args.standby:
        die_with_parent()
        warm_start = wait_for_takeover(RunDir(args.run_dir))
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s"))
    return run_trainer(args.run_dir, warm_start=warm_start)


if __name__ == "__main__":
    exit_process(main())

"""The trainer process: the drafter's training loop, fed by the producers' rings.

    python -m trainer.train --run-dir DIR                       # standalone
    torchrun --nproc-per-node N -m trainer.train --run-dir DIR  # DDP (or FSDP), one rank per GPU

Read top to bottom: ``Trainer.__init__`` builds the drafter from the target's frozen head and
resumes the latest checkpoint; ``run`` is the loop: take a staged batch, one optimizer step, the
ledger line, metrics every ``log_every`` steps, a checkpoint every ``checkpoint_every`` steps and at
the end. SIGTERM or Ctrl-C: the step in flight finishes, a checkpoint is written, the leases are
given back (BYE) and the process exits 0, leaving the producers' rings full for the next trainer.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from common import faults
from common.config import ConfigError, RunConfig, load_config
from common.control import PREDECESSOR_ENV, HandoverMark, StandbyGo
from common.drafter.export import zlab_config
from common.drafter.model import train_flops
from common.lifecycle import EXIT_CONFIG_ERROR, die_with_parent, end_now, exit_process, start_role, stop_on_signals
from common.naming import process_start_ticks
from common.rundir import CheckpointError, RunDir
from common.status import ProducerStatus, TrainerStatus
from trainer import build
from trainer.budget import TimeBudget
from trainer.checkpoint import CheckpointWriter, Snapshot
from trainer.feeder import Commits, Received
from trainer.oom import out_of_memory
from trainer.optim import build_optimizer
from trainer.ranks import Ranks, resolve_device
from trainer.sharding import (
    full_model_state,
    full_tensor,
    load_full_optimizer_state,
    local_parameter_count,
    parallelize,
)
from trainer.source import RingSource, SourceFactory
from trainer.wandb_run import run_id_of, start_run
from trainer.warm import WarmStart
from trainer.warm import prepare as prepare_warm_start

log = logging.getLogger(__name__)
EVAL_RESULT_WAIT_S = 300.0  # how long a finished trainer waits for the evaluation of its last step


def lr_lambda(cfg: RunConfig, max_steps: int, budget: TimeBudget | None = None):
    """Linear warmup, then a cosine decay to ``min_lr_ratio`` of the peak, or with ``schedule = "wsd"`` the peak held
    until the last ``decay_ratio`` of the steps and a linear decay to the floor over them. Under a time budget the
    schedule is as far along as the larger of the steps and the clock, so a run the clock ends still decays."""
    warmup = max(1, int(cfg.training.warmup_ratio * max_steps))
    floor = cfg.training.min_lr_ratio
    decay_start = max(warmup, max_steps - int(round(cfg.training.decay_ratio * max_steps)))

    def cosine(step: int) -> float:
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def warmup_stable_decay(step: int) -> float:
        progress = min(1.0, max(0.0, (step - decay_start) / max(1, max_steps - decay_start)))
        return floor + (1 - floor) * (1 - progress)

    after_warmup = warmup_stable_decay if cfg.training.schedule == "wsd" else cosine

    def factor(step: int) -> float:
        if budget is not None:
            step = max(step, int(budget.fraction * max_steps))
        return (step + 1) / warmup if step < warmup else after_warmup(step)

    return factor


class _StartClock:
    """Seconds of each part of a trainer's start, for its first log line."""

    def __init__(self) -> None:
        self.laps: list[tuple[str, float]] = []
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        total = sum(s for _, s in self.laps)
        return f"{total:.1f} s (" + ", ".join(f"{name} {s:.1f}" for name, s in self.laps) + ")"


class Trainer:
    """The drafter's training loop over the batches of its source (the producers' rings)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir,
        source: SourceFactory = RingSource,
        handed_over: dict | None = None,
        warm: WarmStart | None = None,
    ) -> None:
        """``source``: builds where the batches come from and where evaluations run (trainer/source.py; the coupled
        baseline's runs the target in this process). ``handed_over``: the ``state`` of the predecessor's handover
        mark (trainer/handover.py), if it left one. ``warm``: the head and drafter built ahead of this start
        (trainer/warm.py)."""
        self.cfg, self.run_dir = cfg, run_dir
        self.ranks = Ranks.join(cfg)
        self.rank, self.world_size, self.device, self.sharded = (
            self.ranks.rank,
            self.ranks.world_size,
            self.ranks.device,
            self.ranks.sharded,
        )
        self.stop_requested = False
        self.handover_state: dict | None = None
        # The incarnation orders trainer lifetimes: producers drop leases of older ones.
        self.incarnation = self.ranks.broadcast(time.time_ns() // 1000)
        if self.rank == 0:  # status and progress show the start (or the handover) before anything is built
            state = "taking over" if handed_over else "starting"
            TrainerStatus.starting(os.getpid(), self.incarnation, state).write(run_dir.trainer_status)
        self.source = source(cfg, run_dir, self.ranks)

        # -- the drafter, sharing the target's frozen embedding, final norm and lm_head (trainer/build.py) ------
        if warm is not None and not (
            self.world_size == 1 and self.source.takes_warm_start and warm.fits(cfg, self.device)
        ):
            log.info("the warm start does not fit the configuration of this start; building anew")
            warm = None
        clock = _StartClock()
        start = build.start_drafter(cfg, run_dir, self.ranks, handed_over, warm, self._wait_for, clock.lap)
        self.head, self.draft_config, self.loss_config = start.head, start.draft_config, start.loss_config
        self.drafter, self.compiled = start.drafter, start.compiled
        self.model = parallelize(self.drafter, self.device, self.world_size, self.sharded)
        # How much of the drafter each rank holds, for the status file (shows the sharding).
        self.drafter_params_total = self.drafter.num_trainable_parameters()
        self.drafter_params_per_rank = self.ranks.gather(local_parameter_count(self.drafter))
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )

        # -- the optimizer, the schedule and the bookkeeping, resumed with the weights --------------------------
        self.max_steps = cfg.training.max_steps or self._steps_from_epochs()
        self._start_optimizer(start)
        self.start_step = self.step
        clock.lap("optimizer")
        self.wandb = None
        if self.rank == 0 and cfg.logging.wandb_mode != "disabled":
            self.wandb_id = self.wandb_id or run_id_of(run_dir)
            self.wandb = start_run(cfg, run_dir, self.wandb_id)
        clock.lap("wandb")

        # -- where batches come from, checkpoints go and evaluations are asked for ------------------------------
        pad_to = cfg.batching.token_budget if self.compiled else None
        self.feeder = self.source.feeder(self.incarnation, start.expect, self.commits, pad_to)
        self.checkpoints = CheckpointWriter(run_dir, cfg.training.keep_last, start.staging)
        if (handed := start.handed) is not None:  # its disk checkpoint, from its pages, while training goes on
            self.checkpoints.write(
                Snapshot(f"step-{self.step:08d}", self.drafter, handed.weights, handed.train_state, handed.meta),
                background=True,
            )
        self.ledger = open(run_dir.ledger, "a") if self.rank == 0 else None
        self.metrics_file = open(run_dir.metrics, "a") if self.rank == 0 else None
        self.evals = self.source.evaluations(
            self.incarnation, self.draft_config.block_size, self.metrics_file, self.wandb
        )
        if self.rank == 0:
            self.evals.adopt(self.step)
        self.flops_cache: dict[int, float] = {}
        self.flops_per_attention_pair = train_flops(self.draft_config, 0, 0, 1.0)["attention"]
        self._upcoming: Received | None = None
        self.state = "taking over" if handed_over else "starting"
        self.last_record: dict = {}
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

    def _start_optimizer(self, start: build.DrafterStart) -> None:
        """The optimizer, the schedule, the RNGs and the bookkeeping: fresh, or those of the state resumed."""
        cfg, resumed = self.cfg, start.resumed
        if cfg.training.optimizer_fallback and self.rank == 0:
            log.warning(cfg.training.optimizer_fallback)
        self.budget = TimeBudget(cfg.training.max_minutes, resumed.meta.get("trained_s", 0.0) if resumed else 0.0)
        self.optimizer = build_optimizer(
            self.drafter,
            cfg.training.resolved_optimizer,
            cfg.training.lr,
            cfg.training.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.max_steps, self.budget))
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.training.seed * 1000 + self.rank)
        self.step = 0
        self.commits = Commits()
        self.wandb_id = None
        if resumed is not None:
            # On a GPU the optimizer copies its state to the device; on the CPU it would keep a handed-over
            # state's shared pages as its own and change them under the background write of their checkpoint.
            train_state = (
                resumed.train_state
                if self.device.type == "cuda" or resumed is not start.handed
                else tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, resumed.train_state)
            )
            self._restore(train_state, resumed.meta)

    # -- set-up helpers --------------------------------------------------------------------------

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

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.cfg.launch.ready_timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gave up waiting for {what} after {self.cfg.launch.ready_timeout_s:.0f}s")
            if self.stop_requested:
                raise KeyboardInterrupt
            time.sleep(0.2)

    @property
    def done(self) -> bool:
        """The run's last step is trained: ``max_steps`` of them, or the time budget spent."""
        return self.step >= self.max_steps or self.budget.spent

    def _agree(self, seconds: float) -> float:
        """Rank 0's clock reading on every rank (only a budget reads it, so only then a collective)."""
        return self.ranks.broadcast(seconds) if self.budget.minutes else seconds

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self, optimizer_state: dict) -> dict:
        """The train state of a checkpoint (its train_state/): ``optimizer_state`` (of the whole drafter), the schedule and the RNGs."""
        return {
            "optimizer": optimizer_state,
            "optimizer_name": self.cfg.training.resolved_optimizer,
            "scheduler": copy.deepcopy(self.scheduler.state_dict()),  # its lists are the scheduler's own
            "generator": self.generator.get_state(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.empty(0),
        }

    def _restore(self, state: dict, meta: dict) -> None:
        """Optimizer, schedule, RNGs and bookkeeping from ``train_state`` and ``trainer_state.json`` contents."""
        trained_with = state["optimizer_name"]
        # The checkpoint brings the optimizer's state (its moments); the settings of its groups are this config's
        # (a restart may change training.weight_decay) and this device's (fused AdamW on a GPU).
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        if trained_with != self.cfg.training.resolved_optimizer:
            log.warning(
                "training.optimizer is %s, the checkpoint's was %s: the weights and the schedule carry on, "
                "the optimizer state starts anew",
                self.cfg.training.resolved_optimizer,
                trained_with,
            )
        elif self.sharded:
            load_full_optimizer_state(self.drafter, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)
        self.scheduler.load_state_dict(state["scheduler"])
        # A restart may change the learning rate, the schedule or the optimizer (and so its number of parameter
        # groups): the schedule keeps its step, the peak and the shape are the new ones.
        groups = self.optimizer.param_groups
        self.scheduler.base_lrs = [self.cfg.training.lr] * len(groups)
        self.scheduler.lr_lambdas = [lr_lambda(self.cfg, self.max_steps, self.budget)] * len(groups)
        for group in groups:
            group["initial_lr"] = self.cfg.training.lr
            group["lr"] = self.cfg.training.lr * self.scheduler.lr_lambdas[0](meta["step"])
        # Copies: a state handed over is views into shared pages, which the RNG setters do not take.
        self.generator.set_state(state["generator"].clone())
        torch.set_rng_state(state["torch_rng"].clone())
        if self.device.type == "cuda" and state["cuda_rng"].numel():
            torch.cuda.set_rng_state(state["cuda_rng"].clone(), self.device)
        self.step = int(meta["step"])
        self.commits = Commits.from_checkpoint(meta["committed"])
        self.wandb_id = meta.get("wandb_id")

    def save_checkpoint(self, blocking: bool = False) -> float:
        """Checkpoint checkpoints/step-N (trainer/checkpoint.py). Training stands still only while the
        state is copied to the host; the write runs in the background unless ``blocking`` or
        ``training.async_checkpoint`` is off. A write that fails raises CheckpointError (here, or at a
        later step) and leaves the previous checkpoint and latest.json untouched.
        Under FSDP every rank first helps gather the whole weights and optimizer state, tensor by
        tensor, into rank 0's host buffers, so the checkpoint is the same as an unsharded trainer's.
        Returns the seconds training stood still for it (waiting for the previous write included).
        """
        started = time.perf_counter()
        if self.rank == 0:
            self.checkpoints.wait()  # one write at a time; its host buffers are then free again
            self.state = "checkpointing"
            self.write_status()
        # Into host buffers reused between checkpoints. Under FSDP every rank joins the gathers of the
        # sharded tensors and rank 0 keeps the whole state; under DDP rank 0 holds it all already.
        staging, keep = self.checkpoints.staging, self.rank == 0
        weights = optimizer_state = None
        if keep or self.sharded:
            weights = staging.copy(self.drafter.state_dict(), "drafter", keep)
            optimizer_state = staging.copy(self.optimizer.state_dict(), "optimizer", keep)
        if self.rank == 0:
            snapshot = Snapshot(
                f"step-{self.step:08d}",
                self.drafter,
                weights,
                self.state_dict(optimizer_state),
                self._checkpoint_meta(),
                stall_s=time.perf_counter() - started,
            )
            self.checkpoints.write(snapshot, background=self.cfg.training.async_checkpoint and not blocking)
            # Written now, not at the next log_every: the launcher starts a standby only on "training".
            self.state = "training"
            self.write_status()
        if self.world_size > 1:
            dist.barrier()
        return time.perf_counter() - started

    def _checkpoint_meta(self) -> dict:
        """trainer_state.json: the step and the batches it committed."""
        return {
            "step": self.step,
            "max_steps": self.max_steps,
            "trained_s": self.budget.seconds,
            "incarnation": self.incarnation,
            "committed": self.commits.trained_state(),
            "wandb_id": self.wandb_id,
            "lr": self.cfg.training.lr,
        }

    def hand_over(self) -> None:
        """restart-trainer of a single process: the final state into the shared staging segments instead of a
        disk checkpoint; ``close`` names them in the handover mark and the successor writes the checkpoint."""
        started = time.perf_counter()
        self.state = "handing over"
        self.write_status()
        staging = self.checkpoints.staging
        superseded = None
        if self.checkpoints.writing and staging.room_for_another_set():
            # A background write still reads the staging: the state goes into new segments instead of waiting
            # for it (up to 20 s for a Qwen3-8B draft). The successor writes this later state's checkpoint; the
            # earlier write is left to end or not as this process exits (like a kill there, which loses nothing).
            superseded = self.checkpoints.supersede()
            staging.detach()
        else:
            self.checkpoints.wait()  # an earlier write reads the same buffers
        faults.point("trainer.stage")
        weights = staging.copy(self.drafter.state_dict(), "drafter")
        train_state = self.state_dict(staging.copy(self.optimizer.state_dict(), "optimizer"))
        train_state.update(staging.copy({k: v for k, v in train_state.items() if k != "optimizer"}, "extras"))
        self.handover_state = {
            "trees": {"weights": staging.describe(weights), "train_state": staging.describe(train_state)},
            "segments": staging.layouts(),
            "meta": self._checkpoint_meta(),
            "drafter_config": zlab_config(self.draft_config, self.drafter.fc.weight.dtype),
        }
        log.info(
            "state of step %d handed over in shared memory in %.2f s%s",
            self.step,
            time.perf_counter() - started,
            f" (new segments: checkpoint {superseded} was still being written, and is superseded)"
            if superseded
            else "",
        )

    # -- the loop --------------------------------------------------------------------------------

    def next_batch(self) -> tuple[Received | None, float]:
        """The next staged batch and the seconds we waited for it (starved time)."""
        if self._upcoming is not None:
            received, self._upcoming = self._upcoming, None
            return received, 0.0
        started = time.perf_counter()
        while not self.stop_requested:
            received = self.feeder.get(timeout=0.5)
            if received is not None:
                return received, time.perf_counter() - started
            if self.feeder.refusal:
                raise ConfigError(f"a producer refused this trainer: {self.feeder.refusal}")
            if self.feeder.error is not None:
                raise RuntimeError("the feeder thread failed") from self.feeder.error
        return None, time.perf_counter() - started

    def train_step(self, received: Received) -> dict[str, torch.Tensor]:
        """Forward, backward, clip, optimizer and scheduler step; metrics stay on the device."""
        self.model.train()
        with self.autocast:
            loss, metrics = self.model(
                received.batch,
                self.cfg.drafter.num_anchors,
                self.generator,
                max(self.step / max(1, self.max_steps), self.budget.fraction),
                received.prepared,
            )
        loss.backward()
        faults.point("trainer.step")
        self._prepare_upcoming()
        clip = self.cfg.training.grad_clip or float("inf")
        # Under FSDP the norm is reduced over every rank's shards and comes back replicated.
        metrics["grad_norm"] = full_tensor(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _prepare_upcoming(self) -> None:
        """Sample the next batch's anchors and build its block masks while the GPU still runs this
        step's backward, so mask building is off the critical path."""
        if self._upcoming is None:
            self._upcoming = self.feeder.get(timeout=0)
        if self._upcoming is not None and self._upcoming.prepared is None:
            self._upcoming.prepared = self.drafter.prepare(
                self._upcoming.batch, self.cfg.drafter.num_anchors, self.generator
            )

    def claim(self) -> tuple[Received | None, float, list]:
        """This step's batch, agreed with the other ranks; (None, ...) when any rank stops.

        Every rank shows the batch it would train (one object collective on the CPU group, no GPU
        sync); a batch already trained, or shown by a lower rank too, is dropped by its rank, which
        shows its next one. So no batch is trained twice whatever the producers send (a restarted
        producer only knows what the ranks that said HELLO to it had received), and all ranks stop
        together. Returns the batch, the seconds waited for data, and every rank's claim.
        """
        received, waited = None, 0.0
        while True:
            if received is None and not self.stop_requested:
                received, starved = self.next_batch()
                waited += starved
            mine = (
                None
                if received is None
                else (received.producer, received.ordinal, received.cursor, received.batch.epoch, received.sample_ids)
            )
            everyone = [mine]
            if self.world_size > 1:
                everyone = [None] * self.world_size
                dist.all_gather_object(everyone, mine, group=self.ranks.cpu_group)
            if any(claim is None for claim in everyone):
                return None, waited, everyone
            seen: set[tuple[int, int]] = set()
            losers = set()
            for rank, (producer, ordinal, *_) in enumerate(everyone):
                if (producer, ordinal) in seen or self.commits.is_trained(producer, ordinal):
                    losers.add(rank)
                seen.add((producer, ordinal))
            if not losers:
                return received, waited, everyone
            if self.rank in losers:
                log.error(
                    "batch %d of producer %d was trained or taken by another rank; dropped",
                    received.ordinal,
                    received.producer,
                )
                received = None

    def record(self, everyone: list) -> None:
        """Mark the step's batches trained (on every rank) and append the ledger line (rank 0)."""
        for producer, ordinal, cursor, _, _ in everyone:
            self.commits.mark_trained(producer, ordinal, cursor)
            # Another rank's batch counts as received here too: a HELLO of ours must say so, or a
            # restarted producer would compute it again.
            self.commits.mark_received(producer, ordinal, cursor)
        if self.ledger is not None:
            samples = [[p, epoch, s] for p, _, _, epoch, ids in everyone for s in ids]
            batches = [[p, o] for p, o, _, _, _ in everyone]
            self.ledger.write(
                json.dumps(
                    {
                        "step": self.step,
                        "incarnation": self.incarnation,
                        "samples": samples,
                        "batches": batches,
                        "time": time.time(),
                    }
                )
                + "\n"
            )
            self.ledger.flush()

    def run(self) -> str:
        self.feeder.start()
        self.state = "training"
        self.write_status()
        window = _Window(self.drafter.logged_metrics)
        while not self.done and not self.stop_requested:
            received, starved, everyone = self.claim()
            if received is None:
                break
            faults.point("trainer.batch", stop=lambda: self.stop_requested)  # a test's hold ends on a stop
            started = time.perf_counter()
            metrics = self.train_step(received)
            self.step += 1
            self.budget.tick(self._agree)
            self.record(everyone)
            window.add(received, metrics, starved, time.perf_counter() - started, self._flops(received, metrics))
            if self.evals.in_flight and self.step % max(1, self.cfg.logging.log_every // 4) == 0:
                self.collect_evaluations()
            if self.step % self.cfg.logging.log_every == 0 or self.done:
                self.log_metrics(window)
                if self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                    # Before the window restarts, so the evaluation stays out of tokens/s.
                    self.evaluate()
                window = _Window(self.drafter.logged_metrics)
            if self.rank == 0:
                self.checkpoints.raise_failure()  # a background write that failed stops the run now
            if self.step % self.cfg.training.checkpoint_every == 0 and not self.done:
                window.checkpoint_s += self.save_checkpoint()
        finished = self.done
        handover_request = self.run_dir.handover_request(os.getpid())  # restart-trainer: a successor waits
        if handover_request.is_file() and not finished and self.world_size == 1 and self.checkpoints.staging.shared:
            handover_request.unlink()
            self.hand_over()
        else:
            self.save_checkpoint(blocking=True)  # always on the last step, and on a requested stop
        if finished:
            self.collect_evaluations(wait_s=EVAL_RESULT_WAIT_S)  # the last step's evaluation, while the producers run
        self.state = "finished" if finished else "stopped"
        return self.state

    def evaluate(self) -> None:
        """Ask for an acceptance evaluation of this step's weights and go on training (trainer/acceptance.py: producer 0
        evaluates them between two of its batches). Under FSDP every rank helps gather the weights."""
        weights = full_model_state(self.drafter) if self.sharded else None
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

    def _flops(self, received: Received, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """Model FLOPs of this batch's step (forward + backward), for MFU; a device scalar, read when logged."""
        tokens = received.num_tokens  # useful work only: padding is not counted
        if tokens not in self.flops_cache:  # all but attention depends on the shapes alone
            self.flops_cache[tokens] = train_flops(self.draft_config, tokens, self.cfg.drafter.num_anchors, 0.0)[
                "total"
            ]
        return self.flops_cache[tokens] + self.flops_per_attention_pair * metrics["attention_pairs"]

    def log_metrics(self, window: _Window) -> None:
        if self.rank != 0:
            return
        record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], **window.summary(), "time": time.time()}
        if self.device.type == "cuda":
            # Since the start: a count that rises means the caching allocator had to free its cache and try again
            # (memory pressure, e.g. from a producer sharing the GPU), which costs a synchronisation each time.
            record["alloc_retries"] = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        for producer, stats in sorted(self.feeder.producer_stats().items()):
            ring = stats.get("ring", {})
            slots = max(1, ring.get("slots", 1))
            prefix = f"producer/{producer}"
            record[f"{prefix}/up"] = int(stats.get("up", False))
            for key in ("free", "filling", "ready", "leased"):
                record[f"ring/{producer}/{key}"] = ring.get(key, 0) / slots
            record[f"{prefix}/tokens_per_s"] = stats.get("tokens_per_s", 0.0)
            record[f"{prefix}/blocked_fraction"] = stats.get("blocked_fraction", 0.0)
            batching = stats.get("batching", {})
            for key in (
                "padding_efficiency",
                "mean_seq_len",
                "mean_batch_docs",
                "mean_batch_tokens",
            ):  # as the producers send them
                if key in batching:
                    record[f"data/{producer}/{key}"] = batching[key]
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.wandb is not None:
            self.wandb.log({wandb_key(k): v for k, v in record.items() if k not in ("step", "time")}, step=self.step)
        self.last_record = record
        self.write_status()
        # One line per metrics update in trainer.log; the launcher draws the live view from trainer.json.
        print(
            f"step {self.step}/{self.max_steps}"
            + (f"  {self.budget.seconds / 60:.1f}/{self.budget.minutes:g} min" if self.budget.minutes else "")
            + f"  loss {record['loss']:.3f}  tau {record['tau']:.2f}  "
            f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s  starved {record['starved_fraction']:.0%}"
            + "".join(f"  {key} {record[key]:.3f}" for key in self.drafter.logged_metrics),
            flush=True,
        )

    def write_status(self) -> None:
        if self.rank != 0:
            return
        last = self.last_record
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
            loss=last.get("loss"),
            tau=last.get("tau"),
            lr=last.get("lr"),
            tokens_per_s=last.get("tokens_per_s"),
            samples_per_s=last.get("samples_per_s"),
            steps_per_s=last.get("steps_per_s"),
            kind=self.cfg.drafter.kind,
            kind_metrics={key: last[key] for key in self.drafter.logged_metrics if key in last},
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
        self.feeder.close()
        self.write_status()
        for f in (self.ledger, self.metrics_file):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.world_size > 1:
            dist.destroy_process_group()
        else:  # nothing of the run is touched after this (a torchrun group's successor waits for its exit instead)
            if self.handover_state is None:
                self.checkpoints.staging.release()  # nobody takes them over
            faults.point("trainer.handover")
            mark = HandoverMark(
                os.getpid(), process_start_ticks(os.getpid()), self.step, time.time(), self.handover_state
            )
            mark.write(self.run_dir.trainer_handover)


def wandb_key(key: str) -> str:
    """wandb's name of a metrics.jsonl key: training figures (loss, tau, lr, acc/k, ...) under ``train/``; the
    sections that have one (producer/, ring/, data/, eval/) keep it."""
    section = key.split("/", 1)[0] if "/" in key else None
    return key if section in ("producer", "ring", "data", "eval", "train") else f"train/{key}"


class _Window:
    """Metrics of the steps since the last log line; read from the device only when logged."""

    def __init__(self, kind_metrics: tuple[str, ...] = ()) -> None:
        self.kind_metrics = kind_metrics
        """The drafter kind's own metrics (``logged_metrics``), averaged like the common ones."""
        self.started = time.perf_counter()
        self.steps = 0
        self.tokens = 0
        self.docs = 0
        self.starved = 0.0
        self.checkpoint_s = 0.0
        """Seconds the loop stood still for checkpoints (a slow disk shows here, not as a slower step)."""
        self.step_time = 0.0
        self.flops = 0.0
        self.sums: dict[str, torch.Tensor] = {}

    def add(
        self,
        received: Received,
        metrics: dict[str, torch.Tensor],
        starved: float,
        step_time: float,
        flops: torch.Tensor,
    ) -> None:
        self.steps += 1
        self.tokens += received.num_tokens
        self.docs += len(received.sample_ids)
        self.starved += starved
        self.step_time += step_time
        self.flops += flops
        for key in ("loss", "tau", "grad_norm", "acc", "coverage", *self.kind_metrics):
            value = metrics[key].detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def summary(self) -> dict:
        wall = time.perf_counter() - self.started
        out = {key: (value / self.steps).tolist() for key, value in self.sums.items()}
        acc = out.pop("acc")
        for k, a in enumerate(acc, start=1):
            out[f"acc/{k}"] = a
        out.update(
            {
                "tokens_per_s": self.tokens / wall,
                "samples_per_s": self.docs / wall,
                "step_time_s": self.step_time / self.steps,
                "steps_per_s": self.steps / wall,
                "starved_fraction": self.starved / wall,
                "checkpoint_fraction": self.checkpoint_s / wall,
                "tflops": float(self.flops) / wall / 1e12,
            }
        )
        return out


def import_what_a_start_needs() -> None:
    """The slow imports of a trainer's start, done ahead (by a successor or a standby trainer)."""
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer's first construction imports it: a second or more)
    import transformers  # noqa: F401
    import wandb  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import common.acceptance.report  # noqa: F401
    import common.drafter.target_head  # noqa: F401


def warm_start_ahead(run_dir: RunDir) -> WarmStart | None:
    """The warm start (trainer/warm.py) of a single-process trainer that takes over a run, built from the
    run's configuration as it is now (the Trainer checks that it still fits the one it starts with)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or not run_dir.config.is_file():
        return None
    try:
        cfg = load_config(run_dir.config)
    except ConfigError:
        return None  # the start reports it
    return prepare_warm_start(cfg, run_dir, resolve_device(cfg, 0))


def wait_for_predecessor(
    run_dir: RunDir, warm_start: WarmStart | None = None
) -> tuple[HandoverMark | None, WarmStart | None]:
    """With ``DFLASH_TRAINER_AFTER=pid:start_ticks`` the launcher started this trainer while the one it
    replaces (restart-trainer) still finishes its step and writes its final checkpoint: import what the
    start needs meanwhile, then wait until that process is gone, or has written its handover (everything
    of the run done, only the interpreter's teardown left), before touching the run (its status, its
    checkpoint, the producers). A killed predecessor is gone too: this trainer then resumes from whatever
    checkpoint is the latest, as after any crash. Returns (its mark, the warm start built meanwhile)."""
    spec = os.environ.get(PREDECESSOR_ENV)
    if not spec:
        return None, warm_start
    import_what_a_start_needs()  # while the predecessor still works
    if warm_start is None:
        warm_start = warm_start_ahead(run_dir)
    pid, start_ticks = (int(x) for x in spec.split(":"))
    began = time.monotonic()
    while True:
        # Alive first, then the mark: a predecessor already gone has written whatever mark it ever will.
        gone = process_start_ticks(pid) != start_ticks
        mark = HandoverMark.read(run_dir.trainer_handover)
        if mark is not None and (mark.pid, mark.start_ticks) == (pid, start_ticks):
            break
        if gone:  # killed before its mark: the disk checkpoint is the state
            mark = None
            break
        time.sleep(0.01)
    log.info(
        "the trainer this one replaces (pid %d) is done; waited %.1f s for it%s",
        pid,
        time.monotonic() - began,
        ", it handed its state over" if mark is not None and mark.state else "",
    )
    faults.point("trainer.resume")
    return mark, warm_start


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


def wait_for_takeover(run_dir: RunDir) -> WarmStart | None:
    """A trainer started ahead of need: import what a start needs and build its warm start (trainer/warm.py),
    then wait for the launcher's word (``control/standby-<pid>.json``, naming the trainer it replaces)
    before touching anything else of the run."""
    # Stopped before it was needed (the run ends, the launcher stops): it holds nothing of the run, so it
    # leaves at once and says so, instead of dying by the signal (which the launcher reports as a crash).
    signal.signal(signal.SIGTERM, _stop_standby)
    log.info("standby trainer: building ahead, then waiting to take over")
    import_what_a_start_needs()
    warm_start = warm_start_ahead(run_dir)
    go = run_dir.standby_go(os.getpid())
    while (order := StandbyGo.read(go)) is None:
        time.sleep(0.02)
    go.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run's trainer now: its own stop handling follows
    if order.predecessor:
        os.environ[PREDECESSOR_ENV] = order.predecessor
    log.info("taking over as the run's trainer")
    faults.point("trainer.takeover")
    return warm_start


def _stop_standby(_signum: int, _frame: object) -> None:
    log.info("standby trainer stopped before it was needed")
    end_now(0)


if __name__ == "__main__":
    exit_process(main())

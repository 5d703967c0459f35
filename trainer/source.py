"""Where the trainer's batches come from and where its evaluations run: one interface, so the loop has one path.

The run's source is the producers' rings (``RingSource``): the feeder thread takes their batches and producer 0
evaluates what the trainer asks for. The coupled baseline (launch/bench/coupled.py) is another source, which runs
the target in the trainer's own process and evaluates in its loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any, Protocol

from common.config import RunConfig
from common.rundir import RunDir
from trainer.acceptance import EvalClient
from trainer.feeder import Commits, Feeder
from trainer.ranks import Ranks


class BatchSource(Protocol):
    takes_warm_start: bool
    """Whether a warm start (trainer/warm.py, built from the run's configuration alone) fits a trainer on it."""

    def feeder(self, incarnation: int, expect: dict, commits: Commits, pad_to: int | None) -> Any:
        """What the loop takes batches from: ``start``, ``get(timeout)``, ``refusal``, ``error``,
        ``producer_stats``, ``close`` (as ``trainer.feeder.Feeder``)."""
        ...

    def evaluations(self, incarnation: int, block_size: int, metrics_file: IO[str] | None, wandb_run: Any) -> Any:
        """What the loop asks evaluations of and logs their results through: ``adopt``, ``ask``, ``collect``,
        ``in_flight``, ``status``, ``close`` (as ``trainer.acceptance.EvalClient``)."""
        ...


SourceFactory = Callable[[RunConfig, RunDir, Ranks], BatchSource]
"""Builds a trainer's source; the trainer calls it before building its drafter (a source may export the head)."""


class RingSource:
    """The producers' rings and producer 0's evaluations."""

    takes_warm_start = True

    def __init__(self, cfg: RunConfig, run_dir: RunDir, ranks: Ranks) -> None:
        self.cfg, self.run_dir, self.ranks = cfg, run_dir, ranks

    def feeder(self, incarnation: int, expect: dict, commits: Commits, pad_to: int | None) -> Feeder:
        ring = self.cfg.ring
        return Feeder(
            self.run_dir,
            consumer_id=f"trainer/r{self.ranks.rank}",
            incarnation=incarnation,
            expect=expect,
            commits=commits,
            device=self.ranks.device,
            credits=ring.credits,
            heartbeat_interval_s=ring.heartbeat_interval_s,
            handshake_timeout_s=ring.handshake_timeout_s,
            pad_to=pad_to,
        )

    def evaluations(
        self, incarnation: int, block_size: int, metrics_file: IO[str] | None, wandb_run: Any
    ) -> EvalClient:
        return EvalClient(
            self.run_dir,
            incarnation,
            block_size,
            self.cfg.eval.gap_tolerance,
            background_export=self.cfg.training.async_checkpoint,
            metrics_file=metrics_file,
            wandb_run=wandb_run,
        )

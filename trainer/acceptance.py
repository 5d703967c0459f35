"""The trainer's side of producer 0's evaluations (common/acceptance/records.py is the contract,
producer/acceptance/job.py the other side): ask for one at a step, log each result at the step it belongs to when it
comes back, and take over those a trainer before this one asked for. Training never waits for a result, except a
finished run for its last step's."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from common.acceptance import records
from common.acceptance.report import by_length_summary, warn_if_gap
from common.drafter.base import Drafter
from common.rundir import RunDir
from trainer.checkpoint import EvalExportWriter

log = logging.getLogger(__name__)


@dataclass(eq=False)
class AcceptanceClient:
    """The evaluations one trainer (rank 0) asked for or adopted, and the last result logged.

    The trainer's evaluation interface: ``adopt``, ``ask``, ``collect``, ``status``, ``close`` and ``in_flight``
    (the coupled baseline's in-loop evaluation, launch/bench/coupled.py, has the same)."""

    run_dir: RunDir
    incarnation: int
    block_size: int
    gap_tolerance: float
    background_export: bool
    metrics_file: IO[str] | None
    wandb_run: Any
    exports: EvalExportWriter = field(init=False)
    in_flight: set[tuple[int, int]] = field(init=False, default_factory=set)
    """(step, incarnation) of the evaluations asked for, by this trainer or adopted from the one before, that have not
    come back."""
    last: dict[str, Any] | None = field(init=False, default=None)
    """The last result logged: step, real tau, simulated tau (the status shows it)."""

    def __post_init__(self) -> None:
        self.exports = EvalExportWriter(self.run_dir)

    def adopt(self, resumed_step: int) -> None:
        """Take over the evaluations the trainers before asked for, up to the step this one resumed at: their results
        are logged here when they come. Those past it measured weights this lineage never had: written as lost."""
        for step in records.mark_abandoned_exports_lost(self.run_dir, self.incarnation):
            log.warning(
                "evaluation of step %d lost: the trainer that asked for it stopped before its export was complete", step
            )
        adopted, superseded = records.adoptable(self.run_dir, resumed_step, self.incarnation)
        self.in_flight.update(adopted)
        for step, incarnation in superseded:
            if records.result(self.run_dir, step, incarnation) is None:
                records.finish(
                    self.run_dir,
                    records.AcceptanceResult(
                        step=step,
                        incarnation=incarnation,
                        lost=f"superseded: the trainer resumed at step {resumed_step}",
                    ),
                )
            records.mark_logged(self.run_dir, step, incarnation)
        if adopted:
            log.info(
                "adopted the evaluations of steps %s asked for before this trainer started",
                [step for step, _ in adopted],
            )

    def ask(
        self, step: int, drafter: Drafter, full_weights: dict[str, torch.Tensor] | None, final: bool = False
    ) -> None:
        """Export the drafter (``full_weights``: its whole state where the drafter holds a shard of it) for producer 0
        to evaluate; training stands still only for the copy to host memory, the export is written in the
        background. ``final``: the run's last step, which producer 0 takes at once."""
        export = records.folder(self.run_dir, step, self.incarnation) / "drafter"
        request = records.AcceptanceRequest(step=step, drafter=str(export), incarnation=self.incarnation, final=final)
        weights = full_weights if full_weights is not None else drafter.state_dict()
        stall_s = self.exports.export(drafter, weights, request, background=self.background_export)
        log.info("evaluation of step %d asked for; training stood still %.2f s for its export", step, stall_s)
        self.in_flight.add((step, self.incarnation))

    def collect(self, now_step: int, wait_s: float = 0.0, stop: Callable[[], bool] = lambda: False) -> bool:
        """Log each result that has come back (``record``, at training step ``now_step``), waiting up to ``wait_s``
        for all unless ``stop()``; whether any came."""
        deadline = time.monotonic() + wait_s
        came = False
        while self.in_flight:
            for step, incarnation in sorted(self.in_flight):
                result = records.result(self.run_dir, step, incarnation)
                if result is None:
                    continue
                came = True
                self.in_flight.discard((step, incarnation))
                if result.lost:
                    log.warning("evaluation of step %d lost: %s", step, result.lost)
                else:
                    self.record(step, result.metrics, now_step)
                records.mark_logged(self.run_dir, step, incarnation)
            if not self.in_flight or time.monotonic() >= deadline or stop():
                break
            time.sleep(0.2)
        return came

    def record(self, step: int, metrics: dict[str, float], now_step: int) -> None:
        """Log one result in metrics.jsonl at its own step, in wandb (whose steps only grow: against eval/step) and
        in the trainer's log, warning when real and simulated tau drift apart.

        Each bucket of context length is its own series, ``eval/tau_by_length/<bucket>`` (and its break-even tau,
        z-lab tau, per-position acceptance), so wandb draws one curve per bucket; a bucket no verify forward reached
        in an evaluation has no point there, rather than a made-up one."""
        self.metrics_file.write(json.dumps({"step": step, **metrics, "time": time.time()}) + "\n")
        self.metrics_file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({**metrics, "eval/step": step}, step=now_step)
        self.last = {"step": step, "tau": metrics.get("eval/tau"), "sim_tau": metrics.get("eval/sim_tau")}
        by_length = {
            key.removeprefix("eval/tau_by_length/"): value
            for key, value in metrics.items()
            if key.startswith("eval/tau_by_length/")
        }
        if by_length:
            self.last["tau_by_length"] = by_length
        log.info(
            "eval at step %d (logged at %d): tau %.3f real, %.3f simulated, %.1f%% target forwards saved",
            step,
            now_step,
            metrics.get("eval/tau", 0.0),
            metrics.get("eval/sim_tau", 0.0),
            100 * metrics.get("eval/forwards_saved", 0.0),
        )
        if summary := by_length_summary(metrics):
            log.info("eval at step %d by context length: tau %s", step, summary)
        warn_if_gap(metrics, self.block_size, self.gap_tolerance)

    def status(self) -> dict[str, Any]:
        """The status file's part: the last result and the steps still out."""
        return {"eval": self.last, "evals_in_flight": sorted(step for step, _ in self.in_flight)}

    def close(self) -> None:
        """Wait for an export being written: its request is, so the producer may still answer it."""
        self.exports.wait()

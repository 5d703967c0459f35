"""Producer 0's evaluations for a training run: the trainer's exported drafters decoded against this producer's
target on the held-out split of the run's data (the decoding itself: producer/acceptance/evaluator.py), as one of
the producer's jobs (producer/jobs.py)."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable

from common import faults
from common.acceptance import records
from common.acceptance.report import by_length_summary
from common.config import RunConfig
from common.rundir import RunDir
from producer.acceptance.evaluator import AcceptanceEvaluator, build_evaluator
from producer.target_model.capture import Target
from producer.target_model.greedy import GreedyTarget
from producer.target_model.tensor_parallel import TensorParallelGroup

log = logging.getLogger(__name__)


EVAL_POLL_S = 0.25  # how often producer 0 looks for the trainer's evaluation requests (a directory listing)


def evaluations_expected(cfg: RunConfig) -> bool:
    """Whether the trainer will ask for evaluations: eval.every_steps is set and, where training.max_steps is, within
    it (a run of fewer steps never asks, and its reference, minutes on a CPU, is not worth making ahead). A trainer
    restarted with more steps still gets its evaluations: the first request makes the reference."""
    every, max_steps = cfg.eval.every_steps, cfg.training.max_steps
    return bool(every) and not (max_steps and every > max_steps)


class AcceptanceJob:
    """Producer 0 answers the trainer's evaluation requests (common/acceptance/records.py), whatever eval.every_steps it
    started with: that cadence is the trainer's, and restart-trainer may change it. A tensor-parallel producer
    evaluates with its followers."""

    name = "evaluating"

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir,
        producer_id: int,
        target: Target,
        group: TensorParallelGroup | None,
        on_change: Callable[[], None],
    ) -> None:
        """``on_change`` rewrites the producer's status (an evaluation starts or ends)."""
        self.cfg, self.run_dir, self.producer_id, self.target, self.group = cfg, run_dir, producer_id, target, group
        self.on_change = on_change
        self.evaluating: int | None = None
        """The step whose drafter is being evaluated, if any."""
        self.answered: int | None = None
        """The step this producer answered last (its result written; the trainer reads it at its next look)."""
        self._evaluator: AcceptanceEvaluator | None = None
        self._reference_due = True
        self._next_check = 0.0
        self._held_until = 0.0
        """Until when (time.monotonic()) this producer makes batches after an evaluation, to keep evaluating at most
        eval.producer_share of its time; a final request (the run's last step) is taken regardless."""
        for step in records.mark_abandoned_claims_lost(run_dir, producer_id):
            log.warning("evaluation of step %d was lost: this producer was restarted during it", step)

    def status(self) -> dict[str, object]:
        """The step it evaluates (None: none), the step it answered last, what the evaluator is doing (an evaluation's
        phase, or the reference made ahead), and the seconds left of its hold after the last evaluation
        (eval.producer_share)."""
        held = self._held_until - time.monotonic()
        return {
            "step": self.evaluating,
            "answered": self.answered,
            "doing": self._evaluator.doing if self._evaluator is not None else None,
            "held_s": round(held, 1) if held > 0 else None,
        }

    def between_batches(self) -> None:
        """Run the oldest open evaluation request of the trainer (the newest, with eval.producer_share below 1).

        The server thread keeps leasing the ring's ready batches meanwhile, so the trainer trains on while
        this producer decodes. An evaluation that fails is written as lost: it never stops the producer.
        """
        request = self._next_request()
        if request is None:
            return
        records.claim(self.run_dir, request, self.producer_id, os.getpid())
        self.evaluating = request.step
        self.on_change()
        started = time.monotonic()
        records.finish(self.run_dir, self._answer(request, started))
        self.evaluating, self.answered = None, request.step
        self.on_change()
        # Batches again for long enough that evaluating takes at most eval.producer_share of this producer's time.
        share = self.cfg.eval.producer_share
        spent = time.monotonic() - started
        self._held_until = time.monotonic() + spent * (1.0 - share) / share

    def _next_request(self) -> records.AcceptanceRequest | None:
        """The request to answer now, if any: polled every EVAL_POLL_S, none within the hold after an evaluation but
        the run's last. With a share below 1 the newest only: the older ones are answered as skipped (the trainer
        logs that), so none pile up while this producer evaluates or makes up its share of batches."""
        now = time.monotonic()
        if now < self._next_check:
            return None
        self._next_check = now + EVAL_POLL_S
        pending = records.open_requests(self.run_dir)
        # Within its share's hold only the run's last evaluation is taken: training has ended, nothing needs batches.
        if not pending or (now < self._held_until and not any(request.final for request in pending)):
            return None
        share = self.cfg.eval.producer_share
        if share >= 1:
            return pending[0]
        request = pending[-1]
        for stale in pending[:-1]:
            records.finish(
                self.run_dir,
                records.AcceptanceResult(
                    step=stale.step,
                    incarnation=stale.incarnation,
                    producer=self.producer_id,
                    lost=f"skipped: producer 0 evaluates at most eval.producer_share={share} of its time, "
                    f"and step {request.step} came since",
                ),
            )
        return request

    def _answer(self, request: records.AcceptanceRequest, started: float) -> records.AcceptanceResult:
        """The result of evaluating ``request``'s drafter (begun at ``started``, time.monotonic()): its metrics, or
        lost with the error that stopped it."""
        faults.point("producer.evaluate")
        try:
            metrics = self._evaluate(request)
            self._log_evaluation(request.step, metrics, time.monotonic() - started)
        except Exception as exc:  # auxiliary: the data keeps flowing whatever happens here
            log.exception("evaluation of step %d failed", request.step)
            return records.AcceptanceResult(
                step=request.step,
                lost=f"{type(exc).__name__}: {exc}",
                incarnation=request.incarnation,
                producer=self.producer_id,
            )
        return records.AcceptanceResult(
            step=request.step, metrics=metrics, incarnation=request.incarnation, producer=self.producer_id
        )

    def _log_evaluation(self, step: int, metrics: dict[str, float], took: float) -> None:
        """One line of an evaluation's figures and where its ``took`` seconds went; one of its tau by context."""
        decode, reference = metrics["eval/decode_seconds"], metrics["eval/reference_seconds"]
        timing = metrics["eval/timing_seconds"]
        log.info(
            "evaluated step %d for the trainer in %.1f s: tau %.3f real (%.3f as z-lab counts it%s), %.3f "
            "simulated (loading the export %.1f s, the reference %.1f s, decoding %.1f s, the simulated "
            "acceptance %.1f s, timing the forwards for the break-even tau %.1f s)",
            step,
            took,
            metrics["eval/tau"],
            metrics["eval/zlab_tau"],
            f", sampled at temperature {self.cfg.eval.temperature:g}" if self.cfg.eval.temperature > 0 else "",
            metrics["eval/sim_tau"],
            took - metrics["eval/seconds"],
            reference,
            decode,
            metrics["eval/seconds"] - reference - decode - timing,
            timing,
        )
        if by_length := by_length_summary(metrics):
            log.info("step %d, tau by context length: %s", step, by_length)

    def while_ring_full(self) -> None:
        """While the ring is full and nothing is asked: make the evaluator's reference (the target's greedy
        continuations and features) once, so that no evaluation the trainer asks for runs a target forward, and
        none does it beside a training step. Only where evaluations are expected (eval.every_steps); a failure
        is logged, and the first request tries again (and is lost if it fails too)."""
        if self._reference_due and evaluations_expected(self.cfg):
            self._reference_due = False
            try:
                self._evaluator_of_run().prepare(self.cfg.drafter.block_size)
            except Exception:  # auxiliary: the data keeps flowing whatever happens here
                log.exception("could not prepare the evaluation reference; the first evaluation will make it")

    def _evaluate(self, request: records.AcceptanceRequest) -> dict[str, float]:
        """Real and simulated acceptance of the exported drafter against this producer's target."""
        from common.drafter.export import load_drafter
        from common.drafter.loss import LossConfig
        from common.drafter.target_head import load_target_head
        from producer.target_model.load import target_head_of

        model = self.target.model
        if self.group is None:
            head = target_head_of(model)
        else:  # a sharded model's head is in pieces: the whole one, as this producer exported it for the trainer
            head = load_target_head(
                self.run_dir.head_dir(self.cfg.target.path), device=self.target.device, dtype=self.target.dtype
            )
        drafter = load_drafter(
            request.drafter,
            head,
            LossConfig(label_mode=self.cfg.training.label_mode),
            own_checkpoint=True,
            device=self.target.device,
        )
        return self._evaluator_of_run().evaluate(drafter).metrics()

    def _evaluator_of_run(self) -> AcceptanceEvaluator:
        """The evaluator, made once: it keeps the target's reference between evaluations."""
        if self._evaluator is None:
            # A tensor-parallel leader's greedy target tells its followers every call (producer/target_model/operations.py).
            self._evaluator = build_evaluator(
                self.cfg,
                self.target.model,
                self.target.layer_ids,
                make_target=functools.partial(GreedyTarget, followers=self.group),
                held_out_file=self.run_dir.held_out,
            )
        return self._evaluator

"""The coupled baseline: target forward, then drafter step, in one process, one after the other.

This is how today's online trainers work: every step first runs the target on its batch, then
trains the drafter on the captured features, on the same GPU. It exists so that the decoupled
pipeline can be measured against it (``launch/bench/pipeline.py``) with everything else equal: the
same data and batches, the same target capture, the same trainer loop, step, logging and ledger.
Only where a batch comes from differs: ``CoupledSource`` takes the feeder's place, and it evaluates in the
loop on its own target (``CoupledAcceptance``), as those trainers do.

    python -m launch.bench.coupled --run-dir DIR                      # one GPU
    torchrun --nproc-per-node 2 -m launch.bench.coupled --run-dir DIR  # DDP: rank r reads shard r

A benchmark tool, not a way to train: there are no producers, so nothing survives the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from typing import IO, Any

import torch
from torch import nn

from common.acceptance.report import AcceptanceReport, warn_if_gap
from common.batch import PackedBatch, SlotFormat, document_tensors, pad_packed
from common.config import ConfigError, RunConfig
from common.contract import BatchMeta
from common.drafter.base import Drafter
from common.drafter.model import build_drafter
from common.lifecycle import exit_process
from common.rundir import RunDir
from producer.acceptance.evaluator import AcceptanceEvaluator, build_evaluator
from producer.build import export_target_head, feature_layer_ids
from producer.data.batching import batch_stats
from producer.data.build import build_plan, run_sources
from producer.target_model.capture import Target
from producer.target_model.load import build_target_config, target_head_of
from trainer.feeder import Commits, ProducerReport, Received
from trainer.ranks import Ranks
from trainer.train import run_trainer

log = logging.getLogger(__name__)


class CoupledSource:
    """The trainer's batch source (trainer/source.py) of the coupled baseline: its feeder's ``get`` runs the target on
    the next batch, in this process, and its evaluations run in the trainer's loop."""

    takes_warm_start = False  # a warm start is built without the target this process loads

    def __init__(self, cfg: RunConfig, run_dir: RunDir, ranks: Ranks) -> None:
        rank, world_size, device = ranks.rank, ranks.world_size, ranks.device
        if cfg.training.max_steps == 0:
            raise ConfigError("training.max_steps: the coupled baseline needs an explicit step count")
        target_cfg = dataclasses.replace(cfg.target, device=str(device))
        layer_ids = feature_layer_ids(cfg, build_target_config(target_cfg).num_hidden_layers)
        self.target = Target.load(target_cfg, layer_ids, capture_last_hidden=cfg.ships_final_hidden)
        if device.type == "cuda":
            self.target.warmup(min(4096, cfg.batching.token_budget))
        if rank == 0 and cfg.target.path is None:
            export_target_head(self.target, run_dir.target_head)
        source, _ = run_sources(cfg, int(self.target.model.config.vocab_size))
        self.plan = build_plan(cfg, source, shard_index=rank, num_shards=world_size)
        self.batches = enumerate(self.plan.iter_batches())
        self.rank = rank
        self.device = device
        self.commits: Commits | None = None
        self.pad_to: int | None = None
        self.refusal: str | None = None
        self.error: BaseException | None = None
        # Rank 0 evaluates (and so makes the evaluator's reference).
        self.evaluation = CoupledAcceptance(cfg, self.target.model, self.target.layer_ids) if rank == 0 else None

    def feeder(self, incarnation: int, expect: dict, commits: Commits, pad_to: int | None) -> CoupledSource:
        """Attach the trainer's bookkeeping (made after the target is loaded); this source is its own feeder."""
        self.commits, self.pad_to = commits, pad_to
        return self

    def start(self) -> None:
        pass

    def get(self, timeout: float) -> Received:
        """The next batch with its features, computed now (``timeout`` is ignored: it never waits)."""
        ordinal, (cursor, sample_ids) = next(self.batches)
        batch = self.plan.materialize(cursor, sample_ids)
        # Outputs made here, outside capture's inference mode, so that autograd may use them.
        target = self.target
        slot = SlotFormat(target.aux_width, target.hidden_size, target.dtype, target.capture_last_hidden)
        shapes = slot.shapes(batch.num_tokens, batch.num_docs)
        tensors = {name: torch.empty(shape, dtype=dtype, device=self.device) for name, (shape, dtype) in shapes.items()}
        for name, tensor in document_tensors(batch.tensors()).items():
            tensors[name].copy_(tensor, non_blocking=True)
        target.capture(batch, out_aux=tensors["aux_hidden"], out_last=tensors.get("last_hidden"))
        if self.pad_to:
            tensors = pad_packed(tensors, self.pad_to)
        stats = batch_stats(batch)
        meta = BatchMeta(
            producer=self.rank,
            ordinal=ordinal,
            cursor=list(cursor),
            epoch=cursor.epoch,
            tokens=batch.num_tokens,
            docs=batch.num_docs,
            max_doc_len=stats.max_doc_len,
        )
        self.commits.mark_received(self.rank, ordinal, list(cursor))
        return Received(
            PackedBatch.from_tensors(tensors, epoch=cursor.epoch, meta=meta.to_wire()),
            self.rank,
            ordinal,
            list(cursor),
            meta,
            batch.sample_ids.tolist(),
            batch.num_tokens,
        )

    def evaluations(
        self, incarnation: int, block_size: int, metrics_file: IO[str] | None, wandb_run: Any
    ) -> InLoopEvaluations:
        """The trainer's evaluation client for this baseline: in its loop, on this process's target."""
        return InLoopEvaluations(self.evaluation, metrics_file, wandb_run)

    def producer_stats(self) -> dict[int, ProducerReport]:
        return {}

    def close(self) -> None:
        pass


class CoupledAcceptance:
    """The coupled baseline's periodic evaluation (rank 0, every ``eval.every_steps`` steps): in its loop, on
    the target in its own process, as today's online trainers evaluate. The decoupled trainer asks producer 0
    instead (common/acceptance/records.py). Evaluation is auxiliary: if it fails (e.g. the drafter's head is not this
    target's) the error is logged once, evaluation is switched off, and training goes on.
    """

    def __init__(self, cfg: RunConfig, target_model: nn.Module, layer_ids: list[int]) -> None:
        """With evaluations due, the evaluator's reference (the target's half of every evaluation) is made now,
        before the first step, as producer 0 makes it while its ring is full."""
        self.cfg = cfg
        self.target_model = target_model
        self.evaluator: AcceptanceEvaluator | None = None
        self.checked = False
        self.disabled = False
        if cfg.eval.every_steps:
            try:
                self.evaluator = build_evaluator(cfg, target_model, layer_ids)
                self.evaluator.prepare(cfg.drafter.block_size)
            except Exception:
                self.disabled = True
                log.exception("evaluation failed; it is off for the rest of this trainer's life")

    def _check(self, drafter: Drafter) -> None:
        loaded, shared = target_head_of(self.target_model), drafter.target_head
        if not (
            torch.equal(loaded.embed_weight, shared.embed_weight)
            and torch.equal(loaded.lm_head_weight, shared.lm_head_weight)
        ):
            raise ValueError("the target of this evaluation is not the producers' (embedding or lm_head differ)")
        self.checked = True

    def maybe_log(self, step: int, drafter: Drafter, metrics_file: IO[str], wandb_run: Any) -> AcceptanceReport | None:
        """Evaluate when due and write ``eval/*`` at ``step``: a line of its own in metrics.jsonl, and into
        wandb's row of that step (next to the training tau). The report, or None when none was made."""
        if self.disabled or self.evaluator is None or step % self.cfg.eval.every_steps:
            return None
        try:
            if not self.checked:
                self._check(drafter)
            report = self.evaluator.evaluate(drafter)
        except Exception:
            self.disabled = True
            log.exception("evaluation failed; it is off for the rest of this trainer's life")
            return None
        metrics = report.metrics()
        metrics_file.write(json.dumps({"step": step, **metrics, "time": time.time()}) + "\n")
        metrics_file.flush()
        if wandb_run is not None:
            wandb_run.log(metrics, step=step)
        log.info(
            "eval at step %d: tau %.3f real, %.3f simulated (gap %+.3f), %.1f%% target forwards saved, %.1fs",
            step,
            report.tau,
            report.sim_tau,
            report.tau_gap,
            100 * report.forwards_saved,
            report.seconds,
        )
        warn_if_gap(metrics, report.block_size, self.cfg.eval.gap_tolerance)
        return report


class InLoopEvaluations:
    """The trainer's evaluation interface (trainer/acceptance.py ``AcceptanceClient``: ``adopt``, ``ask``, ``collect``,
    ``status``, ``close``, ``in_flight``) for the coupled baseline: ``ask`` evaluates at once, in the loop, so
    nothing is ever in flight and nothing is adopted."""

    in_flight: frozenset = frozenset()

    def __init__(self, evaluation: CoupledAcceptance | None, metrics_file: IO[str] | None, wandb_run: Any) -> None:
        self.evaluation = evaluation
        self.metrics_file = metrics_file
        self.wandb_run = wandb_run
        self.last: dict[str, Any] | None = None

    def adopt(self, resumed_step: int) -> None:
        pass  # a baseline's run never survives its process: nothing was asked before it

    def ask(
        self, step: int, drafter: Drafter, full_weights: dict[str, torch.Tensor] | None, final: bool = False
    ) -> None:
        """Evaluate ``step`` now, the last one as any (a drafter holding a shard of itself is rebuilt whole from
        ``full_weights``)."""
        if self.evaluation is None:
            return
        if full_weights is not None:
            whole = build_drafter(drafter.config, drafter.target_head, drafter.loss_config)
            whole.load_state_dict(full_weights)
            drafter = whole.to(drafter.target_head.embed_weight.device)
        report = self.evaluation.maybe_log(step, drafter, self.metrics_file, self.wandb_run)
        if report is not None:
            self.last = {"step": step, "tau": report.tau, "sim_tau": report.sim_tau}

    def collect(self, now_step: int, wait_s: float = 0.0, stop: Any = None) -> bool:
        return False  # every result was logged when it was asked for

    def status(self) -> dict[str, Any]:
        return {"eval": self.last, "evals_in_flight": []}

    def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The coupled baseline: target forward and drafter step in one process."
    )
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s trainer-r{os.environ.get('RANK', 0)} %(levelname)s %(message)s"
    )
    return run_trainer(args.run_dir, source=CoupledSource)


if __name__ == "__main__":
    exit_process(main())

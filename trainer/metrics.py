"""The trainer's metrics: the steps of one log window averaged, the lines of metrics.jsonl and their wandb keys.

Every ``logging.log_every`` steps the loop logs one record: the window's training figures (the step's metrics
every kind computes, ``STEP_METRICS``, and the kind's own, its drafter's ``logged_metrics``), the throughput, and
each producer's statistics. The record is one line of metrics.jsonl, the same figures in wandb under
``wandb_key``'s names, and one line of trainer.log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import torch

from common.config import RunConfig
from common.drafter.base import Drafter
from common.drafter.draft_config import DraftConfig
from common.drafter.model import train_flops
from common.metrics import ProducerStats
from common.rundir import RunDir
from common.status import TrainerStatus
from trainer.feeder import ProducerReport, Received
from trainer.ranks import Ranks
from trainer.sharding import local_parameter_count
from trainer.wandb_run import BackgroundRun, run_id_of, start_run

STEP_METRICS = ("loss", "tau", "grad_norm", "acc", "coverage")
"""The metrics of a step that every drafter kind computes; ``acc`` is a vector, logged as ``acc/k`` for each k."""
STATUS_METRICS = ("loss", "tau", "lr", "tokens_per_s", "samples_per_s", "steps_per_s")
"""The figures of the last record that the status file shows (beside the kind's own)."""
PRODUCER_BATCHING = ("padding_efficiency", "mean_seq_len", "mean_batch_docs", "mean_batch_tokens")
"""A producer's batching statistics that are logged, as ``data/<producer>/<key>``."""


def wandb_key(key: str) -> str:
    """wandb's name of a metrics.jsonl key: training figures (loss, tau, lr, acc/k, ...) under ``train/``; the
    sections that have one (producer/, ring/, data/, eval/) keep it."""
    section = key.split("/", 1)[0] if "/" in key else None
    return key if section in ("producer", "ring", "data", "eval", "train") else f"train/{key}"


class StepFlops:
    """Model FLOPs of a step (forward and backward), for MFU. All but attention depends on the batch's shape
    alone and is cached by its token count; attention is counted from the pairs the step attended."""

    def __init__(self, draft_config: DraftConfig, num_anchors: int) -> None:
        self.draft_config, self.num_anchors = draft_config, num_anchors
        self.by_tokens: dict[int, float] = {}
        self.per_attention_pair = train_flops(draft_config, 0, 0, 1.0)["attention"]

    def __call__(self, received: Received, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
        """A device scalar, read only when logged. Padding is not counted: useful work only."""
        tokens = received.num_tokens
        if tokens not in self.by_tokens:
            self.by_tokens[tokens] = train_flops(self.draft_config, tokens, self.num_anchors, 0.0)["total"]
        return self.by_tokens[tokens] + self.per_attention_pair * metrics["attention_pairs"]


class Window:
    """Metrics of the steps since the last log line; read from the device only when logged."""

    def __init__(self, kind_metrics: tuple[str, ...] = ()) -> None:
        self.averaged = (*STEP_METRICS, *kind_metrics)
        """The step's metrics averaged over the window: the common ones and the drafter kind's own."""
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
        for key in self.averaged:
            value = metrics[key].detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value

    def summary(self) -> dict[str, float]:
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


def producer_metrics(producers: dict[int, ProducerReport]) -> dict[str, float]:
    """Each producer's statistics as metrics.jsonl keys: whether it is connected, its ring's slots by state as a share
    of its slots, the statistics ``ProducerStats`` marks as logged and its batching's ``PRODUCER_BATCHING``."""
    record: dict[str, float] = {}
    for producer, report in sorted(producers.items()):
        stats = report.stats
        prefix = f"producer/{producer}"
        record[f"{prefix}/up"] = int(report.up)
        for state, share in stats.ring.shares().items():
            record[f"ring/{producer}/{state}"] = share
        for name in ProducerStats.logged():
            record[f"{prefix}/{name}"] = getattr(stats, name)
        for key in PRODUCER_BATCHING:  # as the producers send them
            if key in stats.batching:
                record[f"data/{producer}/{key}"] = stats.batching[key]
    return record


class Metrics:
    """Where rank 0's records go: metrics.jsonl and, unless ``logging.wandb_mode`` is disabled, a wandb run (which
    the evaluations' results go to as well). On the other ranks it holds the window alone."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, rank: int, kind_metrics: tuple[str, ...], wandb_id: str | None):
        self.kind_metrics = kind_metrics
        self.wandb_id = wandb_id
        self.wandb: BackgroundRun | None = None
        if rank == 0 and cfg.logging.wandb_mode != "disabled":
            self.wandb_id = wandb_id or run_id_of(run_dir)
            self.wandb = start_run(cfg, run_dir, self.wandb_id)
        self.file = open(run_dir.metrics, "a") if rank == 0 else None
        self.last: dict[str, Any] = {}
        """The last record logged: the status file shows its figures."""
        self.window = Window(kind_metrics)

    def new_window(self) -> None:
        self.window = Window(self.kind_metrics)

    def log(self, record: dict[str, Any]) -> None:
        """One record (its ``step`` and ``time`` included): a line of metrics.jsonl and a wandb step."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(
                {wandb_key(k): v for k, v in record.items() if k not in ("step", "time")}, step=record["step"]
            )
        self.last = record

    def log_window(
        self, step: int, lr: float, device: torch.device, producers: dict[int, ProducerReport]
    ) -> dict[str, Any]:
        """Log the window's record at ``step``: its training figures, the producers' statistics; the record."""
        record = {"step": step, "lr": lr, **self.window.summary(), "time": time.time()}
        if device.type == "cuda":
            # Since the start: a count that rises means the caching allocator had to free its cache and try again
            # (memory pressure, e.g. from a producer sharing the GPU), which costs a synchronisation each time.
            record["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        record.update(producer_metrics(producers))
        self.log(record)
        return record

    def line(self, record: dict[str, Any]) -> str:
        """The record's figures for trainer.log (the step and the budget are the caller's)."""
        return (
            f"  loss {record['loss']:.3f}  tau {record['tau']:.2f}  "
            f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s  starved {record['starved_fraction']:.0%}"
            + "".join(f"  {key} {record[key]:.3f}" for key in self.kind_metrics)
        )

    def status(self) -> dict[str, Any]:
        """The last record's figures that the status file (trainer.json) shows."""
        shown = {key: self.last.get(key) for key in STATUS_METRICS}
        return {**shown, "kind_metrics": {key: self.last[key] for key in self.kind_metrics if key in self.last}}

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class StatusFile:
    """Rank 0's trainer.json (common/status.py ``TrainerStatus``): what stays the same for a trainer's life, written
    with each write's figures."""

    def __init__(self, run_dir: RunDir, incarnation: int, cfg: RunConfig, ranks: Ranks, drafter: Drafter) -> None:
        self.path = run_dir.trainer_status
        self.fixed = TrainerStatus(
            incarnation=incarnation,
            kind=cfg.drafter.kind,
            max_minutes=cfg.training.max_minutes,
            parallelism=ranks.parallelism,
            drafter_params_total=drafter.num_trainable_parameters(),
            drafter_params_per_rank=ranks.gather(local_parameter_count(drafter)),  # shows the sharding
        )

    def sharding(self, rank: int) -> str:
        """The drafter's size and ``rank``'s share of it, for the start's log line."""
        total, held = self.fixed.drafter_params_total, self.fixed.drafter_params_per_rank[rank]
        return f"drafter {total / 1e6:.1f}M parameters, {held / total:.0%} of them on this rank"

    def write(self, state: str, step: int, start_step: int, max_steps: int, trained_s: float, **parts: Any) -> None:
        """``parts``: the components' own fields (the last metrics', the evaluations', the checkpoints')."""
        figures = dict(state=state, step=step, start_step=start_step, max_steps=max_steps, trained_s=trained_s)
        dataclasses.replace(self.fixed, pid=os.getpid(), updated=time.time(), **figures, **parts).write(self.path)

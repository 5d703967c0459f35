"""The coupled baseline: target forward, then drafter step, in one process, one after the other.

This is how today's online trainers work: every step first runs the target on its batch, then
trains the drafter on the captured features, on the same GPU. It exists so that the decoupled
pipeline can be measured against it (``launch/bench_pipeline.py``) with everything else equal: the
same data and batches, the same target capture, the same trainer loop, step, logging and ledger.
Only where a batch comes from differs: ``CoupledSource`` takes the feeder's place.

    python -m trainer.train --run-dir DIR --coupled                      # one GPU
    torchrun --nproc-per-node 2 -m trainer.train --run-dir DIR --coupled  # DDP: rank r reads shard r

A benchmark tool, not a way to train: there are no producers, so nothing survives the process.
"""

from __future__ import annotations

import dataclasses

import torch

from common.batch import PackedBatch
from common.config import ConfigError, RunConfig
from common.rundir import RunDir
from producer.batching import batch_stats
from producer.server import build_plan, export_target_head, feature_layer_ids
from producer.target import Target, build_target_config
from trainer.feeder import Commits, Received, pad_packed


class CoupledSource:
    """Stands in for the ``Feeder``: each ``get`` runs the target on the next batch, in this process."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir, rank: int, world_size: int, device: torch.device) -> None:
        if cfg.training.max_steps == 0:
            raise ConfigError("training.max_steps: the coupled baseline needs an explicit step count")
        target_cfg = dataclasses.replace(cfg.target, device=str(device))
        layer_ids = feature_layer_ids(cfg, build_target_config(target_cfg).num_hidden_layers)
        self.target = Target.load(target_cfg, layer_ids, capture_last_hidden=cfg.training.label_mode != "data")
        if device.type == "cuda":
            self.target.warmup(min(4096, cfg.batching.token_budget))
        if rank == 0 and cfg.target.path is None:
            export_target_head(self.target, run_dir.target_head)
        self.plan = build_plan(cfg, int(self.target.model.config.vocab_size), shard_index=rank, num_shards=world_size)
        self.batches = enumerate(self.plan.iter_batches())
        self.rank = rank
        self.device = device
        self.commits: Commits | None = None
        self.pad_to: int | None = None
        self.refusal: str | None = None
        self.error: BaseException | None = None

    def bind(self, commits: Commits, pad_to: int | None) -> CoupledSource:
        """Attach the trainer's bookkeeping (made after the target is loaded); returns self."""
        self.commits, self.pad_to = commits, pad_to
        return self

    def start(self) -> None:
        pass

    def get(self, timeout: float) -> Received:
        """The next batch with its features, computed now (``timeout`` is ignored: it never waits)."""
        ordinal, (cursor, sample_ids) = next(self.batches)
        batch = self.plan.materialize(cursor, sample_ids)
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in batch.tensors().items()}
        # Outputs made here, outside capture's inference mode, so that autograd may use them.
        target = self.target
        tensors["aux_hidden"] = torch.empty(batch.num_tokens, target.aux_width, dtype=target.dtype, device=self.device)
        if target.capture_last_hidden:
            tensors["last_hidden"] = torch.empty(batch.num_tokens, target.hidden_size, dtype=target.dtype, device=self.device)
        target.capture(batch, out_aux=tensors["aux_hidden"], out_last=tensors.get("last_hidden"))
        if self.pad_to:
            tensors = pad_packed(tensors, self.pad_to)
        stats = batch_stats(batch)
        meta = {"producer": self.rank, "ordinal": ordinal, "cursor": list(cursor), "epoch": cursor.epoch,
                "tokens": batch.num_tokens, "docs": batch.num_docs, "max_doc_len": stats.max_doc_len}
        self.commits.mark_received(self.rank, ordinal, list(cursor))
        return Received(PackedBatch.from_tensors(tensors, epoch=cursor.epoch, meta=meta), self.rank, ordinal,
                        list(cursor), meta, batch.sample_ids.tolist(), batch.num_tokens)

    def producer_stats(self) -> dict[int, dict]:
        return {}

    def close(self) -> None:
        pass

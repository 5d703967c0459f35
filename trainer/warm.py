"""Warm start: what a trainer about to take over builds while the trainer it replaces still trains.

On restart-trainer the new trainer (the launcher's standby, or one started for the restart) waits for the
old one to finish its step and hand its state over. Everything that does not depend on that state is built
before: the target's head on the device, the drafter on the device (its weights are replaced by the state),
its layers compiled and run once, forward and backward, on a synthetic batch of the run's shapes, so that
the first real step finds its kernels built. The Trainer then takes what still fits its configuration (a
restart may change it) and builds the rest as on any start: loading the state is a copy into the drafter
and the optimizer, and the next step runs at full speed.

The cost is memory: a standby holds the head and the drafter's weights on the trainer's GPU while it waits
(6.6 GB for a Qwen3-8B draft). ``training.warm_start = false`` turns it off.
"""

from __future__ import annotations

import logging
import time

import torch

from common.batch import PackedBatch, SlotFormat, document_tensors
from common.codec import DTYPES
from common.config import RunConfig
from common.drafter.draft_config import DraftConfig
from common.drafter.model import build_drafter
from common.hf import target_identity
from common.rundir import RunDir
from trainer import build
from trainer.build import WarmStart
from trainer.sharding import parallelize

log = logging.getLogger(__name__)


def synthetic_batch(cfg: RunConfig, config: DraftConfig, device: torch.device) -> PackedBatch:
    """A batch of the shapes the feeder hands a compiled trainer (``batching.token_budget`` tokens in one
    document), random."""
    tokens = cfg.batching.token_budget
    loss_mask = torch.ones(tokens, dtype=torch.uint8)
    loss_mask[0] = 0
    tensors = document_tensors(
        {
            "input_ids": torch.randint(0, config.vocab_size - 1, (tokens,), dtype=torch.int32),
            "loss_mask": loss_mask,
            "cu_seqlens": torch.tensor([0, tokens], dtype=torch.int32),
            "sample_ids": torch.zeros(1, dtype=torch.int64),
        }
    )
    slot = SlotFormat(
        config.fused_feature_size, config.target_hidden_size, DTYPES[cfg.target.dtype], cfg.ships_final_hidden
    )
    for name, (shape, dtype) in slot.shapes(tokens, 1).items():
        if name not in tensors:  # the target's features
            tensors[name] = torch.randn(shape).to(dtype)
    return PackedBatch.from_tensors(tensors).to(device)


def prepare(cfg: RunConfig, run_dir: RunDir, device: torch.device) -> WarmStart | None:
    """The warm start of a single-process trainer with ``cfg`` on ``device``; None when it is turned off,
    when the head is not there yet, or when building fails (logged: the trainer then builds on its own)."""
    if not cfg.training.warm_start:
        return None
    head_dir = build.head_dir_of(cfg, run_dir)
    if not build.head_is_ready(head_dir):
        return None
    started = time.perf_counter()
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        target_config, head = build.load_head(cfg, head_dir, device)
        identity = target_identity(target_config, head.embed_weight)
        draft_config = build.draft_config_for(cfg, target_config, head_dir)
        loss_config = build.loss_config_of(cfg)
        # initialised where it will train; the state replaces the weights
        drafter = build_drafter(draft_config, head, loss_config, device=device)
        compiled = build.compiles(cfg, device)
        if compiled:
            build.compile_layers(drafter)
        # One forward and backward of a step's shapes: the kernels are compiled (and autotuned) now.
        step = parallelize(drafter, device, 1, False)
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda"
            else torch.autocast("cpu", enabled=False)
        )
        generator = torch.Generator(device=device).manual_seed(0)
        with autocast:
            loss, _ = step(synthetic_batch(cfg, draft_config, device), cfg.drafter.num_anchors, generator, 0.0)
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        del loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the step's activations go back to the GPU the running trainer uses
    except Exception as exc:  # noqa: BLE001 - a warm start is an optimisation: the trainer builds on its own
        log.warning(
            "warm start failed (%s: %s); the trainer builds its drafter when it takes over", type(exc).__name__, exc
        )
        return None
    warm = WarmStart(
        cfg, device, target_config, head, identity, draft_config, drafter, compiled, time.perf_counter() - started
    )
    log.info(
        "warm start: head, drafter%s and a step's kernels ready in %.1f s",
        " (compiled)" if compiled else "",
        warm.seconds,
    )
    return warm

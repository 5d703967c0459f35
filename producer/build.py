"""What a producer starts from: its target, loaded once (on every rank of a tensor-parallel producer, in step) with
its head exported for the trainer, the features it ships, and its shard of the run's data in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from common.codec import DTYPE_NAMES
from common.config import ConfigError, RunConfig
from common.contract import Features
from common.drafter.draft_config import build_target_layer_ids
from common.rundir import RunDir
from producer.data.batching import BatchPlan
from producer.data.build import build_plan, run_sources
from producer.target_model.capture import Target
from producer.target_model.load import build_target_config, check_tensor_parallel
from producer.target_model.tensor_parallel import TensorParallelGroup

WARMUP_TOKENS = 4096
"""The most tokens of the warm-up forward on a GPU, which sizes its kernels and workspaces before the first batch."""


def feature_layer_ids(cfg: RunConfig, num_target_layers: int) -> list[int]:
    """The target layers both sides use: the configured ones, else the docs/dflash.md rule."""
    return list(cfg.drafter.target_layer_ids) or build_target_layer_ids(num_target_layers, cfg.drafter.num_layers)


def export_target_head(target: Target, out_dir: Path) -> None:
    """Save embed_tokens, the final norm and lm_head (and config.json) for the trainer, once.

    Needed when the target has random weights: the drafter must share them bit for bit. A sharded
    target's head is gathered first, always: its followers call ``target.head_tensors()`` with it.
    """
    tensors = target.head_tensors()
    if (out_dir / "model.safetensors").is_file():
        return
    from safetensors.torch import save_file

    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    target.model.config.to_json_file(str(tmp / "config.json"))
    try:
        os.replace(tmp, out_dir)
    except OSError:  # another producer got there first; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def device_setting(cfg: RunConfig, producer_id: int) -> str:
    """Where a producer's devices were set, for error messages."""
    if cfg.launch.producer_devices and producer_id < cfg.launch.local_producers:
        return f"launch.producer_devices[{producer_id}]"
    return "--device"


@contextlib.contextmanager
def _unloadable_target_is_a_config_error(cfg: RunConfig) -> Iterator[None]:
    """A checkpoint that does not load (missing or corrupt shards, a config its model class rejects) fails the
    same way on every try: ConfigError (exit 2). CUDA out-of-memory is a RuntimeError and passes through."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, KeyError, AttributeError, TypeError, SafetensorError) as exc:
        where = f"target.path: {cfg.target.path}" if cfg.target.path else "target: the configured model"
        raise ConfigError(f"{where} cannot be loaded: {type(exc).__name__}: {exc}") from None


def load_target(
    cfg: RunConfig, run_dir: RunDir, producer_id: int, device: str | None, group: TensorParallelGroup | None
) -> Target:
    """The producer's target, and with random weights its head exported for the trainer.

    With a tensor-parallel group every rank runs this, in step: it holds every collective of the
    start (sharded loading, the gathers of the identity and of the head); afterwards rank 0 alone
    decides what the group does.
    """
    target_cfg = dataclasses.replace(cfg.target, device=device) if device else cfg.target
    with _unloadable_target_is_a_config_error(cfg):
        config = build_target_config(target_cfg)
    if group is not None:
        try:
            check_tensor_parallel(config, group.size)
        except ValueError as exc:
            raise ConfigError(f"{device_setting(cfg, producer_id)}: {exc}") from None
    layer_ids = feature_layer_ids(cfg, config.num_hidden_layers)
    with _unloadable_target_is_a_config_error(cfg):
        target = Target.load(target_cfg, layer_ids, capture_last_hidden=cfg.ships_final_hidden, group=group)
    if cfg.target.path is None:
        if group is None or group.rank == 0:
            export_target_head(target, run_dir.target_head)
        else:
            target.head_tensors()  # rank 0's export gathers the sharded head: every rank takes part
    if group is not None:
        group.following = True  # from here on the followers wait for rank 0's messages
    return target


def start_target(
    cfg: RunConfig, run_dir: RunDir, producer_id: int, device: str | None, group: TensorParallelGroup | None
) -> tuple[Target, float]:
    """The serving producer's target (``load_target``), on a GPU made current and warmed up; and the seconds it
    took."""
    started = time.monotonic()
    target = load_target(cfg, run_dir, producer_id, group.device if group is not None else device, group)
    if target.device.type == "cuda":
        torch.cuda.set_device(target.device)
        target.warmup(min(WARMUP_TOKENS, cfg.batching.token_budget))
    return target, time.monotonic() - started


def shipped_features(cfg: RunConfig, target: Target, producer_id: int) -> Features:
    """What this producer ships, as a trainer's HELLO must expect it (common/contract.py)."""
    return Features(
        producer_id=producer_id,
        target_identity=target.identity,
        layer_ids=list(target.layer_ids),
        dtype=DTYPE_NAMES[target.dtype],
        last_hidden=cfg.ships_final_hidden,
        hidden_size=target.hidden_size,
        vocab_size=int(target.model.config.vocab_size),
        token_budget=cfg.batching.token_budget,
    )


def shard_plan(cfg: RunConfig, target: Target, run_dir: RunDir, producer_id: int) -> BatchPlan:
    """This producer's shard of the run's training data (its held-out records left out), in its deterministic order;
    with ``data.regenerate`` their answers written by the target as the stream goes (producer/regenerate.py)."""
    vocab_size = int(target.model.config.vocab_size)
    if cfg.data.regenerate:
        from producer.regenerate import regenerated_source

        source = regenerated_source(cfg, vocab_size, target.model, run_dir, producer_id)
    else:
        source, _ = run_sources(cfg, vocab_size, held_out_file=run_dir.held_out)
    return build_plan(cfg, source, producer_id, cfg.launch.total_producers)

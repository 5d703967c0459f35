"""What a trainer builds its drafter from: the target's frozen head, the draft config, the compiled layers.

Shared by ``Trainer.__init__`` and the warm start (trainer/warm.py), which builds the same things ahead of a
takeover: one place says how, so that what a warm start built is what the trainer would have built.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from common.codec import DTYPES
from common.config import ConfigError, RunConfig
from common.drafter.draft_config import DraftConfig
from common.drafter.export import CONFIG_FILE, WEIGHTS_FILE, config_from_export, drafter_folder
from common.drafter.kinds import build_drafter
from common.drafter.loss import LossConfig
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import TargetHead, load_target_head
from common.hf import text_config_of
from common.rundir import RunDir

log = logging.getLogger(__name__)


def head_dir_of(cfg: RunConfig, run_dir: RunDir) -> Path:
    """The folder of the target's head: the target itself, or the head its first producer exported."""
    return run_dir.head_dir(cfg.target.path)


def head_is_ready(head_dir: Path) -> bool:
    return (head_dir / "config.json").is_file() and any(head_dir.glob("*.safetensors"))


def load_head(cfg: RunConfig, head_dir: Path, device: torch.device) -> tuple[Any, TargetHead]:
    """(the target's text config with the run's overrides, its frozen head on ``device``)."""
    from transformers import AutoConfig

    target_config = text_config_of(AutoConfig.from_pretrained(head_dir))  # a multimodal target's language model
    for key, value in cfg.target.config_overrides.items():
        setattr(target_config, key, value)
    # In the target's dtype: a producer casts a stored target's weights to it while loading, so the
    # drafter shares (and the handshake hashes) that embedding, not the checkpoint's fp32 one.
    return target_config, load_target_head(head_dir, device=device, dtype=DTYPES[cfg.target.dtype])


def draft_config_for(cfg: RunConfig, target_config: Any, head_dir: Path) -> DraftConfig:
    """The drafter the run's ``drafter`` section asks for, on this target."""
    d = cfg.drafter
    overrides = d.draft_overrides()
    tokenizer = None
    mask = d.mask_token_id
    has_tokenizer = any(
        (head_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if has_tokenizer and (mask is None or d.kind == "dflash2"):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(head_dir)
        if d.kind == "dflash2" and len(tokenizer) > int(target_config.vocab_size):
            # The selector's codebooks, and the candidates servers compute, span the target's head; a head cut
            # below its tokenizer (a pruned draft vocabulary) has no DFlash 2 form.
            raise ConfigError(
                f"drafter.kind: dflash2 needs the target's full vocabulary: its tokenizer has "
                f"{len(tokenizer)} tokens, its head {target_config.vocab_size}"
            )
    elif mask is None:
        # No tokenizer (a random target's exported head): the last id, which synthetic data never
        # uses. (transformers would return an empty tokenizer here, whose ids collide with data.)
        mask = int(target_config.vocab_size) - 1
    try:
        config = DraftConfig.from_target(
            target_config, num_draft_layers=d.num_layers, tokenizer=tokenizer, mask_token_id=mask, **overrides
        )
    except ValueError as exc:  # the drafter cannot be built as configured: the same on every try
        message = str(exc)
        raise ConfigError(message if message.startswith("drafter.") else f"drafter.{message}") from None
    if d.mask_token_id is None:
        name = f" {tokenizer.convert_ids_to_tokens(config.mask_token_id)!r}" if tokenizer is not None else ""
        log.info(
            "drafter.mask_token_id unset: the mask token is %d%s (set drafter.mask_token_id to choose another)",
            config.mask_token_id,
            name,
        )
    return config


def loss_config_of(cfg: RunConfig) -> LossConfig:
    """How the run supervises its drafter (the training section, and the drafter kind's own loss options)."""
    return LossConfig(
        label_mode=cfg.training.label_mode,
        gamma=cfg.training.gamma,
        weighting=cfg.training.weighting,
        objective=cfg.training.objective,
        feature_noise=cfg.training.feature_noise,
        selector_loss_alpha=cfg.drafter.selector_loss_alpha,
        selector_missing_gold=cfg.drafter.selector_missing_gold,
        selector_stop_gradient=cfg.drafter.selector_stop_gradient,
    )


def fresh_drafter(
    cfg: RunConfig, config: DraftConfig, head: TargetHead, loss_config: LossConfig, device: torch.device | None = None
) -> DFlashDrafter:
    """The drafter a new run starts from: initialised, or ``drafter.init_from``'s weights (a DFlash 2 drafter from
    a DFlash one gets identity convolutions and a no-op selector). ConfigError, naming the key, when they cannot be."""
    drafter = build_drafter(config, head, loss_config, device=device)
    if cfg.drafter.init_from is None:
        return drafter
    folder, own = drafter_folder(Path(cfg.drafter.init_from))
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"drafter.init_from: {cfg.drafter.init_from} is neither a checkpoint (step-N) nor an export "
            f"(no {CONFIG_FILE} and {WEIGHTS_FILE} in it)"
        )
    source = config_from_export(json.loads((folder / CONFIG_FILE).read_text()), own)
    for name in ("target_layer_ids", "mask_token_id", "hidden_size", "num_hidden_layers", "vocab_size"):
        if getattr(source, name) != getattr(config, name):
            raise ConfigError(
                f"drafter.init_from: {cfg.drafter.init_from} has {name} {getattr(source, name)}, this "
                f"run's drafter {getattr(config, name)}"
            )
    param = next(drafter.parameters())
    state = {k: v.to(param.dtype) for k, v in load_file(str(folder / WEIGHTS_FILE), device=str(param.device)).items()}
    try:
        drafter.warm_start(state)
    except (ValueError, RuntimeError) as exc:  # another kind or shape: the same on every try
        raise ConfigError(
            f"drafter.init_from: a {source.kind} drafter cannot start this run's {config.kind} "
            f"drafter: {str(exc).splitlines()[0]}"
        ) from None
    log.info("drafter.init_from: the %s drafter starts from the %s drafter in %s", config.kind, source.kind, folder)
    return drafter


def compiles(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the draft layers are compiled: ``training.compile``, or on CUDA only when it is unset."""
    return cfg.training.compile if cfg.training.compile is not None else device.type == "cuda"


def compile_layers(drafter: DFlashDrafter) -> None:
    """Fuses norms, rotary and SwiGLU per layer. Batches are padded to the token budget (see pad_packed),
    so shapes are fixed and each kernel is compiled once. Under FSDP the compiled layer runs between
    FSDP's gather and reshard hooks, which dynamo leaves eager."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)

"""What a trainer builds its drafter from: the target's frozen head, the draft config, the compiled layers.

Shared by ``Trainer.__init__`` and the warm start (trainer/warm.py), which builds the same things ahead of a
takeover: one place says how, so that what a warm start built is what the trainer would have built.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from common.config import ConfigError, RunConfig
from common.codec import DTYPES
from common.hf import text_config_of
from common.rundir import RunDir
from common.drafter.draft_config import DraftConfig
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import TargetHead, load_target_head

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
    overrides = {"block_size": d.block_size, "in_block_causality": d.in_block_causality}
    if d.target_layer_ids:
        overrides["target_layer_ids"] = list(d.target_layer_ids)
    if d.layer_types:
        overrides["layer_types"] = list(d.layer_types)
    if d.sliding_window is not None:
        overrides["sliding_window"] = d.sliding_window
    for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads"):
        if getattr(d, name) is not None:
            overrides[name] = getattr(d, name)
    tokenizer = None
    mask = d.mask_token_id
    has_tokenizer = any((head_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    if mask is None and has_tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(head_dir)
    elif mask is None:
        # No tokenizer (a random target's exported head): the last id, which synthetic data never
        # uses. (transformers would return an empty tokenizer here, whose ids collide with data.)
        mask = int(target_config.vocab_size) - 1
    try:
        config = DraftConfig.from_target(target_config, num_draft_layers=d.num_layers, tokenizer=tokenizer,
                                         mask_token_id=mask, **overrides)
    except ValueError as exc:  # the drafter cannot be built as configured: the same on every try
        message = str(exc)
        raise ConfigError(message if message.startswith("drafter.") else f"drafter.{message}") from None
    if d.mask_token_id is None:
        name = f" {tokenizer.convert_ids_to_tokens(config.mask_token_id)!r}" if tokenizer is not None else ""
        log.info("drafter.mask_token_id unset: the mask token is %d%s (set drafter.mask_token_id to choose another)",
                 config.mask_token_id, name)
    return config


def compiles(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the draft layers are compiled: ``training.compile``, or on CUDA only when it is unset."""
    return cfg.training.compile if cfg.training.compile is not None else device.type == "cuda"


def compile_layers(drafter: DFlashDrafter) -> None:
    """Fuses norms, rotary and SwiGLU per layer. Batches are padded to the token budget (see pad_packed),
    so shapes are fixed and each kernel is compiled once. Under FSDP the compiled layer runs between
    FSDP's gather and reshard hooks, which dynamo leaves eager."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)

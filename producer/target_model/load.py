"""Loading the target: its transformers config, its weights (stored or seeded, whole or this rank's tensor-parallel
shards), and what the rest of the producer reads off the loaded model (its stop tokens, its head).

A multimodal checkpoint (``Qwen3_5ForConditionalGeneration``) loads its language model only. Tensor parallel
(``load_target_model(cfg, tensor_parallel=N)`` on each rank of an initialised process group, see
producer/target_model/tensor_parallel.py): the model is sharded by transformers' own plan for its type (q/k/v and gate/up
column-wise, o/down row-wise with an all-reduce, the embedding by vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.codec import DTYPES
from common.config import TargetConfig
from common.drafter.target_head import TargetHead
from common.hf import text_config_of
from producer.target_model.attention import PACKED_ATTENTION_NAME, register_packed_attention

# The tiny default target: a Qwen3 that runs anywhere in milliseconds.
TINY_TARGET_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def resolve_device(cfg: TargetConfig) -> torch.device:
    """``cfg.device`` with ``auto`` made concrete: cuda when available, else cpu."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


class UnsupportedTarget(ValueError):
    """A target this producer cannot capture from: the same on every try, so the run stops (exit 2)."""


WEIGHT_SHAPE_KEYS = frozenset(
    {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"}
)
"""Config fields that set the shapes of stored weights: an override may not change them for target.path
(num_hidden_layers may: fewer layers load a prefix of the stored ones)."""


def build_target_config(cfg: TargetConfig):
    """The transformers config the target is built from (the path's, the json's or the tiny default)."""
    from transformers import AutoConfig

    if cfg.path is not None:
        # A multimodal checkpoint (Qwen3.5's ForConditionalGeneration): its language model's config.
        config = text_config_of(AutoConfig.from_pretrained(cfg.path))
        for key, value in cfg.config_overrides.items():
            stored = getattr(config, key, None)
            if key in WEIGHT_SHAPE_KEYS and stored is not None and stored != value:
                # Else transformers fails deep in loading, on every restart, with a size-mismatch report.
                raise ValueError(
                    f"target.config_overrides.{key}={value!r} contradicts the stored target's {key}={stored!r} "
                    f"({cfg.path}/config.json): its weights would not fit. Drop the override (launch/tiny.toml sets "
                    f"vocab_size for the tiny default: pass target.config_overrides={{}} with target.path)"
                )
            setattr(config, key, value)
        return config
    if cfg.config_json is not None:
        fields = json.loads(Path(cfg.config_json).read_text())
    else:
        fields = dict(TINY_TARGET_CONFIG)
    fields.update(cfg.config_overrides)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("TargetConfig.config_json: the config has no 'model_type'")
    return text_config_of(AutoConfig.for_model(model_type, **fields))


def check_tensor_parallel(config, size: int) -> None:
    """Raise ValueError, naming the numbers, unless transformers can shard this target over ``size`` devices."""
    import transformers

    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"target model type {config.model_type!r} has no tensor-parallel plan in transformers "
            f"{transformers.__version__} (its config's base_model_tp_plan is empty): run it on one device"
        )
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    undivided = [name for name, count in (("attention heads", heads), ("key/value heads", kv_heads)) if count % size]
    if undivided:
        raise ValueError(
            f"tensor parallelism over {size} devices shards whole heads: {size} must divide the target's attention "
            f"heads ({heads}) and key/value heads ({kv_heads}), and does not divide the {' nor the '.join(undivided)}"
        )


def load_target_model(cfg: TargetConfig, tensor_parallel: int = 1) -> nn.Module:
    """The target as an eval-mode HF causal LM on ``cfg``'s device, its attention set to the packed kernel.

    From ``cfg.path`` the stored weights are loaded straight onto the device. Otherwise the weights are
    random (HF's own init, seeded by ``cfg.seed``) and are created on the device directly, so an
    8B-shaped target never passes through host memory.

    ``tensor_parallel`` > 1: this rank's shards, by transformers' tensor-parallel plan, in the process
    group every rank of the group has joined (``cfg.device`` is this rank's device). From a path each
    rank reads only its shards. Random weights are made whole on every rank by the same seeded init as
    on one device, then sharded: every rank holds consistent shards of the very model a one-device
    producer of the same seed builds (same ``target_identity``, on the same kind of device), so
    producers of one run agree whatever their degree. The whole model must then fit one device while
    loading.
    """
    from transformers import AutoModelForCausalLM

    register_packed_attention()
    device = resolve_device(cfg)
    dtype = DTYPES[cfg.dtype]
    config = build_target_config(cfg)
    sharding = _sharding(config, tensor_parallel) if tensor_parallel > 1 else None
    if cfg.path is not None and sharding is None:
        placement = {"device_map": str(device)} if device.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=config, dtype=dtype, attn_implementation="sdpa", **placement
        ).to(device)
    elif cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=config, dtype=dtype, attn_implementation="sdpa", distributed_config=sharding
        )
    else:
        config._attn_implementation = "sdpa"
        # A private RNG stream: the seed fixes the weights without resetting the caller's generators.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if sharding is not None:
            whole = model
            model = type(whole).from_pretrained(
                None,
                config=whole.config,
                state_dict=whole.state_dict(),
                dtype=dtype,
                attn_implementation="sdpa",
                distributed_config=sharding,
            )
            del whole
    if sharding is not None and next(model.parameters()).device != device:
        # transformers puts rank r on accelerator r; the producer makes the group's GPUs the visible ones.
        raise ValueError(f"tensor-parallel shards landed on {next(model.parameters()).device}, expected {device}")
    model.config._attn_implementation = PACKED_ATTENTION_NAME
    return model.eval().requires_grad_(False)


def _sharding(config, size: int):
    """transformers' DistributedConfig for ``size``-way tensor parallelism by the model's own plan (checked)."""
    check_tensor_parallel(config, size)
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        import transformers

        raise ValueError(
            f"tensor parallelism needs transformers' DistributedConfig (transformers >= 5), "
            f"found transformers {transformers.__version__}"
        ) from exc
    return DistributedConfig(tp_size=size)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one rank's shard of a tensor-parallel parameter (a DTensor)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or all of a sharded one: a collective that every rank of the group must join."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def stop_tokens_of(model: nn.Module) -> frozenset[int]:
    """The target's end-of-sequence ids (none for a config without them)."""
    eos = getattr(model.config, "eos_token_id", None)
    return frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])


def target_head_of(model: nn.Module) -> TargetHead:
    """The loaded target's own embedding, final norm and lm_head (bit-identical by construction)."""
    base = model.get_decoder()
    return TargetHead(
        base.embed_tokens.weight,
        model.get_output_embeddings().weight,
        base.norm.weight,
        float(getattr(model.config, "rms_norm_eps", 1e-6)),
    )

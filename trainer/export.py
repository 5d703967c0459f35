"""Export a drafter for serving (z-lab native and speculators formats) and load either back.

Both formats store the same safetensors names (no ``model.`` prefix, no embedding / lm_head: they
are the target's): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer i
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``.
They differ in config.json, and in the layer numbering of the target features: z-lab
``dflash_config.target_layer_ids`` are decoder layers k; speculators ``aux_hidden_state_layer_ids``
are k + 1 (hidden-state index, 0 being the embedding output).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from trainer.draft_config import SLIDING_ATTENTION, DraftConfig, target_rope_parameters
from trainer.loss import LossConfig
from trainer.model import DFlashDrafter
from trainer.target_head import TargetHead

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def qwen3_fields(config: DraftConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3 part of a draft config.json (the draft layers as a Qwen3 decoder stack)."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    return {
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling if rope_type != "default" else None,
        "rope_parameters": dict(config.rope_parameters),
        "vocab_size": config.vocab_size,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "use_sliding_window": SLIDING_ATTENTION in config.layer_types,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.num_hidden_layers,
        "initializer_range": 0.02,
        "torch_dtype": _dtype_name(dtype),
    }


def zlab_config(config: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json of the z-lab native format (vLLM ``method: dflash``)."""
    return {
        **qwen3_fields(config, dtype),
        "architectures": ["DFlashDraftModel"],
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
    }


def speculators_config(config: DraftConfig, verifier_name_or_path: str,
                       verifier_architectures: list[str] | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json of the speculators format (``vllm serve DIR``)."""
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path, "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": qwen3_fields(config, dtype),
        "aux_hidden_state_layer_ids": [k + 1 for k in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "draft_vocab_size": config.vocab_size,
        "num_target_layers": config.num_target_layers,
        "torch_dtype": _dtype_name(dtype),
    }


def _save(drafter: DFlashDrafter, out_dir: str | Path, config_json: dict[str, Any], dtype: torch.dtype | None,
          weights: dict[str, torch.Tensor] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = drafter.state_dict() if weights is None else weights
    tensors = {name: t.detach().to(dtype or t.dtype).contiguous().cpu() for name, t in weights.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    return out


def export_zlab(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16,
                weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the z-lab native format; ``dtype=None`` keeps the parameters' dtype. ``weights``: the
    drafter's whole state dict when the drafter itself holds only a shard of it (FSDP)."""
    param_dtype = dtype or drafter.fc.weight.dtype
    return _save(drafter, out_dir, zlab_config(drafter.config, param_dtype), dtype, weights)


def export_speculators(drafter: DFlashDrafter, out_dir: str | Path, verifier_name_or_path: str,
                       verifier_architectures: list[str] | None = None,
                       dtype: torch.dtype | None = torch.bfloat16) -> Path:
    """Write the speculators format; ``dtype=None`` keeps the parameters' dtype."""
    param_dtype = dtype or drafter.fc.weight.dtype
    config_json = speculators_config(drafter.config, verifier_name_or_path, verifier_architectures, param_dtype)
    return _save(drafter, out_dir, config_json, dtype)


def _draft_fields(qwen3: dict[str, Any]) -> dict[str, Any]:
    return dict(
        hidden_size=qwen3["hidden_size"], intermediate_size=qwen3["intermediate_size"],
        num_hidden_layers=qwen3["num_hidden_layers"], num_attention_heads=qwen3["num_attention_heads"],
        num_key_value_heads=qwen3["num_key_value_heads"],
        head_dim=qwen3.get("head_dim") or qwen3["hidden_size"] // qwen3["num_attention_heads"],
        vocab_size=qwen3["vocab_size"], rms_norm_eps=qwen3.get("rms_norm_eps", 1e-6),
        layer_types=list(qwen3.get("layer_types") or []), sliding_window=qwen3.get("sliding_window"),
        rope_parameters=target_rope_parameters(SimpleNamespace(**qwen3)),
        max_position_embeddings=qwen3.get("max_position_embeddings", 40960),
        attention_bias=qwen3.get("attention_bias", False),
    )


def config_from_export(config_json: dict[str, Any]) -> DraftConfig:
    """DraftConfig from an exported config.json of either format."""
    if config_json.get("speculators_model_type") == "dflash":
        fields = _draft_fields(config_json["transformer_layer_config"])
        layer_ids = [i - 1 for i in config_json["aux_hidden_state_layer_ids"]]
        mask_token_id = config_json["mask_token_id"]
    elif "dflash_config" in config_json:
        fields = _draft_fields(config_json)
        layer_ids = list(config_json["dflash_config"]["target_layer_ids"])
        mask_token_id = config_json["dflash_config"]["mask_token_id"]
    else:
        raise ValueError("config.json is neither a speculators dflash config nor a z-lab DFlashDraftModel config")
    return DraftConfig(
        **fields,
        target_hidden_size=config_json.get("target_hidden_size") or fields["hidden_size"],
        num_target_layers=config_json.get("num_target_layers") or max(layer_ids) + 1,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        block_size=config_json["block_size"],
    )


def load_drafter(path: str | Path, target_head: TargetHead, loss_config: LossConfig | None = None,
                 attention_backend: str | None = None) -> DFlashDrafter:
    """Rebuild a drafter from an export of either format (weights keep their stored dtype)."""
    path = Path(path)
    config = config_from_export(json.loads((path / CONFIG_FILE).read_text()))
    state = load_file(str(path / WEIGHTS_FILE))
    drafter = DFlashDrafter(config, target_head, loss_config, attention_backend)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        drafter.to(dtypes.pop())  # the target head keeps its own dtype
    drafter.load_state_dict(state, strict=True)
    return drafter

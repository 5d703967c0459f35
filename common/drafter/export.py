"""Export a drafter for serving (z-lab native and speculators formats) and load either back.

Both formats store the same safetensors names (no ``model.`` prefix, no embedding / lm_head: they
are the target's): ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and per layer i
``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``.
They differ in config.json, and in the layer numbering of the target features: z-lab
``dflash_config.target_layer_ids`` are decoder layers k; speculators ``aux_hidden_state_layer_ids``
are k + 1 (hidden-state index, 0 being the embedding output).

In-block causality (``DraftConfig.in_block_causality``) is stated so that each server runs the mask the
drafter trained with. A server decides it per layer from config.json; with nothing stated, sliding
layers are causal inside the block and full layers bidirectional, which is our default and needs only
``layer_types``. Otherwise the z-lab format says ``is_causal`` (SGLang, z-lab's model, newer vLLM) and
``dflash_config.causal`` (vLLM) for every layer; the speculators format has one flag,
``sliding_window_non_causal``, which vLLM applies to every layer, so a drafter whose layers differ
cannot be written in it and its export is refused. ``in_block_causality`` itself is written too, so
that loading an export back never guesses.

A checkpoint is exported with ``python -m trainer.export`` (trainer/export.py).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.codec import DTYPE_NAMES
from common.drafter.base import Drafter
from common.drafter.draft_config import (
    BIDIRECTIONAL,
    FULL_ATTENTION,
    IN_BLOCK_CAUSALITY,
    SLIDING_ATTENTION,
    DraftConfig,
    causal_in_block,
    target_rope_parameters,
)
from common.drafter.kind import DEFAULT_KIND
from common.drafter.kinds import KINDS, kind_of, kind_of_export
from common.drafter.loss import LossConfig
from common.drafter.model import build_drafter
from common.drafter.target_head import TargetHead

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_METADATA = {"format": "pt"}
CONFIG_FILE = "config.json"
CAUSALITY_KEY = "in_block_causality"
"""Our own statement of the in-block causality, in both formats (servers read their own fields)."""

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """A drafter that a serving format cannot describe faithfully."""


def _default_causal(layer_type: str) -> bool:
    """What every server assumes when config.json states nothing: sliding layers causal, full ones not."""
    return layer_type == SLIDING_ATTENTION


def zlab_causality_fields(config: DraftConfig) -> dict[str, Any]:
    """config.json fields of the z-lab format that make each server run the trained in-block causality."""
    causal = config.causal_per_layer
    if causal == [_default_causal(t) for t in config.layer_types]:
        return {}  # layer_types alone says it
    if len(set(causal)) != 1:
        raise ExportError(
            f"in_block_causality {config.in_block_causality!r} over layer_types {config.layer_types}: "
            "the z-lab format states either the layer-type default or one causality for every layer"
        )
    return {"is_causal": causal[0], "dflash_config": {"causal": causal[0]}}


def speculators_causality_fields(config: DraftConfig) -> dict[str, Any]:
    """The speculators format's ``sliding_window_non_causal``, or ExportError where it cannot say what was trained.

    speculators itself makes sliding layers causal unless the flag is set and full layers always bidirectional;
    vLLM turns the flag (absent: True) into ``dflash_config.causal = not flag`` for every layer. Both agree only
    when every layer has the same in-block causality, and full layers are never causal.
    """
    causal = config.causal_per_layer
    if not any(causal):
        return {"sliding_window_non_causal": True}
    if all(causal) and FULL_ATTENTION not in config.layer_types:
        return {"sliding_window_non_causal": False}
    raise ExportError(
        f"the speculators format cannot describe this drafter (layer_types {config.layer_types}, in_block_causality "
        f"{config.in_block_causality!r}): its one flag sliding_window_non_causal becomes vLLM's dflash_config.causal "
        "for every layer, and speculators keeps full layers bidirectional. Export the z-lab format "
        "(--format zlab; vLLM method 'dflash', SGLang), or train with drafter.in_block_causality = bidirectional"
    )


def resolve_in_block_causality(layer_types: list[str], causal: list[bool]) -> str:
    """The ``in_block_causality`` mode whose per-layer causality is ``causal`` (ValueError if none is)."""
    for mode in IN_BLOCK_CAUSALITY:
        if [causal_in_block(mode, t) for t in layer_types] == list(causal):
            return mode
    raise ValueError(f"in-block causality {causal} over layer_types {layer_types} is none of {IN_BLOCK_CAUSALITY}")


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
        "torch_dtype": DTYPE_NAMES[dtype],
    }


def zlab_config(config: DraftConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json of the z-lab native format (vLLM ``method: dflash``; the kind's architecture, and its own fields
    in ``dflash_config`` beside the mask token and the target layers)."""
    causality = zlab_causality_fields(config)
    kind = kind_of(config.kind)
    return {
        **qwen3_fields(config, dtype),
        **{k: v for k, v in causality.items() if k != "dflash_config"},
        "architectures": [kind.zlab_architecture],
        "block_size": config.block_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            **config.options.export_fields(),
            **causality.get("dflash_config", {}),
        },
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        CAUSALITY_KEY: config.in_block_causality,
    }


def speculators_config(
    config: DraftConfig,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """config.json of the speculators format (``vllm serve DIR``)."""
    kind = kind_of(config.kind)
    return {
        "speculators_model_type": kind.speculators_type,
        "architectures": [kind.speculators_architecture],
        **config.options.export_fields(),
        "speculators_config": {
            "algorithm": kind.speculators_type,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
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
        "torch_dtype": DTYPE_NAMES[dtype],
        **speculators_causality_fields(config),
        CAUSALITY_KEY: config.in_block_causality,
    }


def write_export(
    config_json: dict[str, Any], weights: dict[str, torch.Tensor], out_dir: str | Path, dtype: torch.dtype | None
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype or t.dtype).contiguous().cpu() for name, t in weights.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata=WEIGHTS_METADATA)
    write_config(config_json, out)
    # safetensors writes 0600 whatever the umask: a server running as another user could not read the export.
    os.chmod(out / WEIGHTS_FILE, (out / CONFIG_FILE).stat().st_mode & 0o777)
    return out


def write_config(config_json: dict[str, Any], out_dir: Path) -> None:
    """An export's config.json."""
    (out_dir / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")


def export_zlab(
    drafter: Drafter,
    out_dir: str | Path,
    dtype: torch.dtype | None = torch.bfloat16,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the z-lab native format; ``dtype=None`` keeps the parameters' dtype. ``weights``: the
    drafter's whole state dict when the drafter itself holds only a shard of it (FSDP)."""
    param_dtype = dtype or drafter.fc.weight.dtype
    weights = drafter.state_dict() if weights is None else weights
    return write_export(zlab_config(drafter.config, param_dtype), weights, out_dir, dtype)


def export_speculators(
    drafter: Drafter,
    out_dir: str | Path,
    verifier_name_or_path: str,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """Write the speculators format; ``dtype=None`` keeps the parameters' dtype. ExportError (before
    anything is written) when the format cannot state the drafter's in-block causality."""
    param_dtype = dtype or drafter.fc.weight.dtype
    config_json = speculators_config(drafter.config, verifier_name_or_path, verifier_architectures, param_dtype)
    return write_export(config_json, drafter.state_dict(), out_dir, dtype)


def _draft_fields(qwen3: dict[str, Any]) -> dict[str, Any]:
    return dict(
        hidden_size=qwen3["hidden_size"],
        intermediate_size=qwen3["intermediate_size"],
        num_hidden_layers=qwen3["num_hidden_layers"],
        num_attention_heads=qwen3["num_attention_heads"],
        num_key_value_heads=qwen3["num_key_value_heads"],
        head_dim=qwen3.get("head_dim") or qwen3["hidden_size"] // qwen3["num_attention_heads"],
        vocab_size=qwen3["vocab_size"],
        rms_norm_eps=qwen3.get("rms_norm_eps", 1e-6),
        layer_types=list(qwen3.get("layer_types") or []),
        sliding_window=qwen3.get("sliding_window"),
        rope_parameters=target_rope_parameters(SimpleNamespace(**qwen3)),
        max_position_embeddings=qwen3.get("max_position_embeddings", 40960),
        attention_bias=qwen3.get("attention_bias", False),
    )


def _served_causality(config_json: dict[str, Any], layer_types: list[str]) -> list[bool]:
    """Per layer, the in-block causality a config.json written elsewhere states, read as its format's own
    trainer reads it: z-lab ``is_causal``, else ``dflash_config.causal``, else the layer-type default;
    speculators: sliding layers causal unless ``sliding_window_non_causal``, full layers bidirectional (the flag left
    out means what the kind's ``speculators_sliding_non_causal`` says, as speculators' own configs default it)."""
    kind = kind_of_export(config_json)
    if kind is not None and "speculators_model_type" in config_json:
        non_causal = config_json.get("sliding_window_non_causal", kind.speculators_sliding_non_causal)
        return [t == SLIDING_ATTENTION and not non_causal for t in layer_types]
    explicit = config_json.get("is_causal", (config_json.get("dflash_config") or {}).get("causal"))
    return [bool(explicit) if explicit is not None else _default_causal(t) for t in layer_types]


def config_from_export(config_json: dict[str, Any], own_checkpoint: bool = False) -> DraftConfig:
    """DraftConfig from an exported config.json of either format.

    ``own_checkpoint``: the config is a drafter/ folder of this project's checkpoints. One without
    ``in_block_causality`` was written before that setting existed, when every layer trained
    bidirectionally inside the block, and is read so (a foreign export is read by its format's rules).
    """
    kind = kind_of_export(config_json)
    if kind is not None and "speculators_model_type" in config_json:
        fields = _draft_fields(config_json["transformer_layer_config"])
        layer_ids = [i - 1 for i in config_json["aux_hidden_state_layer_ids"]]
        mask_token_id = config_json["mask_token_id"]
        kind_fields = {name: config_json[name] for name in kind.options.names() if name in config_json}
    elif "dflash_config" in config_json:
        kind = kind or kind_of(DEFAULT_KIND)  # a config without architectures, as this project wrote before the kinds
        fields = _draft_fields(config_json)
        layer_ids = list(config_json["dflash_config"]["target_layer_ids"])
        mask_token_id = config_json["dflash_config"]["mask_token_id"]
        kind_fields = {
            name: config_json["dflash_config"][name]
            for name in kind.options.names()
            if name in config_json["dflash_config"]
        }
    else:
        raise ValueError(
            "config.json is neither a speculators config nor a z-lab config of a drafter kind this installation knows "
            f"(speculators_model_type {sorted(k.speculators_type for k in KINDS.values())}, architectures "
            f"{sorted(k.zlab_architecture for k in KINDS.values())})"
        )
    layer_types = fields["layer_types"] or [FULL_ATTENTION] * fields["num_hidden_layers"]
    if CAUSALITY_KEY in config_json:
        causality = config_json[CAUSALITY_KEY]
    elif own_checkpoint:
        causality = BIDIRECTIONAL
    else:
        causality = resolve_in_block_causality(layer_types, _served_causality(config_json, layer_types))
    return DraftConfig(
        **fields,
        target_hidden_size=config_json.get("target_hidden_size") or fields["hidden_size"],
        num_target_layers=config_json.get("num_target_layers") or max(layer_ids) + 1,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        block_size=config_json["block_size"],
        in_block_causality=causality,
        kind=kind.name,
        options=kind_fields,
    )


def load_drafter(
    path: str | Path,
    target_head: TargetHead,
    loss_config: LossConfig | None = None,
    attention_backend: str | None = None,
    own_checkpoint: bool = False,
    device: torch.device | str | None = None,
) -> Drafter:
    """Rebuild a drafter from an export of either format (weights keep their stored dtype).
    ``own_checkpoint``: see :func:`config_from_export`. ``device``: built and read straight onto it (a drafter
    built on the host first spends its random initialisation there: 21 s for the Qwen3-8B draft on 2 cores)."""
    path = Path(path)
    device = torch.device(device) if device is not None else None
    state = load_file(str(path / WEIGHTS_FILE), device=str(device) if device is not None else "cpu")
    return drafter_from_state(
        json.loads((path / CONFIG_FILE).read_text()),
        state,
        target_head,
        loss_config,
        attention_backend,
        own_checkpoint,
        device=device,
    )


def drafter_from_state(
    config_json: dict[str, Any],
    state: dict[str, torch.Tensor],
    target_head: TargetHead,
    loss_config: LossConfig | None = None,
    attention_backend: str | None = None,
    own_checkpoint: bool = True,
    device: torch.device | None = None,
) -> Drafter:
    """A drafter from an export's config.json contents and its weights (copied: ``state`` stays the caller's).
    ``device``: built there (the weights are copied straight onto it); else on the default device."""
    config = config_from_export(config_json, own_checkpoint)
    drafter = build_drafter(config, target_head, loss_config, attention_backend, device)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) == 1:
        drafter.to(dtypes.pop())  # the target head keeps its own dtype
    drafter.load_state_dict(state, strict=True)
    return drafter


def drafter_folder(path: Path) -> tuple[Path, bool]:
    """(the folder holding the drafter's config.json, whether it is one of this project's checkpoints):
    a checkpoint (``step-N``) holds its drafter in ``drafter/``; anything else is taken as an export."""
    inner = path / "drafter"
    return (inner, True) if (inner / CONFIG_FILE).is_file() else (path, False)

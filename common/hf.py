"""Facts about a target's Hugging Face config that producer and trainer both need."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

# Keys of config.to_dict() that describe how a model was loaded, not what it is.
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "_attn_implementation",
        "_attn_implementation_internal",
        "_experts_implementation",
        "_experts_implementation_internal",
        "dtype",
        "torch_dtype",
        "use_cache",
    }
)
# Model types whose RMSNorm scales by (1 + weight), computed in fp32 (weights stored zero-centred).
ZERO_CENTERED_NORM_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})


def text_config_of(config: Any) -> Any:
    """The language model's config: a multimodal config's text part (Qwen3.5 is saved as
    ``Qwen3_5ForConditionalGeneration``), or the config itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def text_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """``text_config_of`` for a config.json read as a dict."""
    return config.get("text_config") or config


def zero_centered_norm(model_type: str | None) -> bool:
    """Whether the final norm of a target of ``model_type`` scales by ``1 + weight``."""
    return model_type in ZERO_CENTERED_NORM_TYPES


def target_identity(config, embed_weight: torch.Tensor) -> str:
    """Stable identity of a target, compared at the producer/trainer handshake.

    ``{model_type}-L{layers}-H{hidden}-cfg{hash of the config's content}-emb{hash of embed_tokens}``.
    The embedding hash covers every byte of the weight in its stored dtype: the drafter shares that
    embedding, so it must be bit-identical on both sides.
    """
    fields = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    weight = embed_weight.detach().contiguous().cpu()
    embed_digest = hashlib.sha256(str(weight.dtype).encode() + str(tuple(weight.shape)).encode())
    embed_digest.update(weight.view(torch.uint8).numpy().tobytes())
    return (
        f"{config.model_type}-L{config.num_hidden_layers}-H{config.hidden_size}"
        f"-cfg{config_hash[:16]}-emb{embed_digest.hexdigest()[:16]}"
    )

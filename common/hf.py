"""Facts about a target's Hugging Face config that producer and trainer both need."""

from __future__ import annotations

from typing import Any

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

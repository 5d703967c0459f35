"""Tiny random Qwen3.5 targets (hybrid Gated-DeltaNet), saved with save_pretrained as users' checkpoints are."""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=1024,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
MOE = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
FORMS = ("multimodal", "text", "moe")


def _randomize_norms(model: torch.nn.Module) -> None:
    """Qwen3.5's norms are zero-centred (scale 1 + w) and start at 0: perturb them so a wrong formula shows."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.2)


def tiny_qwen35(directory: Path, form: str = "multimodal", seed: int = 0) -> Path:
    """A random Qwen3.5 target: ``multimodal`` (Qwen3_5ForConditionalGeneration, text under
    model.language_model, a vision tower beside it), ``text`` (Qwen3_5ForCausalLM) or ``moe``
    (Qwen3_5MoeForConditionalGeneration)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    torch.manual_seed(seed)
    if form == "multimodal":
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION))
    elif form == "text":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TEXT))
    elif form == "moe":
        model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=MOE, vision_config=VISION))
    else:
        raise ValueError(form)
    _randomize_norms(model)
    model.save_pretrained(directory)
    return Path(directory)


def reference_model(directory: Path):
    """The checkpoint as transformers loads it for generation (AutoModelForCausalLM: the language model)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

"""The DFlash draft model configuration, derived from the target's Hugging Face config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common.drafter.kind import DEFAULT_KIND
from common.drafter.kinds import kind_of

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# In-block causality: which layers see only the earlier slots of their own block.
SLIDING_CAUSAL = "sliding_causal"
"""Sliding layers causal inside the block, full layers bidirectional: what vLLM, SGLang and speculators
serve when a config says nothing else, and how the released mixed drafts were trained."""
BIDIRECTIONAL = "bidirectional"
"""Every layer bidirectional inside the block (z-lab's HF model; this project before the setting existed)."""
CAUSAL = "causal"
"""Every layer causal inside the block."""
IN_BLOCK_CAUSALITY = (SLIDING_CAUSAL, BIDIRECTIONAL, CAUSAL)
# The hybrid Gated-DeltaNet Qwen family (Qwen3.5, Qwen3.6; dense and mixture-of-experts): drafts of the released shape.
HYBRID_QWEN_TYPES = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})


def causal_in_block(in_block_causality: str, layer_type: str) -> bool:
    """Whether a layer of ``layer_type`` sees only the earlier slots of its own block under that setting."""
    if in_block_causality == SLIDING_CAUSAL:
        return layer_type == SLIDING_ATTENTION
    return in_block_causality == CAUSAL


def _target_shape(text: Any) -> dict[str, Any]:
    """The draft layers' shape where it follows the target's (Qwen3-like): its MLP width, heads and rotary."""
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    return dict(
        intermediate_size=int(text.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        rope_parameters=target_rope_parameters(text),
    )


def _hybrid_qwen_shape(text: Any, num_layers: int) -> dict[str, Any]:
    """The released draft's shape for a Qwen3.5 / Qwen3.6 target (z-lab Qwen3.6-27B-DFlash): plain Qwen3 layers of
    the target's width, 32 heads / 8 key-value heads of 128 (not the target's gated 256-wide heads), the last layer
    full and the others sliding over 2048 tokens, full rotary at the target's theta (not its partial, multimodal
    rotary). A mixture-of-experts target, which has no dense MLP width, gets a SwiGLU three times its hidden size
    (our choice: no released draft fixes it)."""
    dense = getattr(text, "intermediate_size", None)
    return dict(
        intermediate_size=int(dense) if dense else 3 * int(text.hidden_size),
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        layer_types=[SLIDING_ATTENTION] * (num_layers - 1) + [FULL_ATTENTION],
        sliding_window=2048,
        in_block_causality=SLIDING_CAUSAL,
        rope_parameters={"rope_type": "default", "rope_theta": target_rope_parameters(text)["rope_theta"]},
    )


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target decoder layers whose outputs feed the drafter (z-lab numbering: layer k).

    One draft layer -> the middle layer; otherwise evenly spaced from layer 1 to layer L - 3.
    The feature of layer k is ``hidden_states[k + 1]`` in Hugging Face ``output_hidden_states``.
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    if len(set(ids)) != len(ids) or ids[0] < 0:
        raise ValueError(
            f"drafter.target_layer_ids: the default rule spreads {num_draft_layers} layers from layer 1 to layer "
            f"L - 3 = {num_target_layers - 3} of this {num_target_layers}-layer target, which gives {ids}; name "
            f"{num_draft_layers} distinct layers in [0, {num_target_layers - 1}) with drafter.target_layer_ids, or "
            "use fewer drafter.num_layers"
        )
    return ids


PUBLISHED_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))
"""(block size, loss decay gamma) of the published recipes."""


def default_gamma(block_size: int) -> float:
    """Loss decay constant of the published recipes: 7 for B = 16, 5 for B = 10, 4 for B = 8; other sizes on the
    line through the two nearest of those points (below 10: 8 and 10; from 10: 10 and 16)."""
    (low, low_gamma), (high, high_gamma) = PUBLISHED_GAMMA[:2] if block_size < 10 else PUBLISHED_GAMMA[1:]
    return low_gamma + (high_gamma - low_gamma) * (block_size - low) / (high - low)


@dataclass
class DraftConfig:
    """Shape and conditioning of a DFlash drafter (Qwen3-style layers with KV injection)."""

    hidden_size: int
    """Width of the draft layers (equals the target's hidden size for the released drafts)."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Number of draft decoder layers."""
    num_attention_heads: int
    """Query heads per draft layer."""
    num_key_value_heads: int
    """Key/value heads per draft layer (grouped-query attention)."""
    head_dim: int
    """Width of one attention head."""
    vocab_size: int
    """Target vocabulary size (embedding and lm_head are the target's)."""
    target_hidden_size: int
    """Hidden size of the target; the fused feature is ``len(target_layer_ids) * target_hidden_size`` wide."""
    num_target_layers: int
    """Number of decoder layers of the target."""
    target_layer_ids: list[int]
    """Target decoder layers (0-based, z-lab numbering) whose outputs are the context features."""
    mask_token_id: int
    """Token id that fills the slots 1..B-1 of a block (a reserved id of the target vocabulary)."""
    block_size: int = 16
    """Tokens per draft block B (slot 0 is the given token, B - 1 are predicted)."""
    layer_types: list[str] = field(default_factory=list)
    """Per draft layer: "full_attention" or "sliding_attention" (empty -> all full)."""
    sliding_window: int | None = None
    """Window of sliding-attention layers, in tokens: a slot at position p sees keys at positions > p - window,
    in the context and, when the window is smaller than the block, in its own block too."""
    in_block_causality: str = SLIDING_CAUSAL
    """Which layers are causal inside the block: "sliding_causal" (the servers' default), "bidirectional"
    or "causal". Training masks, the evaluation decoder and the export all follow it."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (also the target's final norm)."""
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1e6})
    """RoPE settings as Hugging Face ``rope_parameters``: rope_type, rope_theta and scaling fields."""
    max_position_embeddings: int = 40960
    """Longest position the RoPE settings were made for (used by some scaled rope types)."""
    hidden_act: str = "silu"
    """MLP activation; only SwiGLU with silu is implemented."""
    attention_bias: bool = False
    """Bias on q/k/v/o projections (Qwen3: none)."""
    kind: str = DEFAULT_KIND
    """The drafter kind (common/drafter/kinds.py)."""
    options: Any = None
    """The kind's own options (its ``KindOptions``, the ``[drafter.<kind>]`` table), or a dict of them; None: its
    defaults."""

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "target_hidden_size",
            "num_target_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        if any(not 0 <= k < self.num_target_layers for k in self.target_layer_ids):
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} must lie in [0, {self.num_target_layers}) "
                "(0-based decoder layers; the last layer's output is after the final norm in HF)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} must lie in [0, vocab_size={self.vocab_size})")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        if any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {self.layer_types}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int when a layer slides, got {self.sliding_window!r}")
        if self.in_block_causality not in IN_BLOCK_CAUSALITY:
            raise ValueError(f"in_block_causality must be one of {IN_BLOCK_CAUSALITY}, got {self.in_block_causality!r}")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(f"rope_parameters must hold rope_theta, got {self.rope_parameters}")
        self.rope_parameters.setdefault("rope_type", "default")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._resolve_options()

    def _resolve_options(self) -> None:
        """The kind's options as its ``KindOptions``, with the defaults that depend on this shape derived and
        checked against it."""
        options_type = kind_of(self.kind).options
        if self.options is None or isinstance(self.options, dict):
            self.options = options_type(**(self.options or {}))
        if not isinstance(self.options, options_type):
            raise ValueError(f"options of a {self.kind} drafter must be {options_type.__name__}, got {self.options!r}")
        self.options = self.options.resolved(self)
        try:
            self.options.check_shape(self)
        except ValueError as exc:  # named as its key: drafter.<kind>.<option>
            raise ValueError(f"{self.kind}.{exc}") from None

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    def causal_in_block(self, layer_type: str) -> bool:
        """Whether layers of ``layer_type`` see only the earlier slots of their own block."""
        return causal_in_block(self.in_block_causality, layer_type)

    def window_of(self, layer_type: str) -> int | None:
        """The attention window of layers of ``layer_type`` (None: unbounded)."""
        return self.sliding_window if layer_type == SLIDING_ATTENTION else None

    @property
    def causal_per_layer(self) -> list[bool]:
        """In-block causality of each draft layer, in order."""
        return [self.causal_in_block(t) for t in self.layer_types]

    @property
    def fused_feature_size(self) -> int:
        """Width of the concatenated target features ``[n * H_target]``."""
        return len(self.target_layer_ids) * self.target_hidden_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # the options as a dict, which ``from_dict`` reads back

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DraftConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        num_draft_layers: int = 5,
        tokenizer: Any = None,
        mask_token_id: int | None = None,
        **overrides: Any,
    ) -> DraftConfig:
        """Derive a draft config from a target ``PretrainedConfig`` (Qwen3-like).

        Sizes come from the target; the mask token from ``mask_token_id`` if given, else from the
        tokenizer: its mask token if it has one, else the first id past the tokenizer (the id that
        adding a ``<|MASK|>`` special token gets; 151669 for Qwen3), which must be inside the
        target's embedding. Any field can be overridden by keyword.
        """
        text = getattr(target_config, "text_config", None) or target_config
        num_layers = int(overrides.pop("num_hidden_layers", num_draft_layers))
        num_target_layers = int(text.num_hidden_layers)
        values: dict[str, Any] = dict(
            hidden_size=int(text.hidden_size),
            num_hidden_layers=num_layers,
            vocab_size=int(text.vocab_size),
            target_hidden_size=int(text.hidden_size),
            num_target_layers=num_target_layers,
            # the default rule only where none is named: it fails on a target too shallow for it
            target_layer_ids=overrides.pop("target_layer_ids", None)
            or build_target_layer_ids(num_target_layers, num_layers),
            mask_token_id=cls._mask_token(tokenizer, mask_token_id, overrides, int(text.vocab_size)),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 40960)),
        )
        hybrid = getattr(text, "model_type", None) in HYBRID_QWEN_TYPES
        values.update(_hybrid_qwen_shape(text, num_layers) if hybrid else _target_shape(text))
        values.update(overrides)
        return cls(**values)

    @staticmethod
    def _mask_token(tokenizer: Any, mask_token_id: int | None, overrides: dict[str, Any], vocab_size: int) -> int:
        """The mask token as released drafts pick it: given, else the tokenizer's own mask token, else the
        first id past the tokenizer when the target's embedding has rows to spare there (Qwen: 151669 and
        248070), else the first reserved special token of the tokenizer (Llama 3: ``<|reserved_special_token_0|>``)."""
        if "mask_token_id" in overrides:
            return int(overrides.pop("mask_token_id"))
        if mask_token_id is not None:
            return mask_token_id
        if tokenizer is None:
            raise ValueError("mask_token_id: pass mask_token_id or a tokenizer to take it from")
        if tokenizer.mask_token_id is not None:
            return int(tokenizer.mask_token_id)
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        reserved = sorted(i for token, i in tokenizer.get_added_vocab().items() if "reserved" in token.lower())
        if reserved:
            return reserved[0]
        unused = unused_special_token(tokenizer)
        if unused is not None:
            return unused
        raise ValueError(
            f"drafter.mask_token_id: the tokenizer has no mask token, its {len(tokenizer)} tokens fill the target's "
            f"vocabulary of {vocab_size}, and it has no reserved or unused special token to use; set "
            "drafter.mask_token_id to an id the data never contains"
        )


def unused_special_token(tokenizer: Any) -> int | None:
    """The last special token that no conversation uses, or None: not bos, eos, pad or unk, and not written by the
    chat template in a probe conversation (system, user, assistant, user, generation prompt; with thinking on and
    off). Plain text never tokenizes to such a token, so the data cannot contain it either (SmolLM2: 16,
    ``<empty_output>``, of the dozen code-data markers its vocabulary keeps)."""
    special = {int(i) for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    special -= {int(i) for i in getattr(tokenizer, "all_special_ids", ())}
    if getattr(tokenizer, "chat_template", None):
        probe = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "v"},
        ]
        for thinking in (True, False):
            try:
                text = tokenizer.apply_chat_template(
                    probe, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
                )
            except Exception:  # a template that rejects the probe (e.g. no system role): its tokens stay excluded below
                continue
            special -= set(tokenizer(text, add_special_tokens=False)["input_ids"])
    return max(special) if special else None


def target_rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings of a HF config, from ``rope_parameters`` (transformers 5) or rope_theta/rope_scaling."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "rope_theta" not in params:  # per-layer-type nesting (e.g. Gemma): take the full-attention one
            params = dict(params.get(FULL_ATTENTION, next(iter(params.values()))))
        return params
    params = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params["rope_theta"] = float(getattr(config, "rope_theta", 10000.0))
    return params

"""The ``[drafter]`` section: the drafter's kind and shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from .base import require


@dataclass
class DrafterConfig:
    """The drafter's shape. Unset sizes come from the target (docs/dflash.md); set ones override it."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "num_layers": "producer checkpoint",
        "target_layer_ids": "producer checkpoint",
        "num_anchors": "producer trainer",
        "block_size": "checkpoint",
        "layer_types": "checkpoint",
        "sliding_window": "checkpoint",
        "in_block_causality": "checkpoint",
        "mask_token_id": "checkpoint",
        "intermediate_size": "checkpoint",
        "num_attention_heads": "checkpoint",
        "num_key_value_heads": "checkpoint",
        "kind": "producer checkpoint",
        "conv_kernel_size": "checkpoint",
        "conv_group_size": "checkpoint",
        "selector_rank": "checkpoint",
        "selector_top_k": "checkpoint",
        "selector_loss_alpha": "trainer",
        "selector_missing_gold": "trainer",
        "selector_stop_gradient": "trainer",
        "init_from": "trainer",
    }

    kind: Literal["dflash", "dflash2"] = "dflash"
    """The drafter kind: dflash, or dflash2 (DFlash 2: a grouped dynamic causal convolution around each draft
    layer's attention and MLP, and a candidate selector that rescores the draft's top-K with a low-rank bilinear
    term of the previous token; servers run it as vLLM method dflash). A checkpoint resumes only as its own kind."""
    num_layers: int = 5
    """Number of draft decoder layers."""
    block_size: int = 16
    """Tokens per draft block B (slot 0 given, B - 1 predicted)."""
    num_anchors: int = 512
    """Blocks sampled per packed batch of ``batching.token_budget`` tokens: shared by its documents in proportion to
    their supervised tokens, and spread evenly over each. Raise it with token_budget to keep anchors per token."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Target layers (0-based, output of layer k) used as features; empty: the docs/dflash.md rule."""
    layer_types: list[str] = field(default_factory=list)
    """Per draft layer: full_attention or sliding_attention; empty: all full."""
    sliding_window: int | None = None
    """Window of sliding-attention layers: a slot sees keys fewer than this many positions away, in the
    context and in its own block. Their cost per block follows the window, not the document's length."""
    in_block_causality: Literal["sliding_causal", "bidirectional", "causal"] = "sliding_causal"
    """Which layers see only the earlier slots of their own block: sliding_causal (sliding layers causal,
    full layers bidirectional: what vLLM, SGLang and speculators serve by default, and how the released
    mixed drafts were trained), bidirectional (every layer) or causal (every layer). The export states it."""
    mask_token_id: int | None = None
    """Id of the mask token; None: from the target's tokenizer, else the last id of the vocabulary."""
    intermediate_size: int | None = None
    """MLP width; None: the target's."""
    num_attention_heads: int | None = None
    """Query heads; None: the target's."""
    num_key_value_heads: int | None = None
    """Key/value heads; None: the target's."""
    conv_kernel_size: int = 2
    """dflash2: taps of each dynamic convolution, looking back inside the block (1 is the position itself)."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic kernel delta; must divide the hidden size."""
    selector_rank: int = 256
    """dflash2: rank of the selector's bilinear term (codebooks of vocabulary x rank)."""
    selector_top_k: int = 16
    """dflash2: candidates per slot the selector rescores: the draft's top-K; at most the vocabulary."""
    selector_loss_alpha: float = 1.0
    """dflash2: weight of the selector's K-way cross-entropy beside the DFlash loss (0 trains no selector)."""
    selector_missing_gold: Literal["inject", "exclude"] = "inject"
    """dflash2: a slot whose gold token is not in the draft's top-K: inject it in place of the K-th candidate (as
    speculators does), or leave the slot out of the selector loss (as NeMo does)."""
    selector_stop_gradient: bool = False
    """dflash2: stop the selector loss's gradient at the draft hidden state, so it trains the selector alone and
    the backbone learns from the DFlash loss only (a SpecForge option)."""
    init_from: str | None = None
    """A DFlash or DFlash 2 checkpoint (checkpoints/step-N) or export to start a new run's drafter from: its
    weights are loaded, and a dflash2 drafter from a DFlash one gets identity convolutions and a no-op selector,
    so it first proposes exactly what the DFlash drafter did. Read at a fresh start only, never at a resume."""

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "num_layers", "must be >= 1")
        require(self.kind in ("dflash", "dflash2"), "kind", f"must be dflash or dflash2, got {self.kind!r}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        require(
            self.conv_kernel_size <= self.block_size,
            "conv_kernel_size",
            f"must be <= block_size ({self.block_size}): the taps look back inside the block only",
        )
        require(self.selector_loss_alpha >= 0, "selector_loss_alpha", "must be >= 0")
        require(
            self.selector_missing_gold in ("inject", "exclude"),
            "selector_missing_gold",
            f"must be inject or exclude, got {self.selector_missing_gold!r}",
        )
        require(self.block_size >= 2, "block_size", "must be >= 2")
        require(self.num_anchors >= 1, "num_anchors", "must be >= 1")
        require(all(k >= 0 for k in self.target_layer_ids), "target_layer_ids", "must be >= 0")
        require(
            not self.layer_types or len(self.layer_types) == self.num_layers,
            "layer_types",
            f"needs one entry per layer ({self.num_layers}), got {len(self.layer_types)}",
        )
        require(
            all(t in ("full_attention", "sliding_attention") for t in self.layer_types),
            "layer_types",
            "entries must be full_attention or sliding_attention",
        )
        require(
            self.in_block_causality in ("sliding_causal", "bidirectional", "causal"),
            "in_block_causality",
            f"must be sliding_causal, bidirectional or causal, got {self.in_block_causality!r}",
        )
        if "sliding_attention" in self.layer_types:
            require(
                self.sliding_window is not None and self.sliding_window >= 1,
                "sliding_window",
                "must be set (>= 1) for sliding layers",
            )

    def draft_overrides(self) -> dict[str, Any]:
        """The DraftConfig fields this section sets (``DraftConfig.from_target`` derives the rest from the target):
        the one mapping of the trainer's drafter and of what ``check`` describes."""
        overrides: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "block_size",
                "in_block_causality",
                "kind",
                "conv_kernel_size",
                "conv_group_size",
                "selector_rank",
                "selector_top_k",
            )
        }
        for name in ("target_layer_ids", "layer_types"):
            if getattr(self, name):
                overrides[name] = list(getattr(self, name))
        for name in ("sliding_window", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        return overrides

"""LiLiCorr (NVIDIA, arXiv 2608.20530; Model-Optimizer PR #2342): the DFlash backbone plus a reranker that scores the
draft's top-K candidates of every slot jointly, by a start factor from an anchor and pairwise factors between adjacent
slots, and walks them greedily left to right (model.py).

Its options are the ``[drafter.lilicorr]`` table; its line of the kinds table is ``KIND``. The shape fields carry the
names Model-Optimizer writes into config.json's ``dflash_config`` (``lilicorr_*``), which SGLang, vLLM and TensorRT-LLM
read; the loss weights are Model-Optimizer's ``dflash_lilicorr_w_*`` and ``dflash_lilicorr_margin`` without the
``dflash_`` prefix (they are not exported).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from common.config.base import require
from common.drafter.kind import DrafterKind, DraftShape, KindOptions

NUM_CANDIDATE_FEATURES = 5
"""Per candidate: its log-probability, probability, gap to the slot's best, rank fraction and top-1 flag."""
REFERENCE_WIDTH = 1024
"""Model-Optimizer's reranker width and factor width, on its 4096-wide drafters: a quarter of the drafter."""
REFERENCE_DRAFT_WIDTH = 4096
"""The hidden size of the drafters Model-Optimizer's recipe sizes its reranker for (Qwen3-8B's, Llama-3.1-8B's)."""


@dataclass
class LiLiCorrOptions(KindOptions):
    """LiLiCorr's reranker and its objective (``[drafter.lilicorr]``). Defaults are Model-Optimizer's recipe
    (``lilicorr.yaml``, the ``base`` objective)."""

    READ_BY: ClassVar[dict[str, str]] = {
        "lilicorr_candidate_topk": "checkpoint",
        "lilicorr_hidden_size": "checkpoint",
        "lilicorr_factor_dim": "checkpoint",
        "lilicorr_num_layers": "checkpoint",
        "lilicorr_num_heads": "checkpoint",
        "lilicorr_mlp_ratio": "checkpoint",
        "lilicorr_logit_scale": "checkpoint",
        "lilicorr_vector_eps": "checkpoint",
        "lilicorr_w_ce": "trainer",
        "lilicorr_w_margin": "trainer",
        "lilicorr_w_pen": "trainer",
        "lilicorr_margin": "trainer",
    }

    lilicorr_candidate_topk: int = 8
    """Candidates K per slot: the draft's top-K tokens over the target's whole vocabulary, most likely first. SGLang's
    and vLLM's kernels take a power of two up to 16."""
    lilicorr_hidden_size: int | None = None
    """Width h of the reranker's transformer (0: the draft's hidden size, where ``token_proj`` is the identity and
    has no weights); a multiple of ``lilicorr_num_heads``. None: the reference's proportion, a quarter of the draft's
    hidden size rounded up to a multiple of ``lilicorr_num_heads``, at most the reference's 1024 (1024 on its 4096-wide
    drafters; 144 on SmolLM2's 576, 16 on the tiny default's 64). The reranker runs over (block - 1) x K candidate
    positions a block, K times the drafter's, so a head as wide as the drafter would cost several drafters."""
    lilicorr_factor_dim: int | None = None
    """Width F of the out / in / anchor vectors whose cosines are the factors. None: as ``lilicorr_hidden_size``'s
    default (the reference's F = h = 1024 on a 4096-wide drafter)."""
    lilicorr_num_layers: int = 2
    """Layers of the reranker's bidirectional transformer over the slots x K candidates of a block."""
    lilicorr_num_heads: int = 8
    """Attention heads of each reranker layer (each with its learned bias per slot distance and same-slot bias)."""
    lilicorr_mlp_ratio: float = 2.0
    """Width of each reranker layer's MLP (Linear, SiLU, Linear, with biases) over h."""
    lilicorr_logit_scale: float = 8.0
    """Fixed scale of the factors: each is ``lilicorr_logit_scale`` x a cosine, so it lies in [-scale, scale]."""
    lilicorr_vector_eps: float = 1e-4
    """Epsilon of the L2 normalisation of the out / in / anchor vectors, in (0, 0.5)."""
    lilicorr_w_ce: float = 0.25
    """Weight of the reranker's K-way cross-entropy at each slot, the previous slot's label teacher-forced
    (Model-Optimizer's ``dflash_lilicorr_w_ce``; 0.125 in its ``margin`` variant)."""
    lilicorr_w_margin: float = 0.0
    """Weight of the hinge relu(margin - (score of the label - best other score)) (``dflash_lilicorr_w_margin``;
    0.125 in the ``margin`` variant)."""
    lilicorr_w_pen: float = 0.25
    """Weight of the distractor penalty: the reranker's expected relu(target logit of the label - target logit of the
    candidate) over its own distribution of the slot's candidates (``dflash_lilicorr_w_pen``). Reads the target's
    distribution: the producers ship the target's final hidden state."""
    lilicorr_margin: float = 2.0
    """Width of the hinge (``dflash_lilicorr_margin``); must be > 0 where ``lilicorr_w_margin`` > 0."""

    def __post_init__(self) -> None:
        for name in (
            "lilicorr_candidate_topk",
            "lilicorr_factor_dim",
            "lilicorr_num_layers",
            "lilicorr_num_heads",
        ):
            value = getattr(self, name)
            require(
                (value is None and name == "lilicorr_factor_dim") or (_is_int(value) and value >= 1),
                name,
                f"must be an integer >= 1, got {value!r}",
            )
        hidden = self.lilicorr_hidden_size
        require(
            hidden is None or (_is_int(hidden) and hidden >= 0),
            "lilicorr_hidden_size",
            f"must be an integer >= 0, got {hidden!r}",
        )
        require(
            not hidden or hidden % self.lilicorr_num_heads == 0,
            "lilicorr_hidden_size",
            f"{hidden} must be a multiple of lilicorr_num_heads ({self.lilicorr_num_heads})",
        )
        for name in ("lilicorr_mlp_ratio", "lilicorr_logit_scale"):
            value = getattr(self, name)
            require(_is_number(value) and 0 < value < math.inf, name, f"must be a number > 0, got {value!r}")
        eps = self.lilicorr_vector_eps
        require(_is_number(eps) and 0 < eps < 0.5, "lilicorr_vector_eps", f"must lie in (0, 0.5), got {eps!r}")
        for name in ("lilicorr_w_ce", "lilicorr_w_margin", "lilicorr_w_pen", "lilicorr_margin"):
            value = getattr(self, name)
            require(_is_number(value) and 0 <= value < math.inf, name, f"must be a number >= 0, got {value!r}")
        require(
            self.lilicorr_w_ce + self.lilicorr_w_margin + self.lilicorr_w_pen > 0,
            "lilicorr_w_ce",
            "lilicorr_w_ce, lilicorr_w_margin and lilicorr_w_pen cannot all be 0: the reranker would never train",
        )
        require(
            self.lilicorr_w_margin == 0 or self.lilicorr_margin > 0,
            "lilicorr_margin",
            f"must be > 0 where lilicorr_w_margin > 0 ({self.lilicorr_w_margin}), got {self.lilicorr_margin}",
        )

    def resolved(self, config: DraftShape) -> LiLiCorrOptions:
        heads = self.lilicorr_num_heads
        quarter = math.ceil(config.hidden_size * REFERENCE_WIDTH / REFERENCE_DRAFT_WIDTH / heads) * heads
        derived = min(REFERENCE_WIDTH, quarter)
        return dataclasses.replace(
            self,
            lilicorr_hidden_size=derived if self.lilicorr_hidden_size is None else self.lilicorr_hidden_size,
            lilicorr_factor_dim=derived if self.lilicorr_factor_dim is None else self.lilicorr_factor_dim,
        )

    def head_width(self, config: DraftShape) -> int:
        """The reranker's width h on this drafter: ``lilicorr_hidden_size``, or the draft's hidden size for 0."""
        return self.lilicorr_hidden_size or config.hidden_size

    def mlp_width(self, config: DraftShape) -> int:
        """Width of each reranker layer's MLP, int(h x ``lilicorr_mlp_ratio``) as the reference rounds it."""
        return int(self.head_width(config) * self.lilicorr_mlp_ratio)

    def check_shape(self, config: DraftShape) -> None:
        if self.lilicorr_candidate_topk > config.vocab_size:
            raise ValueError(
                f"lilicorr_candidate_topk {self.lilicorr_candidate_topk} must be <= vocab_size {config.vocab_size}"
            )
        width = self.head_width(config)
        if width % self.lilicorr_num_heads:
            raise ValueError(
                f"lilicorr_hidden_size (0: the draft's hidden size, {config.hidden_size}) gives a width of {width}, "
                f"which must be a multiple of lilicorr_num_heads {self.lilicorr_num_heads}"
            )
        if self.mlp_width(config) < 1:
            raise ValueError(f"lilicorr_mlp_ratio {self.lilicorr_mlp_ratio} leaves the reranker's MLP no width")

    def export_fields(self) -> dict[str, Any]:
        # Model-Optimizer's exporter marks the head twice: SGLang and vLLM route on the architecture, TensorRT-LLM also
        # on projector_type or lilicorr_enabled.
        return {**self.shape(), "projector_type": "lilicorr", "lilicorr_enabled": True}

    def describe(self, config: DraftShape) -> str:
        width = self.head_width(config)
        loss = f"{self.lilicorr_w_ce} CE + {self.lilicorr_w_pen} penalty"
        if self.lilicorr_w_margin:
            loss += f" + {self.lilicorr_w_margin} hinge (margin {self.lilicorr_margin})"
        return (
            f"LiLiCorr: a {self.lilicorr_num_layers}-layer reranker ({width} wide, {self.lilicorr_num_heads} heads) "
            f"over the top {self.lilicorr_candidate_topk} of the full vocabulary ({config.vocab_size}) at each of "
            f"{config.block_size - 1} slots, {self.lilicorr_factor_dim}-wide factors at scale "
            f"{self.lilicorr_logit_scale}; loss DFlash + {loss} (the producers ship the target's final hidden state)"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


KIND = DrafterKind(
    name="lilicorr",
    options=LiLiCorrOptions,
    head="common.drafter.lilicorr.model:LiLiCorrKindHead",
    # Model-Optimizer's exporter writes this architecture; SGLang (#37462), vLLM (#57934) and TensorRT-LLM route on it.
    zlab_architecture="LiLiCorrDraftModel",
    # No speculators format of LiLiCorr exists (speculators 0.9 has none): this name and the type (the kind's name) are
    # this project's own, so that its exports load back; no server reads them.
    speculators_architecture="LiLiCorrSpeculator",
    # not measured: DSpark's, the other head over the whole vocabulary that reads the target's distribution
    step_memory_factor=1.3,
    speculators_sliding_non_causal=False,
    summary=(
        "LiLiCorr: the DFlash backbone plus a small bidirectional transformer over the draft's top-K candidates of every "
        "slot, scoring a start factor (from the block's context row) and pairwise factors between adjacent slots that "
        "decoding walks greedily; its servers (SGLang's and vLLM's LiLiCorr pull requests, as algorithm DFLASH and "
        "method dflash) are not released, so no serving command is printed"
    ),
    vllm_method=None,
    sglang_algorithm=None,
    llamacpp_spec_type=None,
    full_vocabulary=True,
    needs_final_hidden=True,
    warm_starts_from=("dflash",),
)

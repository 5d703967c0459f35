"""DFlash 2: the DFlash drafter plus grouped dynamic causal convolutions and a candidate selector (model.py).

Its options are the ``[drafter.dflash2]`` table; its line of the kinds table is ``KIND``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from common.config.base import require
from common.drafter.kind import DrafterKind, DraftShape, KindOptions


@dataclass
class DFlash2Options(KindOptions):
    """DFlash 2's convolutions and candidate selector (``[drafter.dflash2]``)."""

    READ_BY: ClassVar[dict[str, str]] = {
        "conv_kernel_size": "checkpoint",
        "conv_group_size": "checkpoint",
        "selector_rank": "checkpoint",
        "selector_top_k": "checkpoint",
        "selector_loss_alpha": "trainer",
        "selector_missing_gold": "trainer",
        "selector_stop_gradient": "trainer",
    }

    conv_kernel_size: int = 2
    """Taps of each dynamic convolution, looking back inside the block (1 is the position itself)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic kernel delta; must divide the hidden size."""
    selector_rank: int = 256
    """Rank of the selector's bilinear term (codebooks of vocabulary x rank)."""
    selector_top_k: int = 16
    """Candidates per slot the selector rescores: the draft's top-K; at most the vocabulary."""
    selector_loss_alpha: float = 1.0
    """Weight of the selector's K-way cross-entropy beside the DFlash loss (0 trains no selector); both are
    normalised by the same slot weights."""
    selector_missing_gold: Literal["inject", "exclude"] = "inject"
    """A slot whose gold token is not in the draft's top-K: inject it in place of the K-th candidate (as speculators
    does), or leave the slot out of the selector loss (as NeMo does)."""
    selector_stop_gradient: bool = False
    """Stop the selector loss's gradient at the draft hidden state, so it trains the selector alone and the backbone
    learns from the DFlash loss only (a SpecForge option)."""

    def __post_init__(self) -> None:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, f"must be an integer >= 1, got {value!r}")
        require(self.selector_loss_alpha >= 0, "selector_loss_alpha", "must be >= 0")
        require(
            self.selector_missing_gold in ("inject", "exclude"),
            "selector_missing_gold",
            f"must be inject or exclude, got {self.selector_missing_gold!r}",
        )

    def check_shape(self, config: DraftShape) -> None:
        if config.hidden_size % self.conv_group_size:
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide hidden_size {config.hidden_size}")
        if self.conv_kernel_size > config.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} must be <= block_size {config.block_size} "
                "(the taps look back inside the block only)"
            )
        if self.selector_top_k > config.vocab_size:
            raise ValueError(f"selector_top_k {self.selector_top_k} must be <= vocab_size {config.vocab_size}")

    def describe(self, config: DraftShape) -> str:
        return (
            f"DFlash 2: convolutions of {self.conv_kernel_size} taps in groups of {self.conv_group_size}, a "
            f"rank-{self.selector_rank} selector over the top {self.selector_top_k} of the full vocabulary "
            f"({config.vocab_size})"
        )


def selector_lattice_refusal(config: DraftShape) -> str | None:
    """llama.cpp builds DFlash 2's selector walk on a lattice of top_k x (top_k + 1) slots of the hidden state and
    refuses a draft whose hidden size is smaller ("DFlash2 hidden size is too small for the selector lattice")."""
    top_k, hidden = config.options.selector_top_k, config.hidden_size
    if hidden >= top_k * (top_k + 1):
        return None
    fits = max(k for k in range(1, top_k + 1) if hidden >= k * (k + 1))
    return (
        f"llama.cpp serves a DFlash 2 drafter only where hidden_size >= selector_top_k * (selector_top_k + 1) (its "
        f"selector lattice): this one has hidden_size {hidden} and selector_top_k {top_k}; train it with "
        f"drafter.dflash2.selector_top_k = {fits} or less, or serve the z-lab export with vLLM or SGLang"
    )


KIND = DrafterKind(
    name="dflash2",
    options=DFlash2Options,
    head="common.drafter.dflash2.model:DFlash2KindHead",
    zlab_architecture="DFlash2DraftModel",
    speculators_architecture="DFlash2DraftModel",
    # its step allocated 12.0 GiB against DFlash's 9.5 at the SmolLM2 preset's (launch.bench.step, one H200), rounded up
    step_memory_factor=1.3,
    speculators_sliding_non_causal=True,
    summary=(
        "DFlash 2: a grouped dynamic causal convolution around each draft layer's attention and MLP, and a candidate "
        "selector that rescores the draft's top-K with a low-rank bilinear term of the previous token; servers run "
        "it as vLLM method dflash"
    ),
    vllm_method="dflash",
    sglang_algorithm="DFLASH",
    # the same spec type: the server walks the selector when the GGUF's dflash.selector_top_k > 0
    llamacpp_spec_type="draft-dflash",
    llamacpp_refusal=selector_lattice_refusal,
    full_vocabulary=True,
    warm_starts_from=("dflash",),
)

"""DSpark (DeepSeek-AI with PKU, arXiv 2607.05147): the DFlash backbone plus a low-rank Markov head that biases each
slot's logits by the previous token, and a confidence head that predicts each slot's acceptance (model.py).

Its options are the ``[drafter.dspark]`` table; its line of the kinds table is ``KIND``. Slot 0 is the block's given
token and slots 1..B-1 are drafted, as for the other kinds (speculators' ``sample_from_anchor = false``, which
llama.cpp and vLLM serve): tau and the block size mean the same for every kind, so their rows compare one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from common.config.base import require
from common.drafter.kind import DrafterKind, DraftShape, KindOptions

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_MARKOV_RANK = 256
"""The references' rank (DeepSeek's and speculators'), kept wherever the vocabulary allows it."""


@dataclass
class DSparkOptions(KindOptions):
    """DSpark's Markov and confidence heads and its objective (``[drafter.dspark]``). The names of the shape fields
    are speculators' config.json keys."""

    READ_BY: ClassVar[dict[str, str]] = {
        "markov_rank": "checkpoint",
        "markov_head_type": "checkpoint",
        "enable_confidence_head": "checkpoint",
        "ce_alpha": "trainer",
        "tv_alpha": "trainer",
        "confidence_alpha": "trainer",
    }

    markov_rank: int | None = None
    """Rank r of the Markov head: its own table of the previous token (vocabulary x r) and its map back to the
    vocabulary (vocabulary x r); at most the vocabulary. None: min(256, the vocabulary), the references' 256 on any
    real target."""
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    """vanilla: bias = W2 W1[previous token]; gated: the same with W1[previous] gated by sigmoid(gate([h; W1[prev]]));
    rnn: a gated recurrence over the block's slots (state, W1[prev], h). llama.cpp and vLLM serve vanilla only."""
    enable_confidence_head: bool = True
    """A confidence head: sigmoid(proj([h; W1[prev]])) per slot, trained to the slot's acceptance rate given the
    earlier slots accepted, so a server can cut a block short (``eval.confidence_min``)."""
    ce_alpha: float = 0.1
    """Weight of the cross-entropy to the label (the data token, or the target's argmax for a target label mode)."""
    tv_alpha: float = 0.9
    """Weight of the total-variation distance to the target's distribution, 1 - sum_v min(p_v, q_v): one minus the
    slot's acceptance rate (Model-Optimizer's l1_alpha is twice this weight: its L1 distance is 2 TV)."""
    confidence_alpha: float = 1.0
    """Weight of the confidence head's binary cross-entropy to the slot's acceptance rate (detached)."""

    def __post_init__(self) -> None:
        rank = self.markov_rank
        require(
            rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1),
            "markov_rank",
            f"must be an integer >= 1, got {rank!r}",
        )
        require(
            self.markov_head_type in MARKOV_HEAD_TYPES,
            "markov_head_type",
            f"must be one of {list(MARKOV_HEAD_TYPES)}, got {self.markov_head_type!r}",
        )
        for name in ("ce_alpha", "tv_alpha", "confidence_alpha"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(self.ce_alpha + self.tv_alpha > 0, "tv_alpha", "ce_alpha and tv_alpha cannot both be 0")

    def check_run(self, run: Any) -> None:
        require(
            run.training.objective == "ce",
            "training.objective",
            f"a dspark drafter trains its own objective ([drafter.dspark] ce_alpha, tv_alpha), not "
            f"{run.training.objective!r}: leave training.objective = \"ce\"",
        )

    def resolved(self, config: DraftShape) -> DSparkOptions:
        if self.markov_rank is not None:
            return self
        return dataclasses.replace(self, markov_rank=min(DEFAULT_MARKOV_RANK, config.vocab_size))

    def check_shape(self, config: DraftShape) -> None:
        if self.markov_rank > config.vocab_size:
            raise ValueError(f"markov_rank {self.markov_rank} must be <= vocab_size {config.vocab_size}")

    def export_fields(self) -> dict[str, Any]:
        # slot 0 is given, not drafted (speculators' name; llama.cpp and vLLM read it), and the confidence head reads
        # [h; W1[prev]], as every server's loader expects
        return {**self.shape(), "sample_from_anchor": False, "confidence_head_with_markov": True}

    def describe(self, config: DraftShape) -> str:
        confidence = ", a confidence head" if self.enable_confidence_head else ", no confidence head"
        return (
            f"DSpark: a {self.markov_head_type} rank-{self.markov_rank} Markov head over the full vocabulary "
            f"({config.vocab_size}){confidence}; loss {self.ce_alpha} CE + {self.tv_alpha} TV + "
            f"{self.confidence_alpha} confidence BCE (the producers ship the target's final hidden state)"
        )


def markov_head_refusal(config: DraftShape) -> str | None:
    """llama.cpp's converter refuses a Markov head other than vanilla ("only markov_head_type=vanilla")."""
    if config.options.markov_head_type == "vanilla":
        return None
    return (
        f"llama.cpp serves a DSpark drafter's vanilla Markov head only, this one is "
        f"{config.options.markov_head_type!r}: train it with drafter.dspark.markov_head_type = \"vanilla\""
    )


KIND = DrafterKind(
    name="dspark",
    options=DSparkOptions,
    head="common.drafter.dspark.model:DSparkKindHead",
    zlab_architecture="DSparkDraftModel",
    speculators_architecture="DSparkSpeculator",
    # its step allocated 30.7 GiB against DFlash's 24.5 at Qwen3-8B's (launch.bench.step, one H100), rounded up
    step_memory_factor=1.3,
    summary=(
        "DSpark: the DFlash backbone plus a low-rank Markov head that biases each slot's logits by the previous "
        "token, and a confidence head that predicts each slot's acceptance; served by llama.cpp (draft-dspark) and "
        "vLLM (method dspark, GPUs only)"
    ),
    vllm_method="dspark",
    llamacpp_spec_type="draft-dspark",
    llamacpp_refusal=markov_head_refusal,
    llamacpp_format="speculators",
    full_vocabulary=True,
    needs_final_hidden=True,
    warm_starts_from=("dflash",),
)

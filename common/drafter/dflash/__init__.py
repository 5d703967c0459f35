"""DFlash (z-lab, arXiv 2602.06036): the block drafter every kind builds on. Its model is common/drafter/model.py, the
backbone alone (no head); it has no options of its own beyond the ``[drafter]`` section."""

from __future__ import annotations

from dataclasses import dataclass

from common.drafter.kind import DrafterKind, KindOptions


@dataclass
class DFlashOptions(KindOptions):
    """DFlash has no options of its own."""


KIND = DrafterKind(
    name="dflash",
    options=DFlashOptions,
    zlab_architecture="DFlashDraftModel",
    speculators_architecture="DFlashSpeculator",
    step_memory_factor=1.0,
    summary="draft layers fed the target's hidden states, a block of tokens per forward",
    vllm_method="dflash",
    sglang_algorithm="DFLASH",
    llamacpp_spec_type="draft-dflash",
    vllm_cpu=True,
)

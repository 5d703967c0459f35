"""The drafter kinds: DFlash and DFlash 2, one family behind one interface (DFlashDrafter's ``make_layer``,
``objective``, ``propose``, ``warm_start``).

Each kind names its model class and how the serving formats name it; the rest of the project builds drafters
and writes exports through this table, so a new kind (say DSpark's Markov and confidence heads) is one module
with its model class and one entry here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.drafter.dflash2 import DFlash2Drafter
from common.drafter.draft_config import DraftConfig
from common.drafter.loss import LossConfig
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import TargetHead


@dataclass(frozen=True)
class DrafterKind:
    """One kind of drafter and its names in the serving formats."""

    name: str
    """``drafter.kind`` and ``DraftConfig.kind``."""
    model: type[DFlashDrafter]
    """The drafter class."""
    zlab_architecture: str
    """config.json ``architectures`` of z-lab's format (vLLM method "dflash", SGLang)."""
    speculators_type: str
    """config.json ``speculators_model_type`` of the speculators format."""
    speculators_architecture: str
    """config.json ``architectures`` of the speculators format."""
    speculators_sliding_non_causal: bool
    """What speculators assumes of ``sliding_window_non_causal`` when a config of this kind leaves it out."""
    config_fields: tuple[str, ...] = ()
    """DraftConfig fields of the kind written into ``dflash_config`` (z-lab) or the top level (speculators)."""
    llamacpp_spec_type: str | None = None
    """llama-server's ``--spec-type`` for a draft GGUF of this kind (None: llama.cpp does not serve it)."""
    vllm_cpu: bool = False
    """vLLM's CPU build serves it (its V1 model runner refuses DFlash 2's candidate head: GPUs only)."""
    llamacpp_refusal: Callable[[DraftConfig], str | None] | None = None
    """Why llama.cpp would refuse to load a drafter of this kind with this config (None: it loads it)."""


def selector_lattice_refusal(config: DraftConfig) -> str | None:
    """llama.cpp builds DFlash 2's selector walk on a lattice of top_k x (top_k + 1) slots of the hidden state and
    refuses a draft whose hidden size is smaller ("DFlash2 hidden size is too small for the selector lattice")."""
    top_k, hidden = config.selector_top_k, config.hidden_size
    if hidden >= top_k * (top_k + 1):
        return None
    fits = max(k for k in range(1, top_k + 1) if hidden >= k * (k + 1))
    return (
        f"llama.cpp serves a DFlash 2 drafter only where hidden_size >= selector_top_k * (selector_top_k + 1) (its "
        f"selector lattice): this one has hidden_size {hidden} and selector_top_k {top_k}; train it with "
        f"drafter.selector_top_k = {fits} or less, or serve the z-lab export with vLLM or SGLang"
    )


KINDS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            "dflash",
            DFlashDrafter,
            "DFlashDraftModel",
            "dflash",
            "DFlashSpeculator",
            False,
            llamacpp_spec_type="draft-dflash",
            vllm_cpu=True,
        ),
        DrafterKind(
            "dflash2",
            DFlash2Drafter,
            "DFlash2DraftModel",
            "dflash2",
            "DFlash2DraftModel",
            True,
            ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
            # the same spec type: the server walks the selector when the GGUF's dflash.selector_top_k > 0
            llamacpp_spec_type="draft-dflash",
            llamacpp_refusal=selector_lattice_refusal,
        ),
    )
}


def kind_of(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"drafter kind must be one of {sorted(KINDS)}, got {name!r}")
    return KINDS[name]


def kind_of_export(config_json: dict) -> DrafterKind | None:
    """The kind an exported config.json of either format describes (None: neither format's)."""
    speculators_type = config_json.get("speculators_model_type")
    architectures = config_json.get("architectures") or []
    for kind in KINDS.values():
        if speculators_type == kind.speculators_type or (
            speculators_type is None and kind.zlab_architecture in architectures
        ):
            return kind
    return None


def build_drafter(
    config: DraftConfig,
    target_head: TargetHead,
    loss_config: LossConfig | None = None,
    attention_backend: str | None = None,
    device: torch.device | None = None,
) -> DFlashDrafter:
    """A fresh drafter of ``config.kind`` (built on ``device`` when given)."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return kind_of(config.kind).model(config, target_head, loss_config, attention_backend)

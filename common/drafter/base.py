"""The interface every drafter kind implements (``Drafter``); the trainer, the producers' evaluator and export call
only what it states.

A drafter shares the target's frozen embedding, final norm and lm_head (``target_head``) and owns the rest; its state
dict holds only its own weights, named as its export writes them. A block drafter runs in two halves, which the
evaluator drives separately with a KV cache: the backbone (``fuse_context``, ``layers``, ``rotary``, ``norm``: the
hidden states of a block's slots) and ``propose`` (the tokens decoding drafts from those hidden states). Training
runs ``forward_train``: ``prepare`` (anchors, blocks, masks), the backbone, then ``objective``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from common.batch import PackedBatch
from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import DraftConfig
from common.drafter.loss import LossConfig
from common.drafter.sampling import Proposal, Sampling
from common.drafter.target_head import TargetHead


class Drafter(nn.Module, ABC):
    """A drafter of one kind (common/drafter/kinds.py). The backbone's modules are attributes: ``fc`` and
    ``hidden_norm`` (the fused target features), ``layers`` (called as ``layer(x, ctx, rope, mask)``, ``rope``
    the rotary tables ``rope(...)`` makes), ``rotary`` and ``norm``."""

    kind: str
    """The kind's name, as in the kinds table."""
    logged_metrics: tuple[str, ...]
    """Scalar metrics of ``objective`` beyond the common ones (loss, tau, acc), logged by the trainer."""
    reads_block_context: bool
    """``objective`` and ``propose`` read each block's context row: the fused target features of the token before
    the block's given one (``block_context``; zeros where the block starts its document)."""

    config: DraftConfig
    loss_config: LossConfig
    target_head: TargetHead
    layers: nn.ModuleList

    @abstractmethod
    def fuse_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, n * H_target] target features -> [T, H] context the layers attend to."""

    @abstractmethod
    def block_context(self, aux_hidden: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
        """[N, H] each block's context row (see ``reads_block_context``)."""

    @abstractmethod
    def prepare(self, batch: PackedBatch, num_anchors: int, generator: torch.Generator) -> tuple[DraftBlocks, dict]:
        """Anchors, blocks and per-layer-type masks of a batch (no host sync on CUDA: it can run ahead of the step)."""

    @abstractmethod
    def forward_train(
        self,
        batch: PackedBatch,
        num_anchors: int,
        generator: torch.Generator,
        step_fraction: float = 0.0,
        prepared: tuple[DraftBlocks, dict] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (scalar, differentiable) and metrics (device tensors, no host sync) of one packed batch."""

    @abstractmethod
    def objective(
        self,
        hidden: torch.Tensor,
        blocks: DraftBlocks,
        target_hidden: torch.Tensor | None = None,
        loss_config: LossConfig | None = None,
        context: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and metrics of the draft slots ``hidden`` [N, B, H]. ``tau``, ``acc`` and ``block_streaks`` describe
        the tokens ``propose`` would draft, teacher-forced; ``target_hidden`` [T, H] is the target's final-normed last
        hidden state where the producers ship it; ``context`` [N, H] each block's context row, for a kind that
        ``reads_block_context``."""

    @abstractmethod
    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
        context: torch.Tensor | None = None,
    ) -> Proposal:
        """Draft tokens of slots 1..B-1 from the block's hidden states [R, B, H] (slot 0's is the given token's);
        ``anchor_ids`` [R] are the blocks' given tokens, ``context`` [R, H] their context rows (a kind that
        ``reads_block_context``). Sampled proposals keep the distribution they were drawn from, for lossless rejection
        sampling."""

    @abstractmethod
    def warm_start(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights of this kind, or of a kind in its ``warm_starts_from`` (the rest at values that propose what
        that drafter proposed); ValueError for anything else."""

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

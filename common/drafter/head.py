"""What a drafter kind adds to the DFlash backbone: its head (``KindHead``), the one input of each of its two hooks
(``ObjectiveInput``, ``ProposalInput``) and the slot walk its proposals share (``walk_slots``).

The backbone (common/drafter/model.py, ``DFlashDrafter``) owns the layers, the target features' fusion, the masks
and the training step; a kind's head adds modules of its own (``parts``, held by the backbone under those names, so
the state dict and every export name them as the kind's references do), may make the decoder layers
(``make_layer``), and turns the slots' hidden states into a loss (``objective``) and into draft tokens
(``propose``). The kind's line of the kinds table names its head; DFlash itself has none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import DraftConfig
from common.drafter.loss import LossConfig
from common.drafter.sampling import Proposal, Sampling, sample_from, sampling_probs
from common.drafter.target_head import TargetHead


@dataclass(frozen=True)
class ObjectiveInput:
    """What a head's objective reads of one training step's blocks."""

    hidden: torch.Tensor
    """[N, B, H] the draft's hidden states after the final norm; slot 0 is the block's given token."""
    blocks: DraftBlocks
    """The blocks: given tokens, labels, their mask and positions."""
    target_head: TargetHead
    """The target's frozen embedding and head."""
    loss_config: LossConfig
    """The DFlash loss's settings (objective, label mode, slot weighting, chunk size)."""
    target_hidden: torch.Tensor | None = None
    """[T, H] the target's final-normed last hidden state, where the producers ship it."""
    context: torch.Tensor | None = None
    """[N, H] each block's context row, for a head that ``reads_block_context``."""

    @property
    def slot_rows(self) -> torch.Tensor:
        """[N * (B-1), H] the drafted slots' hidden states, block by block."""
        return self.hidden[:, 1:].reshape(-1, self.hidden.shape[-1])


@dataclass(frozen=True)
class ProposalInput:
    """What a head's proposal reads of R blocks being decoded."""

    hidden: torch.Tensor
    """[R, B, H] the draft's hidden states after the final norm; slot 0 is the block's given token."""
    logits: torch.Tensor
    """[R, B-1, V] fp32 the drafted slots' logits through the target's head (what DFlash proposes from)."""
    anchor_ids: torch.Tensor
    """[R] the blocks' given tokens."""
    target_head: TargetHead
    """The target's frozen embedding and head."""
    sampling: Sampling | None = None
    """The server's sampling settings (None or temperature 0: greedy)."""
    generator: torch.Generator | None = None
    """Drives the draws of a sampled proposal."""
    context: torch.Tensor | None = None
    """[R, H] each block's context row, for a head that ``reads_block_context``."""

    @property
    def sampled(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy


def walk_slots(
    scores_of: Callable[[int, torch.Tensor | None], torch.Tensor],
    slots: int,
    walk: ProposalInput,
    over_vocabulary: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A proposal's walk over the drafted slots, left to right, each slot's scores depending on the pick before it:
    ``scores_of(slot, previous pick)`` (None before the first) gives [R, C] scores. Greedy, each pick is the argmax;
    sampled, a draw from the sampling distribution (``over_vocabulary``: the server's, with its top-k and top-p;
    else the softmax at the temperature over C candidates). Returns the picks [R, S] and, sampled, the
    distributions they were drawn from [R, S, C] (kept for rejection sampling)."""
    picks, probs = [], []
    pick = None
    for slot in range(slots):
        scores = scores_of(slot, pick)
        if walk.sampled:
            if over_vocabulary:
                q = sampling_probs(scores.float(), walk.sampling)
            else:
                q = torch.softmax(scores / walk.sampling.temperature, dim=-1)
            pick = sample_from(q, walk.generator)
            probs.append(q)
        else:
            pick = scores.argmax(-1)
        picks.append(pick)
    return torch.stack(picks, 1), torch.stack(probs, 1) if walk.sampled else None


def candidate_chunk(loss_config: LossConfig, head_weight: torch.Tensor, top_k: int) -> int:
    """Rows per chunk of a pass over K candidates' head rows: as many values as the head's chunk of logits."""
    return loss_config.chunk_rows * max(1, head_weight.shape[0] // (top_k * head_weight.shape[1]))


def path_metrics(
    metrics: dict[str, torch.Tensor], path: dict[str, torch.Tensor], loss: torch.Tensor, base_name: str
) -> dict[str, torch.Tensor]:
    """The DFlash loss's ``metrics`` with ``tau``, ``acc`` and ``block_streaks`` those of the head's own walk
    (``path``), the draft argmax's tau kept as ``base_name`` and the objective's ``loss``."""
    out = dict(metrics)
    out.update(
        loss=loss.detach(),
        tau=path["tau"],
        acc=path["acc"],
        block_streaks=path["block_streaks"],
        **{base_name: metrics["tau"]},
    )
    return out


class KindHead(ABC):
    """What a kind adds to the DFlash backbone (see the module's doc). Built by the backbone once its own modules
    exist; its modules (``parts``) are the backbone's to hold, so a head keeps modules, never their tensors (FSDP
    replaces those)."""

    title: ClassVar[str]
    """The kind's name in messages ("DSpark")."""
    logged_metrics: ClassVar[tuple[str, ...]] = ()
    """Scalar metrics of ``objective`` beyond the common ones (loss, tau, acc), logged by the trainer."""
    reads_block_context: ClassVar[bool] = False
    """``objective`` and ``propose`` read each block's context row (``ObjectiveInput.context``)."""
    state_names: ClassVar[tuple[str, ...]] = ()
    """The names of the head's weights in the drafter's state dict (a part of each dotted name): what a warm start
    from its backbone leaves at ``reset``'s values."""

    def __init__(self, config: DraftConfig) -> None:
        self.config = config  # the drafter's own: a restart may change its options' training fields in place

    @staticmethod
    def make_layer(config: DraftConfig, layer_type: str) -> nn.Module | None:
        """The kind's decoder layer (None: DFlash's)."""
        return None

    def parts(self) -> dict[str, nn.Module | None]:
        """The head's modules by the name the drafter holds each under (its state dict's prefix)."""
        return {}

    def owns(self, name: str) -> bool:
        """A name of the drafter's state dict is one of the head's weights."""
        return not set(name.split(".")).isdisjoint(self.state_names)

    @abstractmethod
    def reset(self, drafter: nn.Module, std: float = 0.02) -> None:
        """The head's weights at values where the drafter proposes what its backbone alone does (greedy)."""

    @abstractmethod
    def objective(self, slots: ObjectiveInput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (scalar, differentiable) and metrics (device tensors) of the slots: ``tau``, ``acc`` and
        ``block_streaks`` describe the tokens ``propose`` would draft, teacher-forced."""

    @abstractmethod
    def propose(self, slots: ProposalInput) -> Proposal:
        """Draft tokens of slots 1..B-1; sampled, with the distributions they were drawn from."""

"""DFlash objective: a chunked lm_head + loss that never holds N x B x vocab logits, and the metrics.

The head is the target's frozen lm_head, so only the gradient with respect to the draft hidden
state is needed. ``ChunkedHeadLoss`` computes, chunk by chunk, logits -> per-row loss -> the
row's unit gradient ``d loss_i / d h_i`` in the forward pass (Liger-style: two head matmuls in all,
no recompute), and the backward only scales those rows by the incoming per-row weights. Returning
per-row losses keeps the weighting (decay, streak-aware) in ordinary autograd code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import default_gamma

LABEL_MODES = ("data", "target_hard", "target_soft")
WEIGHTINGS = ("decay", "streak")


@dataclass
class LossConfig:
    """How the drafter is supervised."""

    label_mode: str = "data"
    """"data": CE on the data token x_{a+k}; "target_hard": CE on the target's argmax at a+k-1;
    "target_soft": KL(target || draft) on the target's distribution at a+k-1 (needs last_hidden)."""
    gamma: float | None = None
    """Decay of the slot weight exp(-(k-1)/gamma); None -> 7 for B=16, 4 for B=8."""
    weighting: str = "decay"
    """"decay": exp(-(k-1)/gamma); "streak": detached probability that the streak reaches slot k."""
    streak_alpha: float = 0.5
    """Floor a of the streak weights: q~ = (1 - a) exp(-CE) + a."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target features, relative to each layer's per-token RMS;
    annealed to 0 on a cosine over training (step_fraction 0 -> 1)."""
    chunk_rows: int = 1024
    """Rows of the head computed at once (memory ~ 4 x chunk_rows x vocab x 4 bytes)."""

    def __post_init__(self) -> None:
        if self.label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {self.label_mode!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if not 0.0 <= self.streak_alpha <= 1.0:
            raise ValueError(f"streak_alpha must lie in [0, 1], got {self.streak_alpha}")
        if self.feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0, got {self.feature_noise}")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")

    def noise_scale(self, step_fraction: float) -> float:
        """Cosine-annealed feature noise at this point of training."""
        fraction = min(max(step_fraction, 0.0), 1.0)
        return self.feature_noise * 0.5 * (1.0 + math.cos(math.pi * fraction))


class ChunkedHeadLoss(torch.autograd.Function):
    """Per-row loss of ``hidden @ head_weight.T`` against hard labels or a soft target, in row chunks.

    Returns ``(row_loss [M] fp32, draft_argmax [M], label_used [M])``; only row_loss is differentiable,
    and only with respect to ``hidden``.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor | None,
                target_hidden: torch.Tensor | None, soft: bool, chunk_rows: int):
        rows = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        row_loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        draft_argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        label_used = torch.empty(rows, dtype=torch.long, device=hidden.device)
        unit_grad = torch.empty_like(hidden) if need_grad else None
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, min(start + chunk_rows, rows))
            logits = (hidden[chunk].to(head_weight.dtype) @ head_weight.T).float()
            draft_argmax[chunk] = logits.argmax(-1)
            log_norm = torch.logsumexp(logits, -1, keepdim=True)
            if target_hidden is not None:
                target_logits = (target_hidden[chunk].to(head_weight.dtype) @ head_weight.T).float()
                label = target_logits.argmax(-1)
            else:
                label = labels[chunk]
            label_used[chunk] = label
            if soft:
                target_logp = torch.log_softmax(target_logits, -1)
                target_p = target_logp.exp()
                # KL(p || q) = sum p (log p - logits + logZ)
                row_loss[chunk] = (target_p * (target_logp - logits)).sum(-1) + log_norm.squeeze(-1)
            else:
                row_loss[chunk] = log_norm.squeeze(-1) - logits.gather(-1, label[:, None]).squeeze(-1)
            if need_grad:
                grad_logits = logits.sub_(log_norm).exp_()  # softmax, in place
                if soft:
                    grad_logits.sub_(target_p)
                else:
                    grad_logits.scatter_add_(-1, label[:, None], grad_logits.new_full((label.shape[0], 1), -1.0))
                unit_grad[chunk] = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        ctx.save_for_backward(unit_grad)
        ctx.mark_non_differentiable(draft_argmax, label_used)
        return row_loss, draft_argmax, label_used

    @staticmethod
    def backward(ctx, grad_row_loss, _grad_argmax, _grad_label):
        (unit_grad,) = ctx.saved_tensors
        grad_hidden = unit_grad * grad_row_loss[:, None].to(unit_grad.dtype)
        return grad_hidden, None, None, None, None, None


def chunked_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor | None = None,
                      target_hidden: torch.Tensor | None = None, soft: bool = False,
                      chunk_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, draft argmax and the label used. Give ``labels`` (hard CE) or ``target_hidden``
    (already final-normed target states: argmax CE, or KL when ``soft``)."""
    if (labels is None) == (target_hidden is None):
        raise ValueError("give exactly one of labels and target_hidden")
    if soft and target_hidden is None:
        raise ValueError("soft labels need target_hidden")
    return ChunkedHeadLoss.apply(hidden, head_weight, labels, target_hidden, soft, chunk_rows)


def slot_weights(blocks: DraftBlocks, config: LossConfig, row_loss: torch.Tensor) -> torch.Tensor:
    """[N, B-1] loss weights of the supervised slots (detached)."""
    mask = blocks.label_mask.float()
    num_slots = mask.shape[1]
    if config.weighting == "streak":
        reach = (1.0 - config.streak_alpha) * torch.exp(-row_loss.detach().view_as(mask)) + config.streak_alpha
        reach = torch.where(blocks.label_mask, reach, 1.0)
        prefix = torch.cumprod(reach, dim=1)
        weights = prefix.flip(1).cumsum(1).flip(1)  # w_k = sum_{m >= k} prod_{i <= m} q~_i
    else:
        gamma = config.gamma if config.gamma is not None else default_gamma(num_slots + 1)
        slot = torch.arange(num_slots, device=mask.device, dtype=torch.float32)  # k - 1
        weights = torch.exp(-slot / gamma)[None, :].expand_as(mask)
    return weights * mask


def draft_loss(hidden: torch.Tensor, blocks: DraftBlocks, head_weight: torch.Tensor, config: LossConfig,
               target_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics of the draft slots.

    hidden: [N, B, H] draft output after its final norm. target_hidden: [T, H] target last hidden
    state after the target's final norm (target label modes only).
    """
    num_blocks, block_size, width = hidden.shape
    rows = hidden[:, 1:].reshape(-1, width)  # slot 0 is the given token
    if config.label_mode == "data":
        row_loss, draft_argmax, label_used = chunked_head_loss(
            rows, head_weight, labels=blocks.label_ids.reshape(-1), chunk_rows=config.chunk_rows)
    else:
        if target_hidden is None:
            raise ValueError(f"label_mode {config.label_mode!r} needs the target's last hidden state")
        # The target predicts x_{a+k} from position a + k - 1.
        source = (blocks.label_index - 1).reshape(-1)
        row_loss, draft_argmax, label_used = chunked_head_loss(
            rows, head_weight, target_hidden=target_hidden[source], soft=config.label_mode == "target_soft",
            chunk_rows=config.chunk_rows)
    weights = slot_weights(blocks, config, row_loss)
    loss = (weights.reshape(-1) * row_loss).sum() / weights.sum().clamp_min(1e-6)
    metrics = draft_metrics(blocks, row_loss.detach().view(num_blocks, -1),
                            (draft_argmax == label_used).view(num_blocks, -1))
    metrics["loss"] = loss.detach()
    return loss, metrics


def draft_metrics(blocks: DraftBlocks, row_loss: torch.Tensor, correct: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device tensors: acc [B-1] (acc_k for k = 1..B-1), tau, mean unweighted loss, counts."""
    mask = blocks.label_mask
    supervised = mask.float()
    correct = correct & mask
    per_slot = supervised.sum(0)
    accuracy = correct.float().sum(0) / per_slot.clamp_min(1.0)
    # Leading correct slots; an unsupervised slot (document end, prompt token) ends the streak.
    streak = torch.cumprod(correct.long(), dim=1).sum(1).float()
    valid = blocks.valid.float()
    num_valid = valid.sum()
    return {
        "acc": accuracy,
        "tau": 1.0 + (streak * valid).sum() / num_valid.clamp_min(1.0),
        "ce": (row_loss * supervised).sum() / supervised.sum().clamp_min(1.0),
        "num_blocks": num_valid,
        "num_supervised": supervised.sum(),
    }

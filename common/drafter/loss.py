"""DFlash objective: a chunked lm_head + loss that never holds N x B x vocab logits, and the metrics.

The head is the target's frozen lm_head, so only the gradient with respect to the draft hidden
state is needed. ``ChunkedHeadLoss`` computes, chunk by chunk, logits -> per-row loss -> the
row's unit gradient ``d loss_i / d h_i`` in the forward pass (Liger-style: two head matmuls in all,
no recompute), and the backward only scales those rows by the incoming per-row weights. Returning
per-row losses keeps the weighting (decay, streak-aware, D-PACE) in ordinary autograd code.

The row loss is the label mode's cross-entropy, or an LK loss (arXiv 2602.23881) built on the row's
acceptance rate: q(label) for a hard label, sum_v min(p_v, q_v) for a soft target.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import default_gamma

LABEL_MODES = ("data", "target_hard", "target_soft")
WEIGHTINGS = ("decay", "streak", "dpace")
OBJECTIVES = ("ce", "lk", "lk_hybrid")


@dataclass
class LossConfig:
    """How the drafter is supervised."""

    label_mode: str = "data"
    """"data": CE on the data token x_{a+k}; "target_hard": CE on the target's argmax at a+k-1;
    "target_soft": KL(target || draft) on the target's distribution at a+k-1 (needs last_hidden)."""
    gamma: float | None = None
    """Decay of the slot weight exp(-(k-1)/gamma); None -> the published rule, default_gamma (7 for B=16, 5 for
    B=10, 4 for B=8)."""
    weighting: str = "decay"
    """"decay": exp(-(k-1)/gamma); "streak": detached probability that the streak reaches slot k;
    "dpace": D-PACE (arXiv 2605.18810), w_k = sum over supervised m >= k of prod_{i <= m} q~_i, detached,
    with q~_i = (1 - dpace_alpha) a_i + dpace_alpha and a_i the slot's acceptance rate (the draft's
    probability of the label; sum_v min(p_v, q_v) for target_soft). Unsupervised slots are skipped."""
    streak_alpha: float = 0.5
    """Floor a of the streak weights: q~ = (1 - a) exp(-CE) + a."""
    dpace_alpha: float = 0.5
    """Smoothing floor of the D-PACE confidences, in (0, 1] (arXiv 2605.18810, Eq. 7): q~ >= dpace_alpha
    keeps the weights of late slots from vanishing; 1 ignores the confidences (w_k = supervised slots >= k)."""
    objective: str = "ce"
    """Row loss. "ce": the label mode's CE (KL for target_soft). LK losses (arXiv 2602.23881) train the
    acceptance rate a (q(label) for hard labels, sum_v min(p_v, q_v) for target_soft) directly:
    "lk": -log a (for hard labels this is the CE itself); "lk_hybrid": lam CE + (1 - lam)(1 - a) with
    lam = exp(-lk_eta a) per row, detached, so a row leans on CE while its acceptance is low."""
    lk_eta: float = 3.0
    """Decay eta of the lk_hybrid share of CE, lam = exp(-eta a) (arXiv 2602.23881, their eta = 3);
    0 keeps pure CE, larger hands rows to the acceptance term sooner."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target features, relative to each layer's per-token RMS;
    annealed to 0 on a cosine over training (step_fraction 0 -> 1)."""
    chunk_rows: int = 1024
    """Rows of the head computed at once (memory ~ 4 x chunk_rows x vocab x 4 bytes; ~5 x for an LK
    objective on target_soft)."""

    @property
    def labels_from_target(self) -> bool:
        """The labels are the target's (target_hard, target_soft): the loss needs its last hidden state."""
        return self.label_mode != "data"

    def __post_init__(self) -> None:
        if self.label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {LABEL_MODES}, got {self.label_mode!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")
        if not 0.0 <= self.streak_alpha <= 1.0:
            raise ValueError(f"streak_alpha must lie in [0, 1], got {self.streak_alpha}")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must lie in (0, 1], got {self.dpace_alpha}")
        if not 0.0 <= self.lk_eta < math.inf:
            raise ValueError(f"lk_eta must be finite and >= 0, got {self.lk_eta}")
        if self.feature_noise < 0:
            raise ValueError(f"feature_noise must be >= 0, got {self.feature_noise}")
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")

    def noise_scale(self, step_fraction: float) -> float:
        """Cosine-annealed feature noise at this point of training."""
        fraction = min(max(step_fraction, 0.0), 1.0)
        return self.feature_noise * 0.5 * (1.0 + math.cos(math.pi * fraction))


class HeadRows(NamedTuple):
    """Per-row outputs of the chunked head; only ``loss`` is differentiable, and only w.r.t. hidden."""

    loss: torch.Tensor
    """[M] fp32: the objective's row loss."""
    ce: torch.Tensor
    """[M] fp32, detached: the row's CE (KL for a soft target); ``loss.detach()`` under objective "ce"."""
    acceptance: torch.Tensor | None
    """[M] fp32, detached: acceptance rate, q(label) for a hard label or sum_v min(p_v, q_v) for a soft
    target; None under objective "ce" unless asked for."""
    draft_argmax: torch.Tensor
    """[M] int64: the draft's top token."""
    label_used: torch.Tensor
    """[M] int64: the hard label (the target's argmax for a target label mode)."""
    top_ids: torch.Tensor | None = None
    """[M, K] int64, most likely first: the draft's top-K tokens, when asked for (a DFlash 2 selector's candidates)."""


def _lk_rows(
    objective: str, ce: torch.Tensor, acceptance: torch.Tensor, lk_eta: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An LK row loss from the row's CE and acceptance a, with the coefficients of its differential
    ``d loss = ce_coef d CE - overlap_coef d a`` (constants: lam is not differentiated)."""
    if objective == "lk":
        # d(-log a) = -d a / a stays bounded (each logit's share of d a is at most a), so no floor is needed;
        # the clamp only keeps the log finite should the whole overlap underflow.
        acceptance = acceptance.clamp_min(torch.finfo(acceptance.dtype).tiny)
        return -acceptance.log(), torch.zeros_like(ce), acceptance.reciprocal()
    ce_share = torch.exp(-lk_eta * acceptance)
    return ce_share * ce + (1.0 - ce_share) * (1.0 - acceptance), ce_share, 1.0 - ce_share


def _soft_lk_grad(
    draft_p: torch.Tensor,
    target_p: torch.Tensor,
    draft_below_target: torch.Tensor,
    ce_coef: torch.Tensor,
    overlap_coef: torch.Tensor,
) -> torch.Tensor:
    """d loss / d logits of ``ce_coef KL(p || q) - overlap_coef sum_v min(p_v, q_v)``, written over draft_p.

    d KL / d z = q - p. d min(p_v, q_v) = [q_v < p_v] d q_v and d q_v / d z_j = q_v (delta_vj - q_j), so
    d overlap / d z_j = q_j ([q_j < p_j] - s) with s = sum_v [q_v < p_v] q_v.
    """
    captured = torch.where(draft_below_target, draft_p, 0.0).sum(-1, keepdim=True)  # s
    # q (ce_coef + overlap_coef (s - [q < p])) - ce_coef p, in place to hold one extra chunk x vocab tensor.
    scale = draft_below_target.to(draft_p.dtype).sub_(captured).mul_(-overlap_coef[:, None]).add_(ce_coef[:, None])
    return draft_p.mul_(scale).addcmul_(target_p, ce_coef[:, None], value=-1.0)


def _row_ce(
    logits: torch.Tensor, log_norm: torch.Tensor, label: torch.Tensor, target_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's CE: to the target's distribution where its logits are given (soft; returned beside it), else to
    the label."""
    if target_logits is None:
        return log_norm.squeeze(-1) - logits.gather(-1, label[:, None]).squeeze(-1), None
    target_logp = torch.log_softmax(target_logits, -1)
    target_p = target_logp.exp()
    # KL(p || q) = sum p (log p - logits + logZ)
    return (target_p * (target_logp - logits)).sum(-1) + log_norm.squeeze(-1), target_p


def _grad_logits(
    draft_p: torch.Tensor,
    label: torch.Tensor,
    target_p: torch.Tensor | None,
    lk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
) -> torch.Tensor:
    """d row loss / d logits of a chunk, written over the draft softmax ``draft_p``: the CE's (q - p for a soft
    target, q minus the label's one-hot for a hard one) or, for an LK row (``lk``: its acceptance, the coefficients
    of :func:`_lk_rows` and, for a soft target, where the draft is below it), the LK loss's."""
    if lk is not None and target_p is not None:
        _, ce_coef, overlap_coef, draft_below_target = lk
        return _soft_lk_grad(draft_p, target_p, draft_below_target, ce_coef, overlap_coef)
    if target_p is not None:
        draft_p.sub_(target_p)
    else:
        draft_p = minus_one_hot(draft_p, label)
    if lk is not None:
        # Hard lk_hybrid: d a = d q(label) = -a d CE, so the row's gradient is the CE's, scaled.
        accept, ce_coef, overlap_coef, _ = lk
        draft_p.mul_((ce_coef + overlap_coef * accept)[:, None])
    return draft_p


def minus_one_hot(p: torch.Tensor, label: torch.Tensor, value: float = 1.0) -> torch.Tensor:
    """``p`` less ``value`` at each row's label: eager, a scatter into ``p`` in place; compiled, one elementwise
    expression, which fuses with the softmax before it and the cast after it (a scatter is a mutation, which the
    compiler writes out whole in fp32 and casts back in a kernel of its own)."""
    if torch.compiler.is_compiling():
        columns = torch.arange(p.shape[-1], device=p.device)
        return p - (columns == label[:, None]).to(p.dtype) * value
    return p.scatter_add_(-1, label[:, None], p.new_full((label.shape[0], 1), -value))


TOP_K_GROUP = 256
"""Columns per group of :func:`top_k_indices`' first pass."""


def top_k_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[rows, k] indices of each row's k largest logits, most likely first: ``logits.topk(k).indices``, exact, in two
    passes that never sort a vocabulary-wide row. The k largest lie in the k groups of TOP_K_GROUP columns with the
    largest maxima (each group with a larger maximum holds a larger value), so the second pass selects among k x
    TOP_K_GROUP columns. On an H200, topk over the whole rows took 13 ms of each step at the Qwen3-8B draft shapes,
    half of what DFlash 2 added to the step."""
    rows, width = logits.shape
    full = width // TOP_K_GROUP
    if full < 2 * k:
        return logits.topk(k, dim=-1).indices
    maxima = logits[:, : full * TOP_K_GROUP].view(rows, full, TOP_K_GROUP).amax(-1)
    if width > full * TOP_K_GROUP:  # the columns past the last whole group form one more group
        maxima = torch.cat([maxima, logits[:, full * TOP_K_GROUP :].amax(-1, keepdim=True)], dim=1)
    groups = maxima.topk(k, dim=-1).indices  # [rows, k]
    columns = (groups[:, :, None] * TOP_K_GROUP + torch.arange(TOP_K_GROUP, device=logits.device)).view(rows, -1)
    if width == full * TOP_K_GROUP:  # whole groups only (49,152 and 248,320 columns): no column to mask
        values = logits.gather(1, columns)
    else:
        inside = columns < width  # the short last group's missing columns
        values = logits.gather(1, columns.clamp_max(width - 1)).masked_fill(~inside, float("-inf"))
    return columns.gather(1, values.topk(k, dim=-1).indices)


def _chunk_rows(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    target_logits: torch.Tensor | None,
    soft: bool,
    objective: str,
    lk_eta: float,
    with_acceptance: bool,
    need_grad: bool,
    top_k: int,
) -> tuple[torch.Tensor, ...]:
    """One chunk's rows from its draft logits [c, V] (and the target's, for target labels), in the head's dtype:
    the draft's argmax, the label used, the row loss, the CE, the acceptance (None unless asked for or LK), when
    ``need_grad`` d row loss / d logits in the logits' dtype, and when ``top_k`` the draft's top-K tokens (else
    None)."""
    dtype = logits.dtype
    top_ids = top_k_indices(logits, top_k) if top_k else None
    logits = logits.float()
    draft_argmax = logits.argmax(-1)
    log_norm = torch.logsumexp(logits, -1, keepdim=True)
    target_logits = None if target_logits is None else target_logits.float()
    label = labels if target_logits is None else target_logits.argmax(-1)
    ce, target_p = _row_ce(logits, log_norm, label, target_logits if soft else None)
    # The draft softmax, in place: the logits are not needed past this point.
    draft_p = logits.sub_(log_norm).exp_() if need_grad or (soft and with_acceptance) else None
    draft_below_target = draft_p < target_p if soft and with_acceptance else None
    accept = None
    if with_acceptance:
        # a one-hot target overlaps the draft in q(label) alone
        accept = torch.where(draft_below_target, draft_p, target_p).sum(-1) if soft else torch.exp(-ce)
    # For a one-hot target -log(acceptance) = -log q(label) is the CE, so "lk" rows take the CE path.
    if objective == "ce" or (objective == "lk" and not soft):
        row_loss, lk = ce, None
    else:
        row_loss, ce_coef, overlap_coef = _lk_rows(objective, ce, accept, lk_eta)
        lk = (accept, ce_coef, overlap_coef, draft_below_target)
    grad_logits = _grad_logits(draft_p, label, target_p, lk).to(dtype) if need_grad else None
    return draft_argmax, label, row_loss, ce, accept, grad_logits, top_ids


def compile_rows(function: Callable[..., tuple]) -> Callable[..., tuple]:
    """``function``, a chunk's per-row work, compiled: its row count dynamic (the last chunk is shorter), its float
    arguments (an objective's weights, fixed for a run) constants of the graph. Left to dynamo, a float becomes a 0-d
    host tensor that the generated code reads with an ``item()`` on every call, a few host reads per chunk."""
    compiled = torch.compile(function, dynamic=True)

    @functools.wraps(function)
    def rows(*args: object) -> tuple:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)

    return rows


@functools.cache
def _compiled_chunk_rows() -> Callable[..., tuple[torch.Tensor, ...]]:
    """:func:`_chunk_rows` compiled (made on the first CUDA chunk): a few fused kernels that read the chunk's logits,
    where eager launches a dozen vocabulary-wide fp32 ones a chunk (their traffic and launches took more time than the
    chunk's two products at small hidden sizes)."""
    return compile_rows(_chunk_rows)


def _chunk_function(device: torch.device) -> Callable[..., tuple[torch.Tensor, ...]]:
    """:func:`_chunk_rows`, compiled on CUDA; eager elsewhere."""
    return _compiled_chunk_rows() if device.type == "cuda" else _chunk_rows


class ChunkedHeadLoss(torch.autograd.Function):
    """Per-row loss of ``hidden @ head_weight.T`` against hard labels or a soft target, in row chunks.

    Returns ``(row_loss [M] fp32, draft_argmax [M], label_used [M], row_ce [M] or None, acceptance [M]
    or None, top_ids [M, top_k] or None)``; only row_loss is differentiable, and only with respect to ``hidden``.
    row_ce is None under objective "ce" (it is row_loss); acceptance is computed for the LK objectives or when
    asked for; top_ids when top_k > 0.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        head_weight: torch.Tensor,
        labels: torch.Tensor | None,
        target_hidden: torch.Tensor | None,
        soft: bool,
        chunk_rows: int,
        objective: str,
        lk_eta: float,
        with_acceptance: bool,
        top_k: int = 0,
    ):
        rows = hidden.shape[0]
        need_grad = ctx.needs_input_grad[0]
        with_acceptance = with_acceptance or objective != "ce"
        row_loss = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        row_ce = torch.empty_like(row_loss) if objective != "ce" else None
        acceptance = torch.empty_like(row_loss) if with_acceptance else None
        draft_argmax = torch.empty(rows, dtype=torch.long, device=hidden.device)
        label_used = torch.empty(rows, dtype=torch.long, device=hidden.device)
        top_ids = torch.empty(rows, top_k, dtype=torch.long, device=hidden.device) if top_k else None
        unit_grad = torch.empty_like(hidden) if need_grad else None
        chunk_values = _chunk_function(hidden.device)
        for start in range(0, rows, chunk_rows):
            chunk = slice(start, min(start + chunk_rows, rows))
            logits = hidden[chunk].to(head_weight.dtype) @ head_weight.T
            target_logits = None
            if target_hidden is not None:
                target_logits = target_hidden[chunk].to(head_weight.dtype) @ head_weight.T
            argmax, label, loss, ce, accept, grad_logits, top = chunk_values(
                logits,
                None if labels is None else labels[chunk],
                target_logits,
                soft,
                objective,
                lk_eta,
                with_acceptance,
                need_grad,
                top_k,
            )
            draft_argmax[chunk], label_used[chunk], row_loss[chunk] = argmax, label, loss
            if row_ce is not None:
                row_ce[chunk] = ce
            if acceptance is not None:
                acceptance[chunk] = accept
            if top_ids is not None:
                top_ids[chunk] = top
            if need_grad:
                unit_grad[chunk] = (grad_logits @ head_weight).to(hidden.dtype)
        ctx.save_for_backward(unit_grad)
        ctx.mark_non_differentiable(
            draft_argmax, label_used, *(side for side in (row_ce, acceptance, top_ids) if side is not None)
        )
        return row_loss, draft_argmax, label_used, row_ce, acceptance, top_ids

    @staticmethod
    def backward(ctx, grad_row_loss, _grad_argmax, _grad_label, _grad_ce, _grad_acceptance, _grad_top):
        (unit_grad,) = ctx.saved_tensors
        grad_hidden = unit_grad * grad_row_loss[:, None].to(unit_grad.dtype)
        return grad_hidden, None, None, None, None, None, None, None, None, None


def chunked_head_rows(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    target_hidden: torch.Tensor | None = None,
    soft: bool = False,
    objective: str = "ce",
    lk_eta: float = 3.0,
    with_acceptance: bool = False,
    chunk_rows: int = 1024,
    top_k: int = 0,
) -> HeadRows:
    """Per-row loss of ``objective`` (see LossConfig), CE, acceptance, draft argmax and label used.

    Give ``labels`` (hard labels) or ``target_hidden`` (already final-normed target states: their argmax,
    or their distribution when ``soft``). ``with_acceptance`` asks for the acceptance under objective "ce";
    ``top_k`` > 0 for the draft's top-K tokens of every row.
    """
    if (labels is None) == (target_hidden is None):
        raise ValueError("give exactly one of labels and target_hidden")
    if soft and target_hidden is None:
        raise ValueError("soft labels need target_hidden")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    row_loss, draft_argmax, label_used, row_ce, acceptance, top_ids = ChunkedHeadLoss.apply(
        hidden, head_weight, labels, target_hidden, soft, chunk_rows, objective, lk_eta, with_acceptance, top_k
    )
    return HeadRows(
        loss=row_loss,
        ce=row_loss.detach() if row_ce is None else row_ce,
        acceptance=acceptance,
        draft_argmax=draft_argmax,
        label_used=label_used,
        top_ids=top_ids,
    )


class CandidateLogits(torch.autograd.Function):
    """Logits of K candidate tokens per row, ``hidden[m] . head_weight[candidates[m, k]]`` [M, K] fp32, in row
    chunks (never M x K x H at once); differentiable with respect to ``hidden`` only (the head is frozen)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, candidates: torch.Tensor, chunk_rows: int):
        out = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            chunk = slice(start, start + chunk_rows)
            rows = head_weight[candidates[chunk]]  # [m, K, H]
            out[chunk] = torch.einsum("mh,mkh->mk", hidden[chunk].to(head_weight.dtype), rows).float()
        ctx.save_for_backward(head_weight, candidates)
        ctx.chunk_rows, ctx.hidden_dtype = chunk_rows, hidden.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        head_weight, candidates = ctx.saved_tensors
        grad_hidden = torch.empty(
            candidates.shape[0], head_weight.shape[1], dtype=ctx.hidden_dtype, device=grad_out.device
        )
        for start in range(0, candidates.shape[0], ctx.chunk_rows):
            chunk = slice(start, start + ctx.chunk_rows)
            rows = head_weight[candidates[chunk]]
            grad_hidden[chunk] = torch.einsum("mk,mkh->mh", grad_out[chunk].to(head_weight.dtype), rows).to(
                ctx.hidden_dtype
            )
        return grad_hidden, None, None, None


def candidate_logits(
    hidden: torch.Tensor, head_weight: torch.Tensor, candidates: torch.Tensor, chunk_rows: int = 1024
) -> torch.Tensor:
    """[M, K] fp32 logits of ``candidates`` [M, K] for the rows ``hidden`` [M, H] (see CandidateLogits)."""
    return CandidateLogits.apply(hidden, head_weight, candidates, chunk_rows)


def slot_weights(
    blocks: DraftBlocks, config: LossConfig, row_ce: torch.Tensor, acceptance: torch.Tensor | None = None
) -> torch.Tensor:
    """[N, B-1] loss weights of the supervised slots (detached).

    row_ce: [M] per-row CE (KL for target_soft), read by "streak"; acceptance: [M] per-row acceptance
    rate (HeadRows.acceptance), read by "dpace".
    """
    return mask_weights(blocks.label_mask, config, row_ce, acceptance)


def mask_weights(
    label_mask: torch.Tensor, config: LossConfig, row_ce: torch.Tensor, acceptance: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`slot_weights` of blocks given by their label mask [N, B-1] alone: a block's weights read its own
    rows only, so any whole blocks may be weighted apart."""
    mask = label_mask.float()
    num_slots = mask.shape[1]
    if config.weighting == "streak":
        reach = (1.0 - config.streak_alpha) * torch.exp(-row_ce.detach().view_as(mask)) + config.streak_alpha
        reach = torch.where(label_mask, reach, 1.0)
        prefix = torch.cumprod(reach, dim=1)
        weights = prefix.flip(1).cumsum(1).flip(1)  # w_k = sum_{m >= k} prod_{i <= m} q~_i
    elif config.weighting == "dpace":
        if acceptance is None:
            raise ValueError("weighting 'dpace' needs the rows' acceptance")
        confidence = (1.0 - config.dpace_alpha) * acceptance.detach().view_as(mask) + config.dpace_alpha
        # An unsupervised slot (prompt token) neither cuts nor scales the streak, and earns no weight.
        confidence = torch.where(label_mask, confidence, 1.0)
        reach = torch.cumprod(confidence, dim=1) * mask  # C_m = prod_{i <= m} q~_i
        weights = reach.flip(1).cumsum(1).flip(1)  # w_k = sum_{m >= k} C_m
    else:
        gamma = config.gamma if config.gamma is not None else default_gamma(num_slots + 1)
        slot = torch.arange(num_slots, device=mask.device, dtype=torch.float32)  # k - 1
        weights = torch.exp(-slot / gamma)[None, :].expand_as(mask)
    return weights * mask


def draft_loss(
    hidden: torch.Tensor,
    blocks: DraftBlocks,
    head_weight: torch.Tensor,
    config: LossConfig,
    target_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics of the draft slots.

    hidden: [N, B, H] draft output after its final norm. target_hidden: [T, H] target last hidden
    state after the target's final norm (target label modes only).
    """
    loss, metrics, _, _ = draft_loss_parts(hidden, blocks, head_weight, config, target_hidden)
    return loss, metrics


def draft_loss_parts(
    hidden: torch.Tensor,
    blocks: DraftBlocks,
    head_weight: torch.Tensor,
    config: LossConfig,
    target_hidden: torch.Tensor | None = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], HeadRows, torch.Tensor]:
    """:func:`draft_loss`, with the head's rows (the draft's ``top_k`` tokens among them when > 0) and the slot
    weights [N, B-1], for a kind whose objective builds on the DFlash loss."""
    num_blocks, block_size, width = hidden.shape
    rows = hidden[:, 1:].reshape(-1, width)  # slot 0 is the given token
    options = dict(
        objective=config.objective,
        lk_eta=config.lk_eta,
        with_acceptance=config.weighting == "dpace",
        chunk_rows=config.chunk_rows,
        top_k=top_k,
    )
    if not config.labels_from_target:
        head = chunked_head_rows(rows, head_weight, labels=blocks.label_ids.reshape(-1), **options)
    else:
        if target_hidden is None:
            raise ValueError(f"label_mode {config.label_mode!r} needs the target's last hidden state")
        # The target predicts x_{a+k} from position a + k - 1.
        source = (blocks.label_index - 1).reshape(-1)
        head = chunked_head_rows(
            rows, head_weight, target_hidden=target_hidden[source], soft=config.label_mode == "target_soft", **options
        )
    weights = slot_weights(blocks, config, head.ce, head.acceptance)
    loss = (weights.reshape(-1) * head.loss).sum() / weights.sum().clamp_min(1e-6)
    metrics = draft_metrics(
        blocks, head.ce.view(num_blocks, -1), (head.draft_argmax == head.label_used).view(num_blocks, -1)
    )
    metrics["loss"] = loss.detach()
    return loss, metrics, head, weights


def draft_metrics(blocks: DraftBlocks, row_loss: torch.Tensor, correct: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device tensors: acc [B-1] (acc_k for k = 1..B-1), tau, mean unweighted loss, counts, and each block's
    streak of leading correct slots (block_streaks [N]; 0 for a padding block)."""
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
        "block_streaks": streak * valid,
    }

"""DSpark's objective over the vocabulary, with its gradient written by hand.

Per drafted row m, with the draft's Markov-corrected logits z = H h_m + W2 u_m (H: the target's frozen head, W2 the
Markov head's output table, u_m the row's Markov feature) and the target's distribution p from its final hidden
state: CE(z, label) and TV(q, p) = 1 - sum_v min(q_v, p_v), q = softmax(z). The objective sums
w_m (ce_alpha CE_m + tv_alpha TV_m) with w_m the loss's slot weights (detached; a block's weights read only that
block's rows, so the rows are taken a few whole blocks at a time).

Autograd over these rows kept a dozen chunk x vocabulary fp32 tensors per chunk and, under checkpointing, computed
both head products twice. Here each chunk's gradient with respect to z is formed in place from q once,

    d CE / d z = q - onehot(label),   d TV / d z_j = -q_j ([q_j < p_j] - s),   s = sum_v [q_v < p_v] q_v,

in the same pass that scores the rows, before their weights are known (a row's weight scales its row of each
product), and contracted at once into the gradients of h (with H), of u (with W2) and of W2 (with u): three
vocabulary-wide products in all (the draft's logits, the target's, the gradient of h), none recomputed. The backward
only scales them by the incoming gradient of the sum. On CUDA the elementwise work of a chunk runs compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from common.drafter.loss import LossConfig, compile_rows, mask_weights, minus_one_hot


class MarkovRows(NamedTuple):
    """The objective's sum and its rows; only ``weighted`` is differentiable."""

    weighted: torch.Tensor
    """[] fp32: sum over rows of w (ce_alpha CE + tv_alpha TV), not yet divided by the weights' sum."""
    ce: torch.Tensor
    """[M] fp32: CE of the corrected logits to the label."""
    tv: torch.Tensor
    """[M] fp32: TV distance of the corrected draft distribution to the target's (1 - the acceptance rate)."""
    label: torch.Tensor
    """[M] int64: the label used (the data token, or the target's argmax)."""
    picked: torch.Tensor
    """[M] int64: the corrected logits' argmax."""
    base_picked: torch.Tensor
    """[M] int64: the argmax without the Markov term (the backbone's own pick)."""
    weights: torch.Tensor
    """[M] fp32: the slot weights w."""


def _rows(
    base: torch.Tensor,
    markov: torch.Tensor,
    target: torch.Tensor,
    labels: torch.Tensor | None,
    ce_alpha: float,
    tv_alpha: float,
    need_grad: bool,
) -> tuple[torch.Tensor | None, ...]:
    """Per row of a chunk, from the backbone's logits, the Markov term's and the target's [c, V]: the backbone's and
    the corrected argmax, the label, CE, TV and, when ``need_grad``, d/dz (ce_alpha CE + tv_alpha TV) [c, V] in the
    logits' dtype, ce_alpha (q - onehot) - tv_alpha q ([q < p] - s) with s = sum_v [q_v < p_v] q_v (else None)."""
    logits, target_logits = base.float() + markov.float(), target.float()
    label = target_logits.argmax(-1) if labels is None else labels
    log_norm, target_log_norm = logits.logsumexp(-1, keepdim=True), target_logits.logsumexp(-1, keepdim=True)
    ce = log_norm.squeeze(-1) - logits.gather(-1, label[:, None]).squeeze(-1)
    q, p = (logits - log_norm).exp(), (target_logits - target_log_norm).exp()
    below = q < p
    captured = torch.where(below, q, 0.0).sum(-1, keepdim=True)
    tv = 1.0 - torch.where(below, q, p).sum(-1)
    grad = None
    if need_grad:
        grad = minus_one_hot(q * (ce_alpha - tv_alpha * (below.to(q.dtype) - captured)), label, ce_alpha)
        grad = grad.to(base.dtype)
    return base.argmax(-1), logits.argmax(-1), label, ce, tv, grad


@functools.cache
def _compiled_rows() -> Callable[..., tuple[torch.Tensor | None, ...]]:
    return compile_rows(_rows)


def _rows_function(device: torch.device) -> Callable[..., tuple[torch.Tensor | None, ...]]:
    """:func:`_rows`, compiled on CUDA: there a few fused kernels that read the chunk's three logit tensors, where
    eager runs two dozen vocabulary-wide kernels a chunk (launches, and fp32 traffic that took more time than the
    products themselves). Eager elsewhere."""
    return _compiled_rows() if device.type == "cuda" else _rows


def _add_chunk_grads(
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
    chunk: slice,
    grad_logits: torch.Tensor,
    weights: torch.Tensor,
    head_weight: torch.Tensor,
    w2: torch.Tensor,
    u: torch.Tensor,
) -> None:
    """A chunk's share of the gradients (with respect to hidden, features and W2; None: not asked for) from the
    unweighted gradient of its logits and the rows' weights: rows of the first two, a sum into the third. A row's
    weight scales its row of each product (diag(w) G W = diag(w) (G W)), so the logits' gradient is formed before
    the weights are known, in the pass that scores the rows."""
    grad_hidden, grad_features, grad_w2 = grads
    scale = weights[:, None]
    if grad_hidden is not None:
        grad_hidden[chunk] = ((grad_logits @ head_weight) * scale).to(grad_hidden.dtype)
    if grad_features is not None:
        grad_features[chunk] = ((grad_logits @ w2) * scale).to(grad_features.dtype)
    if grad_w2 is not None:
        grad_w2 += (grad_logits.T @ (u * scale).to(u.dtype)).float()


class MarkovTargets(NamedTuple):
    """What the Markov head's rows are scored against, none of it trained: the target's head weight [V, H], its final
    states predicting each row's token [M, H], the labels [M] (None: the target's argmax), the label mask [N, S], the
    loss config and the weights of CE and TV in the objective."""

    head_weight: torch.Tensor
    target_hidden: torch.Tensor
    labels: torch.Tensor | None
    label_mask: torch.Tensor
    config: LossConfig
    ce_alpha: float
    tv_alpha: float


class _MarkovHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, features: torch.Tensor, markov_w2: torch.Tensor, targets: MarkovTargets):
        head_weight, target_hidden, labels, label_mask, config, ce_alpha, tv_alpha = targets
        rows, slots = hidden.shape[0], label_mask.shape[1]
        dtype = head_weight.dtype
        w2 = markov_w2.to(dtype)
        device = hidden.device
        row_values = _rows_function(device)
        ce = torch.empty(rows, dtype=torch.float32, device=device)
        tv = torch.empty_like(ce)
        weights = torch.empty_like(ce)
        label_used = torch.empty(rows, dtype=torch.long, device=device)
        picked = torch.empty_like(label_used)
        base_picked = torch.empty_like(label_used)
        weighted = torch.zeros((), dtype=torch.float32, device=device)
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        grad_features = torch.empty_like(features) if needs[1] else None
        grad_w2 = torch.zeros(markov_w2.shape, dtype=torch.float32, device=device) if needs[2] else None
        need_grad = any(needs[:3])
        blocks_per_chunk = max(1, config.chunk_rows // slots)
        for first in range(0, label_mask.shape[0], blocks_per_chunk):
            mask = label_mask[first : first + blocks_per_chunk]
            chunk = slice(first * slots, first * slots + mask.numel())
            u = features[chunk].to(dtype)
            base = hidden[chunk].to(dtype) @ head_weight.T
            markov = u @ w2.T
            target = target_hidden[chunk].to(dtype) @ head_weight.T
            chunk_labels = None if labels is None else labels[chunk]
            base_picked[chunk], picked[chunk], label, chunk_ce, chunk_tv, grad_logits = row_values(
                base, markov, target, chunk_labels, ce_alpha, tv_alpha, need_grad
            )
            del base, markov, target
            w = mask_weights(mask, config, chunk_ce.view_as(mask), (1.0 - chunk_tv).view_as(mask)).reshape(-1)
            label_used[chunk], ce[chunk], tv[chunk], weights[chunk] = label, chunk_ce, chunk_tv, w
            weighted += (w * (ce_alpha * chunk_ce + tv_alpha * chunk_tv)).sum()
            if need_grad:
                _add_chunk_grads((grad_hidden, grad_features, grad_w2), chunk, grad_logits, w, head_weight, w2, u)
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0, device=device) for g in (grad_hidden, grad_features, grad_w2))
        )
        ctx.w2_dtype = markov_w2.dtype
        ctx.mark_non_differentiable(ce, tv, label_used, picked, base_picked, weights)
        return weighted, ce, tv, label_used, picked, base_picked, weights

    @staticmethod
    def backward(ctx, grad_weighted, *_unused):
        grad_hidden, grad_features, grad_w2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_hidden * grad_weighted.to(grad_hidden.dtype) if needs[0] else None,
            grad_features * grad_weighted.to(grad_features.dtype) if needs[1] else None,
            (grad_w2 * grad_weighted).to(ctx.w2_dtype) if needs[2] else None,
            None,  # the targets
        )


def markov_head_rows(
    hidden: torch.Tensor, features: torch.Tensor, markov_w2: torch.Tensor, targets: MarkovTargets
) -> MarkovRows:
    """The objective over rows [M] = blocks x slots (``targets.label_mask`` [N, S], M = N S): hidden [M, H] after the
    final norm, features [M, r], against ``targets``; gradients flow to the first three only."""
    if hidden.shape[0] != targets.label_mask.numel():
        raise ValueError(f"{hidden.shape[0]} rows for a label mask of {tuple(targets.label_mask.shape)}")
    return MarkovRows(*_MarkovHeadLoss.apply(hidden, features, markov_w2, targets))

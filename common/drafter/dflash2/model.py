"""DFlash 2: the DFlash drafter plus grouped dynamic causal convolutions and a candidate selector.

The backbone is DFlash's (one parallel forward per block). Two modules are added, as z-lab's reference runs them:

- Around each draft layer's attention and its MLP, a grouped dynamic causal convolution. One projection of the
  sublayer's normed input gives, per position, kernel deltas for an input-side convolution (before the
  sublayer) and an output-side one (after it); kernel = a learned base ``[taps, H]`` + the delta, one delta per
  group of ``conv_group_size`` channels; tap ``o`` reads the position ``o`` slots back in the same block (zero
  before the block's first slot), so no tap ever crosses a block, hence never a packed document either.
  Identity at initialisation (base tap 0 = 1, the rest 0, projection 0).
- A candidate selector: the draft's top-K tokens of each slot, rescored by
  ``unary(b) + < pred[a] * W h_t , succ[b] >`` with ``a`` the previous token of the path; decoding walks the
  block from its given token, taking the argmax (greedy) or sampling with the probabilities over the K
  candidates kept for rejection sampling. The successor codebook starts at zero, so a fresh selector proposes
  the draft's argmax.

Training adds to the DFlash loss ``selector_loss_alpha`` x a K-way cross-entropy over the draft's top-K with the
previous gold token teacher-forced, weighted by the DFlash loss's own slot weights (D-PACE by default). Its
metrics ``tau``, ``acc`` and ``block_streaks`` are the selector path's (what decoding drafts); ``unary_tau`` is the
draft argmax's beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from common.drafter.draft_config import DraftConfig
from common.drafter.head import KindHead, ObjectiveInput, ProposalInput, candidate_chunk, path_metrics, walk_slots
from common.drafter.loss import candidate_logits, draft_loss_parts, draft_metrics
from common.drafter.model import DraftDecoderLayer, Rope
from common.drafter.sampling import Proposal


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sublayer: ``base_kernel`` [2, taps, H] (input side, output side) and
    ``kernel_projection`` H -> 2 x taps x groups, the per-position deltas of both, read from the normed input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        """The identity: each position passes through unchanged, whatever its input."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def deltas(self, normed: torch.Tensor) -> torch.Tensor:
        """[N, B, 2, taps, groups] kernel deltas of the blocks' normed input [N, B, H]."""
        return self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.kernel_size, self.groups)

    def convolve(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """One side's convolution of ``x`` [N, B, H] inside each block (see :func:`causal_conv`)."""
        blocks, length, width = x.shape
        out = causal_conv(x.reshape(blocks, length, self.groups, self.group_size), self.base_kernel, deltas, side)
        return out.view(blocks, length, width)


def _kernel(base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """``base`` [G, c] + ``deltas`` [..., G] broadcast over the c channels of each group, as a new tensor. The deltas
    are spread by a copy first: an add that broadcasts over the innermost dimension runs 4x slower on the CPU in bf16
    (4.5x at the SmolLM2 step's sizes), and the sums are the same."""
    return deltas[..., None].expand(*deltas.shape, base.shape[-1]).contiguous().add_(base)


def _conv_forward(x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """out[:, l] = sum_o (base[o] + deltas[:, l, o]) * x[:, l - o], no term where l - o < 0: x [N, L, G, c], base
    [taps, G, c], deltas [N, L, taps, G] (one kernel value per group of c channels)."""
    out = _kernel(base[0], deltas[:, :, 0]).mul_(x)
    for offset in range(1, base.shape[0]):  # taps - 1 shifted terms, each over the slots it reaches
        out[:, offset:].add_(_kernel(base[offset], deltas[:, offset:, offset]).mul_(x[:, :-offset]))
    return out


def _conv_backward(
    grad_out: torch.Tensor, x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor, needs: tuple[bool, bool, bool]
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of :func:`_conv_forward` with respect to x, base and deltas (None where ``needs`` says so)."""
    grad_x = _kernel(base[0], deltas[:, :, 0]).mul_(grad_out) if needs[0] else None
    base_parts, delta_parts = [], []
    for offset in range(base.shape[0]):
        later = grad_out[:, offset:]  # the slots tap ``offset`` writes, against the slots it reads
        if needs[0] and offset:
            grad_x[:, :-offset].add_(_kernel(base[offset], deltas[:, offset:, offset]).mul_(later))
        if needs[1] or needs[2]:
            product = later * x[:, : x.shape[1] - offset]
            if needs[1]:
                base_parts.append(product.sum((0, 1)))
            if needs[2]:  # nothing before the block's first slot
                delta_parts.append(F.pad(product.sum(-1), (0, 0, offset, 0)) if offset else product.sum(-1))
    grad_base = torch.stack(base_parts) if needs[1] else None
    grad_deltas = torch.stack(delta_parts, dim=2) if needs[2] else None
    return grad_x, grad_base, grad_deltas


class CausalConvFunction(torch.autograd.Function):
    """:func:`_conv_forward` with its gradient written out: autograd of the tap loop keeps a padded copy of x and a
    full-size kernel per tap, and runs a dozen kernels per tap backward; this keeps x and the deltas alone."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, base, deltas)
        return _conv_forward(x, base, deltas)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, base, deltas = ctx.saved_tensors
        return _conv_backward(grad_out.contiguous(), x, base, deltas, tuple(ctx.needs_input_grad[:3]))


def _conv_traced(x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """:func:`_conv_forward` out of place, for a compiler to fuse and differentiate itself: traced through
    ``CausalConvFunction``, the compiled backward returned a zero gradient of x on CUDA (torch 2.13)."""
    out = (base[0] + deltas[:, :, 0, :, None]) * x
    for offset in range(1, base.shape[0]):
        term = (base[offset] + deltas[:, offset:, offset, :, None]) * x[:, :-offset]
        out = out + F.pad(term, (0, 0, 0, 0, offset, 0))  # nothing before the block's first slot
    return out


def _apply_conv(x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
    taps, groups, group_size = base_kernel.shape[1], x.shape[2], x.shape[3]
    base = base_kernel[side].to(x.dtype).view(taps, groups, group_size)
    if torch.compiler.is_compiling():
        return _conv_traced(x, base, deltas[:, :, side].to(x.dtype))
    return CausalConvFunction.apply(x, base, deltas[:, :, side].to(x.dtype))


@functools.cache
def _compiled_conv() -> Callable[..., torch.Tensor]:
    return torch.compile(_apply_conv, dynamic=False)


def causal_conv(x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
    """One side of the grouped dynamic causal convolution inside each block: x [N, L, G, c], base_kernel [2, taps,
    G * c], deltas [N, L, 2, taps, G] (both sides, as the projection gives them) -> [N, L, G, c]; tap ``o`` reads the
    slot ``o`` back, nothing before the block's first, with the kernel base_kernel[side, o] + deltas[:, :, side, o].

    A training step on CUDA outside a compiled region runs it compiled (one fused kernel forward and a few backward,
    the side's selection and the dtype casts inside, where the eager taps launch dozens); inside a compiled layer
    the layer's graph takes it in. Compiled, the convolution is traced out of place and differentiated by the
    compiler; eager (the CPU, and decoding, whose shapes vary) it runs ``CausalConvFunction``."""
    if x.is_cuda and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _compiled_conv()(x, base_kernel, deltas, side)
    return _apply_conv(x, base_kernel, deltas, side)


class DFlash2DecoderLayer(DraftDecoderLayer):
    """The DFlash layer with its attention and its MLP each between an input-side and an output-side convolution."""

    def __init__(self, config: DraftConfig, layer_type: str) -> None:
        super().__init__(config, layer_type)
        self.block_size = config.block_size
        options = config.options
        self.attention_conv = GroupedDynamicCausalConv(
            config.hidden_size, options.conv_kernel_size, options.conv_group_size
        )
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, options.conv_kernel_size, options.conv_group_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: Rope, mask: BlockMask | torch.Tensor) -> torch.Tensor:
        """x: [N * B, H], the blocks' slots in order."""
        shape = (-1, self.block_size, x.shape[-1])
        normed = self.input_layernorm(x).view(shape)
        deltas = self.attention_conv.deltas(normed)
        inner = self.attention_conv.convolve(normed, deltas, 0).view_as(x)
        inner = self.self_attn(inner, ctx, rope, mask).view(shape)
        x = x + self.attention_conv.convolve(inner, deltas, 1).view_as(x)
        normed = self.post_attention_layernorm(x).view(shape)
        deltas = self.mlp_conv.deltas(normed)
        inner = self.mlp(self.mlp_conv.convolve(normed, deltas, 0)).view(shape)
        return x + self.mlp_conv.convolve(inner, deltas, 1).view_as(x)


class CandidateSelector(nn.Module):
    """Rescoring of the draft's top-K by a low-rank bilinear term between the previous token and each candidate,
    gated by the draft hidden state. Tensor names as the reference saves them: ``predecessor_codebook`` and
    ``successor_codebook`` [V, r] (no ``.weight``), ``hidden_projection.weight`` [r, H]."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        rank = config.options.selector_rank
        self.top_k = config.options.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, rank))
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random predecessor codebook and projection, zero successor codebook: a no-op until it learns."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=std)
            nn.init.normal_(self.hidden_projection.weight, std=std)
            self.successor_codebook.zero_()

    def pairwise(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The bilinear term [M, K] fp32 of rows ``hidden`` [M, H], previous tokens [M] and candidates [M, K]."""
        # Row gathers through F.embedding: the same rows, and a backward that sums each token's rows in one
        # segment reduction (index_put_ with accumulate: 7.7 ms a codebook on two CPU cores at the SmolLM2 step).
        gate = F.embedding(previous, self.predecessor_codebook) * self.hidden_projection(
            hidden.to(self.hidden_projection.weight.dtype)
        )
        return torch.einsum("mr,mkr->mk", gate, F.embedding(candidates, self.successor_codebook)).float()


class DFlash2KindHead(KindHead):
    """DFlash 2's head on the DFlash backbone (see the module's doc): its decoder layers and ``candidate_selector``,
    whose names it adds to DFlash's state dict (``layers.{i}.{attention,mlp}_conv.*``, ``candidate_selector.*``)."""

    title = "DFlash 2"
    logged_metrics = ("unary_tau", "selector/recall", "selector/accuracy", "selector/loss")
    state_names = ("attention_conv", "mlp_conv", "candidate_selector")

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)

    @staticmethod
    def make_layer(config: DraftConfig, layer_type: str) -> nn.Module:
        return DFlash2DecoderLayer(config, layer_type)

    def parts(self) -> dict[str, nn.Module]:
        return {"candidate_selector": self.candidate_selector}

    def reset(self, drafter: nn.Module, std: float = 0.02) -> None:
        """Identity convolutions and a no-op selector: the drafter proposes what its DFlash backbone would."""
        for layer in drafter.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        self.candidate_selector.reset_parameters(std)

    # -- training -------------------------------------------------------------------------------

    def objective(self, slots: ObjectiveInput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        options, blocks = self.config.options, slots.blocks
        head_weight = slots.target_head.lm_head_weight
        unary_loss, metrics, head, weights = draft_loss_parts(
            slots.hidden, blocks, head_weight, slots.loss_config, slots.target_hidden, top_k=options.selector_top_k
        )
        rows = slots.slot_rows.detach() if options.selector_stop_gradient else slots.slot_rows
        gold, mask = head.label_used, blocks.label_mask.reshape(-1)
        candidates, recalled, trained = self.candidates_with_gold(head.top_ids, gold, mask)
        # The previous gold token: the block's given token before slot 1, the label of slot k - 1 before slot k.
        previous = torch.cat([blocks.block_ids[:, :1], gold.view(len(blocks.block_ids), -1)[:, :-1]], dim=1)
        chunk = candidate_chunk(slots.loss_config, head_weight, options.selector_top_k)
        scores = candidate_logits(rows, head_weight, candidates, chunk)
        scores = scores + self.candidate_selector.pairwise(rows, previous.reshape(-1), candidates)
        gold_index = (candidates == gold[:, None]).long().argmax(-1)  # 0 where absent (and then not trained)
        row_ce = torch.logsumexp(scores, -1) - scores.gather(-1, gold_index[:, None]).squeeze(-1)
        selector_weights = weights.reshape(-1) * trained.float()
        selector_loss = (selector_weights * row_ce).sum() / selector_weights.sum().clamp_min(1e-6)
        loss = unary_loss + options.selector_loss_alpha * selector_loss

        # Teacher-forced, a path's streak equals the free walk's: while every earlier pick was right, the previous
        # token it conditions on is the gold one. A pick is right only if the gold really is among the top-K.
        picked = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        correct = (picked == gold) & recalled
        path = draft_metrics(
            blocks, row_ce.detach().view(len(blocks.block_ids), -1), correct.view_as(blocks.label_mask)
        )
        supervised = mask.float().sum().clamp_min(1.0)
        out = path_metrics(metrics, path, loss, "unary_tau")
        out["selector/recall"] = (recalled & mask).float().sum() / supervised
        out["selector/accuracy"] = (correct & mask).float().sum() / supervised
        out["selector/loss"] = selector_loss.detach()
        return loss, out

    def candidates_with_gold(
        self, candidates: torch.Tensor, gold: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the candidates [M, K] the selector trains on, whether the draft's top-K recalled the gold [M], the rows
        it trains on [M]): a row whose gold is missing gets it in place of its K-th candidate ("inject"), or is not
        trained ("exclude")."""
        recalled = (candidates == gold[:, None]).any(-1)
        if self.config.options.selector_missing_gold == "exclude":
            return candidates, recalled, mask & recalled
        candidates = candidates.clone()
        candidates[:, -1] = torch.where(recalled, candidates[:, -1], gold)
        return candidates, recalled, mask

    # -- decoding -------------------------------------------------------------------------------

    def propose(self, walk: ProposalInput) -> Proposal:
        """The selector's walk over slots 1..B-1 from each block's given token: the argmax of the rescored top-K
        (greedy), or a draw from their softmax at the temperature (kept in the proposal, over the candidates)."""
        hidden = walk.hidden[:, 1:]  # slot 0 is the given token
        selector = self.candidate_selector
        unary, candidates = walk.logits.topk(selector.top_k, dim=-1)

        def scores_of(slot: int, pick: torch.Tensor | None) -> torch.Tensor:
            previous = (
                walk.anchor_ids.long() if pick is None else candidates[:, slot - 1].gather(-1, pick[:, None])[:, 0]
            )
            return unary[:, slot] + selector.pairwise(hidden[:, slot], previous, candidates[:, slot])

        picks, probs = walk_slots(scores_of, hidden.shape[1], walk, over_vocabulary=False)
        return Proposal(
            tokens=candidates.gather(-1, picks[..., None]).squeeze(-1),
            probs=probs,
            candidates=candidates if walk.sampled else None,
        )

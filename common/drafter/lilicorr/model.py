"""The LiLiCorr drafter: DFlash's backbone, and a reranker over the draft's top-K candidates of every slot.

Per block, the draft's hidden states of slots 1..B-1 go through the target's head as DFlash's do; each slot keeps its K
most likely tokens (most likely first) and their log-probabilities over the whole vocabulary. The reranker
(``LiLiCorrHead``, the state dict's ``lilicorr.*``, named as Model-Optimizer exports it) embeds every (slot,
candidate) pair: the target's embedding of the token (``token_proj``), the slot's draft hidden state
(``pass_hidden_proj``), five features of its log-probability (``feature_mlp``: log p, p, log p minus the slot's best,
rank / (K - 1), rank == 0) and learned slot and rank embeddings; a small pre-norm transformer attends over all
(B-1) x K pairs of the block at once, unmasked, with a learned bias per head for each slot distance and one for the same
slot. An anchor vector, projected apart (``context_proj``, ``anchor_norm``), conditions every pair through
``factor_input_proj`` on [x, a, x * a]; three heads then give unit vectors out / in per pair and anchor-out per block,
and the factors are ``lilicorr_logit_scale`` times their cosines: start[k] = <anchor_out, in[slot 1, k]>, pair[s, i, j]
= <out[s, i], in[s + 1, j]>. There is no unary term: the draft's probabilities enter only as features.

Decoding walks the block left to right from the start factor: slot 1 takes argmax start, slot s + 1 the argmax of the
pair row of slot s's pick (greedy; ties to the more likely candidate); sampled, each slot draws from softmax(row / T)
over its K candidates, and the proposal keeps those probabilities and candidates for lossless rejection sampling.

Training adds to the DFlash loss (``draft_loss_parts``, top-K taken from the same head rows) Model-Optimizer's three
terms, on the chain teacher-forced by the labels (each slot's row is the pair row of the previous slot's label):
``lilicorr_w_ce`` x the K-way cross-entropy of the label, ``lilicorr_w_margin`` x relu(margin - (score of the label -
best other score)) and ``lilicorr_w_pen`` x the expected relu(target logit of the label - target logit of the
candidate) under the slot's softmax, the target's logits read from its final hidden state. A slot counts while the
label is among the candidates at it and at every slot before it, in blocks whose every slot is supervised; the three
terms share that count. The candidate log-probabilities are recomputed from the live logits, so the reranker's terms
train the backbone too (through them, the slots' hidden states and the anchor). ``tau``, ``acc`` and ``block_streaks``
are the greedy walk's: teacher-forced, a streak is the free walk's, since while every earlier pick was right the row
it reads is the label's.

The anchor is each block's context row (``Drafter.block_context``): ``hidden_norm(fc(.))`` of the target's features
at the position before the block, as Model-Optimizer reads it (zeros where a training block starts its document).
Where this differs from Model-Optimizer: ``in_head`` starts at zero, so every factor is 0 and the greedy walk takes
each slot's most likely token: a fresh or warm-started drafter proposes what its DFlash backbone does (greedy,
exactly; sampled, uniformly over its top-K).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import DraftConfig
from common.drafter.head import KindHead, ObjectiveInput, ProposalInput, candidate_chunk, path_metrics, walk_slots
from common.drafter.lilicorr import NUM_CANDIDATE_FEATURES
from common.drafter.loss import HeadRows, LossConfig, candidate_logits, draft_loss_parts, draft_metrics
from common.drafter.model import RMSNorm
from common.drafter.sampling import Proposal
from common.drafter.target_head import TargetHead


class LatticeAttention(nn.Module):
    """Multi-head self-attention over a block's lattice with an additive per-head bias; its tensors are named and
    shaped as ``nn.MultiheadAttention``'s (``in_proj_weight`` [3h, h], ``in_proj_bias`` [3h], ``out_proj``), which
    the reference trains with and every server loads."""

    def __init__(self, width: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [G, L, h], bias [heads, L, L] (the same for every block) -> [G, L, h]."""
        blocks, length, width = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias).view(blocks, length, 3, self.num_heads, -1)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        bias = bias.to(q.dtype)
        if bias.requires_grad and not x.is_cuda:
            # No CPU kernel trains a mask: SDPA would take its math fallback, 1.2x these four ops forward and
            # backward (the tiny default's lattice: heads of 8, 24 long). Elsewhere its fused kernels are faster.
            scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)) + bias
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None])
        return self.out_proj(out.transpose(1, 2).reshape(blocks, length, width))


class LatticeLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)), the MLP Linear -> SiLU -> Linear with biases."""

    def __init__(self, width: int, num_heads: int, mlp_width: int, eps: float) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = LatticeAttention(width, num_heads)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = nn.Sequential(nn.Linear(width, mlp_width), nn.SiLU(), nn.Linear(mlp_width, width))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The reranker: start and pair factors of a block's lattice (see the module's doc). Tensor names and shapes as
    Model-Optimizer exports them under ``lilicorr.``: ``token_proj`` (none where h equals the draft's width),
    ``pass_hidden_proj``, ``feature_mlp.{0,1,3}``, ``slot_embedding`` [1, 1, B-1, 1, h], ``rank_embedding``
    [1, 1, 1, K, h], ``relative_slot_bias`` [heads, 2B - 1], ``same_slot_bias`` [heads], ``context_proj``,
    ``layers.{i}.{attn_norm, attn, mlp_norm, mlp.{0,2}}``, ``output_norm``, ``anchor_norm``, ``factor_input_proj``
    [h, 3h], ``out_head``, ``in_head``, ``anchor_out_head`` [F, h]."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        options = config.options
        width, model_width = options.head_width(config), config.hidden_size
        self.block_size = config.block_size
        self.top_k = options.lilicorr_candidate_topk
        self.num_heads = options.lilicorr_num_heads
        self.logit_scale = float(options.lilicorr_logit_scale)
        self.vector_eps = float(options.lilicorr_vector_eps)
        slots = config.block_size - 1
        self.token_proj = nn.Identity() if width == model_width else nn.Linear(model_width, width)
        self.pass_hidden_proj = nn.Linear(model_width, width)
        self.feature_mlp = nn.Sequential(
            nn.LayerNorm(NUM_CANDIDATE_FEATURES),
            nn.Linear(NUM_CANDIDATE_FEATURES, width),
            nn.SiLU(),
            nn.Linear(width, width),
        )
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.num_heads, 2 * config.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.num_heads))
        self.context_proj = nn.Linear(model_width, width)
        self.layers = nn.ModuleList(
            LatticeLayer(width, self.num_heads, options.mlp_width(config), config.rms_norm_eps)
            for _ in range(options.lilicorr_num_layers)
        )
        self.output_norm = RMSNorm(width, config.rms_norm_eps)
        self.anchor_norm = RMSNorm(width, config.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, options.lilicorr_factor_dim)
        self.in_head = nn.Linear(width, options.lilicorr_factor_dim)
        self.anchor_out_head = nn.Linear(width, options.lilicorr_factor_dim)

    def reset_parameters(self, std: float = 0.02) -> None:
        """The reference's initialisation (every Linear N(0, std) with zero bias, the attention's input projection
        Xavier-uniform with zero bias, norms at one, embeddings and attention biases at zero), but ``in_head`` at zero:
        every in vector is then 0, every factor exactly 0, and the greedy walk takes each slot's top candidate, the
        draft's argmax. Only one side of the factors' products is zero, so they still train (no saddle)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=std)
                    nn.init.zeros_(module.bias)
                elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                    nn.init.ones_(module.weight)
                    if getattr(module, "bias", None) is not None:
                        nn.init.zeros_(module.bias)
                elif isinstance(module, LatticeAttention):
                    nn.init.xavier_uniform_(module.in_proj_weight)
                    nn.init.zeros_(module.in_proj_bias)
            for parameter in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
                parameter.zero_()
            self.in_head.weight.zero_()
            self.in_head.bias.zero_()

    def attention_bias(self, slots: int, top_k: int) -> torch.Tensor:
        """[heads, L, L] with L = slots x top_k: the bias of each slot distance, plus the same-slot bias."""
        slot = torch.arange(slots, device=self.relative_slot_bias.device).repeat_interleave(top_k)
        distance = (slot[:, None] - slot[None, :]).clamp(-(self.block_size - 1), self.block_size - 1)
        bias = self.relative_slot_bias[:, distance + self.block_size - 1]
        return bias + (distance == 0).to(bias.dtype) * self.same_slot_bias[:, None, None]

    def forward(
        self,
        token_embeddings: torch.Tensor,
        log_probs: torch.Tensor,
        pass_hidden: torch.Tensor,
        anchor: torch.Tensor,
        anchor_valid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-factors, fp32, already times ``logit_scale``: start [N, K] and pair [N, S - 1, K, K], of N blocks'
        candidate embeddings [N, S, K, H] (the target's), candidate log-probabilities over the whole vocabulary
        [N, S, K], the slots' draft hidden states [N, S, H] and one anchor row per block [N, H] (``anchor_valid`` [N]:
        False zeroes the anchor's projection)."""
        blocks, slots, top_k = log_probs.shape
        if slots != self.block_size - 1 or not 1 <= top_k <= self.top_k:
            raise ValueError(
                f"a lattice of {slots} slots x {top_k} candidates, for a head of {self.block_size - 1} x {self.top_k}"
            )
        dtype = self.pass_hidden_proj.weight.dtype
        lp = log_probs.float()
        rank = torch.arange(top_k, device=lp.device, dtype=torch.float32)
        features = torch.stack(
            [
                lp,
                lp.exp(),
                lp - lp.amax(-1, keepdim=True),
                (rank / max(top_k - 1, 1)).expand_as(lp),
                (rank == 0).float().expand_as(lp),
            ],
            dim=-1,
        )
        x = self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(pass_hidden.to(dtype))[:, :, None]
        x = x + self.feature_mlp(features.to(dtype)) + self.slot_embedding[0] + self.rank_embedding[0, :, :, :top_k]
        x = x.reshape(blocks, slots * top_k, -1)
        bias = self.attention_bias(slots, top_k)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(blocks, slots, top_k, -1)

        a = self.context_proj(anchor.to(dtype))
        if anchor_valid is not None:
            a = a * anchor_valid.to(a.dtype)[:, None]
        a = self.anchor_norm(a)
        # factor_input_proj of [x, a, x * a], its weight taken in thirds: the anchor's third once per block, and no
        # copy of the anchor or of the concatenation per candidate.
        w_self, w_anchor, w_cross = self.factor_input_proj.weight.chunk(3, dim=-1)
        a_row = a[:, None, None]
        pre = F.linear(x, w_self, self.factor_input_proj.bias) + F.linear(a, w_anchor)[:, None, None]
        g = F.silu(pre + F.linear(x * a_row, w_cross))
        # The last slot's out vectors pair with no slot after it: not computed.
        out_vec = unit_vectors(self.out_head(g[:, :-1]), self.vector_eps)
        in_vec = unit_vectors(self.in_head(g), self.vector_eps)
        anchor_out = unit_vectors(self.anchor_out_head(a), self.vector_eps)
        start = (anchor_out[:, None] * in_vec[:, 0]).sum(-1)
        pair = out_vec @ in_vec[:, 1:].transpose(-1, -2)
        return self.logit_scale * start.float(), self.logit_scale * pair.float()


def unit_vectors(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.normalize(x, dim=-1, eps=eps)``, x / max(|x|, eps), as x * rsqrt(max(|x|^2, eps^2)): the same up to
    rounding, and its backward takes half the time of the norm's on a CPU."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True).clamp_min(eps * eps))


def chain_rows(log_start: torch.Tensor, log_pair: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """[N, S, K]: each slot's row of factors given the candidate index ``previous`` [N, S - 1] taken at the slot
    before it (slot 1's is the start factor)."""
    blocks, pairs, top_k, _ = log_pair.shape
    index = previous[:, :, None, None].expand(blocks, pairs, 1, top_k)
    return torch.cat([log_start[:, None], log_pair.gather(2, index).squeeze(2)], dim=1)


class LogSumExpRows(torch.autograd.Function):
    """logsumexp over the vocabulary of ``hidden @ head_weight.T``, [M] fp32, in row chunks; differentiable with
    respect to ``hidden`` (the chunk's softmax recomputed in the backward: no chunk x vocabulary tensor is kept)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_weight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            chunk = slice(start, start + chunk_rows)
            out[chunk] = torch.logsumexp((hidden[chunk].to(head_weight.dtype) @ head_weight.T).float(), -1)
        ctx.save_for_backward(hidden, head_weight, out)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, head_weight, lse = ctx.saved_tensors
        grad = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk_rows):
            chunk = slice(start, start + ctx.chunk_rows)
            logits = (hidden[chunk].to(head_weight.dtype) @ head_weight.T).float()
            probs = logits.sub_(lse[chunk, None]).exp_().mul_(grad_out[chunk, None])
            grad[chunk] = (probs.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
        return grad, None, None


class Lattice(NamedTuple):
    """What the reranker scores of N blocks' S drafted slots: their K candidates and factors, beside the labels."""

    candidates: torch.Tensor
    """[N, S, K] the draft's top-K tokens of each slot, most likely first."""
    gold: torch.Tensor
    """[N, S] each slot's label."""
    log_start: torch.Tensor
    """[N, K] the start factors (fp32, times the logit scale)."""
    log_pair: torch.Tensor
    """[N, S - 1, K, K] the pair factors between adjacent slots."""
    chunk: int
    """Rows per chunk of a pass over the candidates' head rows."""


class LiLiCorrKindHead(KindHead):
    """LiLiCorr's reranker on the DFlash backbone (see the module's doc), added to DFlash's state dict as
    ``lilicorr.*``."""

    title = "LiLiCorr"
    logged_metrics = (
        "base_tau",
        "lilicorr/ce",
        "lilicorr/margin",
        "lilicorr/penalty",
        "lilicorr/selected_prefix",
        "lilicorr/top1_prefix",
        "lilicorr/oracle_prefix",
        "lilicorr/oracle_gap",
        "lilicorr/exact",
        "lilicorr/zero_prefix_rate",
        "lilicorr/slot_gt_in_lattice",
        "lilicorr/slot_acc",
        "lilicorr/logfactor_spread",
        "lilicorr/gap_mean",
        "lilicorr/gap_frac_hit",
    )
    reads_block_context = True
    state_names = ("lilicorr",)

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.lilicorr = LiLiCorrHead(config)

    def parts(self) -> dict[str, nn.Module]:
        return {"lilicorr": self.lilicorr}

    def reset(self, drafter: nn.Module, std: float = 0.02) -> None:
        """A fresh reranker whose greedy walk proposes the draft's argmax (``LiLiCorrHead.reset_parameters``)."""
        self.lilicorr.reset_parameters(std)

    @staticmethod
    def anchor_rows(context: torch.Tensor | None) -> torch.Tensor:
        """[N, H] the reranker's anchor of each block: its context row (hidden_norm(fc(features)) of the token before
        the given one), as the reference reads the committed target row before the block."""
        if context is None:
            raise ValueError("a lilicorr drafter reads each block's context row (Drafter.block_context)")
        return context

    def log_factors(
        self,
        target_head: TargetHead,
        candidates: torch.Tensor,
        log_probs: torch.Tensor,
        slots: torch.Tensor,
        anchor: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reranker's start [N, K] and pair [N, S - 1, K, K] log-factors of candidates [N, S, K], their
        log-probabilities [N, S, K], the slots' hidden states [N, S, H] and the anchors [N, H]."""
        embeddings = target_head.embed(candidates).detach()
        return self.lilicorr(embeddings, log_probs, slots, anchor)

    # -- training -------------------------------------------------------------------------------

    @staticmethod
    def log_normaliser(
        rows: torch.Tensor, head: HeadRows, config: LossConfig, chunk: int, head_weight: torch.Tensor
    ) -> torch.Tensor:
        """[M] logsumexp of the draft logits of ``rows`` [M, H], differentiable. Where the DFlash loss's row loss is
        the label's CE (hard labels, objective ce or lk), it is that CE plus the label's logit, at no head pass
        more; else it is computed in chunks of its own (a forward and two backward passes of the head)."""
        if config.label_mode != "target_soft" and config.objective in ("ce", "lk"):
            return head.loss + candidate_logits(rows, head_weight, head.label_used[:, None], chunk).squeeze(-1)
        return LogSumExpRows.apply(rows, head_weight, config.chunk_rows)

    def lattice(self, slots: ObjectiveInput) -> tuple[torch.Tensor, dict[str, torch.Tensor], HeadRows, Lattice]:
        """The DFlash loss, its metrics and head rows, and the lattice of the blocks' candidates with its factors.
        The candidates' log-probabilities over the whole vocabulary come from the live logits, so that the
        reranker's terms reach the backbone through them."""
        top_k, head_weight = self.lilicorr.top_k, slots.target_head.lm_head_weight
        dflash_loss, metrics, head, _ = draft_loss_parts(
            slots.hidden, slots.blocks, head_weight, slots.loss_config, slots.target_hidden, top_k=top_k
        )
        rows = slots.slot_rows
        chunk = candidate_chunk(slots.loss_config, head_weight, top_k)
        log_norm = self.log_normaliser(rows, head, slots.loss_config, chunk, head_weight)
        log_probs = candidate_logits(rows, head_weight, head.top_ids, chunk) - log_norm[:, None]
        shape = (slots.hidden.shape[0], slots.hidden.shape[1] - 1, top_k)
        candidates, log_probs = head.top_ids.view(shape), log_probs.view(shape)
        anchor = self.anchor_rows(slots.context)
        log_start, log_pair = self.log_factors(slots.target_head, candidates, log_probs, slots.hidden[:, 1:], anchor)
        lattice = Lattice(candidates, head.label_used.view(shape[:2]), log_start, log_pair, chunk)
        return dflash_loss, metrics, head, lattice

    def objective(self, slots: ObjectiveInput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        options, blocks = self.config.options, slots.blocks
        dflash_loss, metrics, head, lattice = self.lattice(slots)
        found = lattice.candidates == lattice.gold[..., None]
        in_lattice = found.any(-1)
        gold_index = found.long().argmax(-1)  # 0 where the label is not a candidate (never supervised there)
        reachable = torch.cumprod((in_lattice & blocks.label_mask).long(), dim=1).bool()  # a right prefix exists
        whole_block = blocks.label_mask.all(-1, keepdim=True)
        supervised = (reachable & whole_block).float()
        count = supervised.sum().clamp_min(1.0)

        # The chain teacher-forced: each slot's row given the label's candidate at the slot before.
        nodes = chain_rows(lattice.log_start, lattice.log_pair, gold_index[:, :-1])
        ce, margin, gap = self.chain_terms(nodes, gold_index, supervised, count)
        penalty = self.distractor_penalty(slots, lattice, nodes, gold_index, supervised, count)
        loss = (
            dflash_loss
            + options.lilicorr_w_ce * ce
            + options.lilicorr_w_margin * margin
            + options.lilicorr_w_pen * penalty
        )

        # Teacher-forced, a block's streak of right picks is the free walk's: while every earlier pick was right, the
        # row it reads is the label's. A pick is right only where the label is a candidate.
        picked = nodes.detach().argmax(-1)
        correct = (picked == gold_index) & in_lattice
        out = path_metrics(
            metrics, draft_metrics(blocks, head.ce.view_as(blocks.label_mask), correct), loss, "base_tau"
        )
        out.update(self._lattice_metrics(blocks, lattice, correct, in_lattice, reachable, whole_block, gap))
        out.update(
            {"lilicorr/ce": ce.detach(), "lilicorr/margin": margin.detach(), "lilicorr/penalty": penalty.detach()}
        )
        return loss, out

    def chain_terms(
        self, nodes: torch.Tensor, gold_index: torch.Tensor, supervised: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the K-way cross-entropy of the labels, the hinge on their margin, each slot's margin [N, S]) of the
        chain's rows ``nodes`` [N, S, K], over the ``supervised`` slots."""
        options, top_k = self.config.options, nodes.shape[-1]
        gold_score = nodes.gather(-1, gold_index[..., None]).squeeze(-1)
        ce_rows = torch.logsumexp(nodes, -1) - gold_score
        ce = (ce_rows * supervised).sum() / count
        if top_k > 1:
            others = nodes.scatter(-1, gold_index[..., None], float("-inf")).amax(-1)
            gap = gold_score - others
        else:
            gap = torch.zeros_like(gold_score)
        margin = torch.zeros_like(ce)
        if options.lilicorr_w_margin > 0 and top_k > 1:
            margin = (torch.relu(options.lilicorr_margin - gap) * supervised).sum() / count
        return ce, margin, gap

    def distractor_penalty(
        self,
        slots: ObjectiveInput,
        lattice: Lattice,
        nodes: torch.Tensor,
        gold_index: torch.Tensor,
        supervised: torch.Tensor,
        count: torch.Tensor,
    ) -> torch.Tensor:
        """The expected relu(target logit of the label - target logit of the candidate) under each slot's softmax
        over the chain's row, over the ``supervised`` slots (0 where ``lilicorr_w_pen`` is)."""
        if self.config.options.lilicorr_w_pen <= 0:
            return torch.zeros_like(count)
        if slots.target_hidden is None:
            raise ValueError(
                "a lilicorr drafter's distractor penalty (lilicorr_w_pen > 0) needs the target's final hidden "
                "state (batch.last_hidden)"
            )
        candidates, top_k = lattice.candidates, lattice.candidates.shape[-1]
        with torch.no_grad():  # the target predicts slot k's token at a + k - 1
            targets = slots.target_hidden[(slots.blocks.label_index - 1).reshape(-1)]
            head_weight = slots.target_head.lm_head_weight
            target_logits = candidate_logits(targets, head_weight, candidates.reshape(-1, top_k), lattice.chunk)
            target_logits = target_logits.view(candidates.shape)
            rejection = (target_logits.gather(-1, gold_index[..., None]) - target_logits).clamp_min(0.0)
        expected = (torch.softmax(nodes, -1) * rejection).sum(-1)
        return (expected * supervised).sum() / count

    @staticmethod
    @torch.no_grad()
    def _lattice_metrics(
        blocks: DraftBlocks,
        lattice: Lattice,
        correct: torch.Tensor,
        in_lattice: torch.Tensor,
        reachable: torch.Tensor,
        whole_block: torch.Tensor,
        gap: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Model-Optimizer's diagnostics (device tensors): prefixes per wholly supervised block of the walk
        (selected), of the draft's argmax (top1) and of the label being a candidate (oracle); per slot the label's
        recall among the candidates and, where a right prefix reaches the slot, the walk's accuracy and the label's
        score gap to the best other; and the factors' spread (0 when the chain collapses to uniform)."""
        candidates, gold, log_start, log_pair = lattice.candidates, lattice.gold, lattice.log_start, lattice.log_pair
        slots = gold.shape[1]

        def prefix(matches: torch.Tensor) -> torch.Tensor:
            return torch.cumprod(matches.long(), dim=1).sum(1).float()

        block_weight = whole_block.squeeze(-1).float()
        blocks_counted = block_weight.sum().clamp_min(1.0)

        def per_block(values: torch.Tensor) -> torch.Tensor:
            return (values.float() * block_weight).sum() / blocks_counted

        selected, top1, oracle = prefix(correct), prefix(candidates[..., 0] == gold), prefix(in_lattice)
        reached = reachable.float()
        reached_count = reached.sum().clamp_min(1.0)
        supervised = blocks.label_mask.float()
        spread = [log_start.std(-1).mean() if log_start.shape[-1] > 1 else log_start.new_zeros(())]
        if log_pair.numel() and log_pair.shape[-1] > 1:
            spread.append(log_pair.flatten(-2).std(-1).mean())
        else:
            spread.append(log_start.new_zeros(()))
        return {
            "lilicorr/selected_prefix": per_block(selected),
            "lilicorr/top1_prefix": per_block(top1),
            "lilicorr/oracle_prefix": per_block(oracle),
            "lilicorr/oracle_gap": per_block(oracle - selected),
            "lilicorr/exact": per_block(selected == slots),
            "lilicorr/zero_prefix_rate": per_block(~in_lattice[:, 0]),
            "lilicorr/slot_gt_in_lattice": (in_lattice.float() * supervised).sum() / supervised.sum().clamp_min(1.0),
            "lilicorr/slot_acc": (correct.float() * reached).sum() / reached_count,
            "lilicorr/logfactor_spread": (spread[0] + spread[1]) / 2,
            "lilicorr/gap_mean": (gap.detach() * reached).sum() / reached_count,
            "lilicorr/gap_frac_hit": ((gap.detach() > 0).float() * reached).sum() / reached_count,
        }

    # -- decoding -------------------------------------------------------------------------------

    def propose(self, walk: ProposalInput) -> Proposal:
        """The reranker's walk over slots 1..B-1 of each block: from the start factor, each slot's argmax of the
        pair row of the previous pick (greedy), or a draw from softmax(row / T) over its candidates, kept in the
        proposal with the candidates."""
        slots = walk.hidden[:, 1:]
        values, candidates = walk.logits.topk(self.lilicorr.top_k, dim=-1)
        log_probs = values - torch.logsumexp(walk.logits, -1, keepdim=True)
        anchor = self.anchor_rows(walk.context)
        log_start, log_pair = self.log_factors(walk.target_head, candidates, log_probs, slots, anchor)

        def row_of(slot: int, pick: torch.Tensor | None) -> torch.Tensor:
            if pick is None:
                return log_start
            return log_pair[:, slot - 1].gather(1, pick[:, None, None].expand(-1, 1, log_start.shape[-1])).squeeze(1)

        picks, probs = walk_slots(row_of, slots.shape[1], walk, over_vocabulary=False)
        return Proposal(
            tokens=candidates.gather(-1, picks[..., None]).squeeze(-1),
            probs=probs,
            candidates=candidates if walk.sampled else None,
        )

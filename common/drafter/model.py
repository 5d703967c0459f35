"""The DFlash drafter: fused target features injected as keys/values into Qwen3-style layers.

Per step: anchors and blocks are sampled from the packed batch (common.drafter.blocks), one attention mask
is built per layer type (common.drafter.masks), the blocks run through the draft layers with the context
``ctx = hidden_norm(fc(concat_k h_k))`` prepended to every layer's keys and values, and the chunked
head of common.drafter.loss turns the block slots into a loss without materialising N x B x vocab logits.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from common.batch import PackedBatch
from common.drafter.base import Drafter
from common.drafter.blocks import DraftBlocks, build_blocks, label_coverage
from common.drafter.draft_config import DraftConfig
from common.drafter.head import KindHead, ObjectiveInput, ProposalInput
from common.drafter.kinds import kind_of
from common.drafter.loss import LossConfig, draft_loss
from common.drafter.masks import TiledMask, build_masks, visible_pairs
from common.drafter.sampling import Proposal, Sampling, sample_from, sampling_probs
from common.drafter.target_head import TargetHead

ATTENTION_BACKENDS = ("flex", "tiled", "sdpa")
"""How the drafter attends: flex block masks (CUDA), tiles of SDPA (CPU), SDPA with one dense mask (reference)."""
AttentionMask = BlockMask | TiledMask | torch.Tensor
"""A layer type's mask in one of its forms (common/drafter/masks.py): flex, tiled or dense."""


SMALL_HEAD_FLEX_FORWARD = {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3}
"""The compiled flex forward's tiles for heads of at most 64 dims: 64 queries a tile instead of the default 128. At
the SmolLM2 preset's step (head_dim 64, 65,536 tokens, 2,048 blocks of 16) DFlash's step took 59.9 ms against 67.0 ms
on an H100; at the Qwen3-8B draft (head_dim 128) it made no difference, so larger heads keep the defaults."""


def flex_attention_for(device: torch.device, head_dim: int) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled on CUDA (its eager path materialises the scores) with the forward's tiles for the
    head size. Inside a compiled layer it is traced into the layer's graph as it is: dynamo would only warn about,
    and then look through, the cache that holds the compiled one."""
    if device.type != "cuda":
        return flex_attention
    options = dict(SMALL_HEAD_FLEX_FORWARD if head_dim <= 64 else {})
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return functools.partial(attend, kernel_options=options)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def tiled_attention_outside_compile() -> Callable[..., torch.Tensor]:
    """``tiled_attention`` as a compiled layer calls it: left out of the compiled code (torch.compiler.disable), since
    its tiles are host ints that change with every batch and, traced, each batch would recompile the layer. Made on
    the first compiled call: wrapping imports dynamo (and FSDP with it), which an eager trainer does without."""
    return torch.compiler.disable(tiled_attention)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back, scale."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE over explicit positions, honouring the target's rope_theta and rope scaling type."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            # fp32 as in HF / vLLM, so the draft sees the same angles as at serving time
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
            inv_freq, self.attention_scaling = 1.0 / config.rope_theta**exponents, 1.0
        else:
            from transformers import Qwen3Config
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf_config = Qwen3Config(
                hidden_size=config.hidden_size,
                num_attention_heads=config.num_attention_heads,
                head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings,
                rope_parameters=dict(config.rope_parameters),
            )
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        # Not a buffer: a dtype cast of the module (drafter.to(bfloat16)) must not round the frequencies.
        self.inv_freq = inv_freq.float()
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [L, head_dim] for positions [L]."""
        if positions.device not in self._inv_freq_on:
            self._inv_freq_on[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq_on[positions.device][None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return (angles.cos() * self.attention_scaling).to(dtype), (angles.sin() * self.attention_scaling).to(dtype)


class Rope(NamedTuple):
    """The rotary tables (cos, sin) of one drafter forward, shared by its layers: the block slots' and the context's."""

    block: tuple[torch.Tensor, torch.Tensor]
    context: tuple[torch.Tensor, torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, L, D] (rotate-half convention of HF Qwen3)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    """GQA attention whose queries are the block slots and whose keys/values are [ctx ; blocks]."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: Rope, mask: AttentionMask) -> torch.Tensor:
        """x: [Q, H] normed block slots; ctx: [T, H] fused context (shared by all layers)."""
        num_queries, num_context = x.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_queries, self.num_heads, self.head_dim)).transpose(0, 1)
        k_ctx = self.k_norm(self.k_proj(ctx).view(num_context, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        k_blk = self.k_norm(self.k_proj(x).view(num_queries, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v_ctx = self.v_proj(ctx).view(num_context, self.num_kv_heads, self.head_dim).transpose(0, 1)
        v_blk = self.v_proj(x).view(num_queries, self.num_kv_heads, self.head_dim).transpose(0, 1)
        q, k_ctx, k_blk = apply_rope(q, *rope.block), apply_rope(k_ctx, *rope.context), apply_rope(k_blk, *rope.block)
        if isinstance(mask, TiledMask):
            attend = tiled_attention_outside_compile() if torch.compiler.is_compiling() else tiled_attention
            out = attend(q, (k_ctx, v_ctx), (k_blk, v_blk), mask)
        else:
            k, v = torch.cat([k_ctx, k_blk], dim=1)[None], torch.cat([v_ctx, v_blk], dim=1)[None]
            if isinstance(mask, BlockMask):
                out = flex_attention_for(q.device, self.head_dim)(q[None], k, v, block_mask=mask, enable_gqa=True)[0]
            else:
                out = F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, enable_gqa=True)[0]
        return self.o_proj(out.transpose(0, 1).reshape(num_queries, self.num_heads * self.head_dim))


def tiled_attention(
    q: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor],
    own_blocks: tuple[torch.Tensor, torch.Tensor],
    mask: TiledMask,
) -> torch.Tensor:
    """Attention of the block slots tile by tile (``TiledMask``): q ``[heads, Q, D]``, context keys and values
    ``[kv heads, T, D]``, the blocks' own ``[kv heads, Q, D]`` -> ``[heads, Q, D]``. Each tile is one SDPA call over
    its stretch of context keys and its own blocks' keys, with that tile's dense mask: the memory of a step (the
    masks and what autograd keeps of them) is the tiles' queries times their stretches, so a sliding layer's does
    not grow with the document, where one dense mask over the whole packed row grows with queries x tokens.
    The tiles' pieces come from one gather and splits, whose backward is one scatter and one concatenation."""
    (k_ctx, v_ctx), (k_blk, v_blk) = context, own_blocks
    query_sizes, context_sizes = mask.query_sizes, mask.context_sizes
    tiled = zip(
        q.split(query_sizes, dim=1),
        k_ctx.index_select(1, mask.context_index).split(context_sizes, dim=1),
        v_ctx.index_select(1, mask.context_index).split(context_sizes, dim=1),
        k_blk.split(query_sizes, dim=1),
        v_blk.split(query_sizes, dim=1),
    )
    outputs = []
    for index, (q_tile, k_tile, v_tile, k_own, v_own) in enumerate(tiled):
        k, v = torch.cat([k_tile, k_own], dim=1), torch.cat([v_tile, v_own], dim=1)
        out = F.scaled_dot_product_attention(
            q_tile[None], k[None], v[None], attn_mask=mask.tile_mask(index), enable_gqa=True
        )
        outputs.append(out[0])
    return torch.cat(outputs, dim=1)


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer; the injected context is used as is (not normed again per layer)."""

    def __init__(self, config: DraftConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope: Rope, mask: AttentionMask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(Drafter):
    """The DFlash drafter (common/drafter/base.py's interface), with the target's frozen embedding / final norm /
    lm_head shared, not owned: the backbone of every kind, which owns the kind's head (common/drafter/head.py) when
    its kind has one.

    The state dict holds only trainable weights, named as in the z-lab export (``fc``, ``hidden_norm``,
    ``layers.{i}...``, ``norm``), and the head's parts under their own names (``markov_head.*``, ``lilicorr.*``).
    """

    def __init__(
        self,
        config: DraftConfig,
        target_head: TargetHead,
        loss_config: LossConfig | None = None,
        attention_backend: str | None = None,
    ) -> None:
        super().__init__()
        if target_head.hidden_size != config.hidden_size or target_head.vocab_size != config.vocab_size:
            raise ValueError(
                f"target head {target_head.vocab_size}x{target_head.hidden_size} does not match "
                f"config vocab_size {config.vocab_size}, hidden_size {config.hidden_size}"
            )
        if attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(
                f"attention_backend must be None or one of {ATTENTION_BACKENDS}, got {attention_backend!r}"
            )
        self.config = config
        self.loss_config = loss_config or LossConfig()
        self.attention_backend = attention_backend
        self.fc = nn.Linear(config.fused_feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_class = kind_of(config.kind).head_class()
        make_layer = (head_class or KindHead).make_layer  # the kind's decoder layer, or None for DFlash's
        self.layers = nn.ModuleList(make_layer(config, t) or DraftDecoderLayer(config, t) for t in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.target_head = target_head
        self.target_head.requires_grad_(False)
        self.head: KindHead | None = None
        self.reset_parameters()
        if head_class is not None:
            self.head = head_class(config)
            for name, part in self.head.parts().items():
                setattr(self, name, part)
            self.head.reset(self)

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def logged_metrics(self) -> tuple[str, ...]:
        return self.head.logged_metrics if self.head is not None else ()

    @property
    def reads_block_context(self) -> bool:
        return self.head is not None and self.head.reads_block_context

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        if self.head is not None:
            self.head.reset(self, std)

    def objective(
        self,
        hidden: torch.Tensor,
        blocks: DraftBlocks,
        target_hidden: torch.Tensor | None = None,
        loss_config: LossConfig | None = None,
        context: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and metrics of the draft slots: ``hidden`` [N, B, H] after the final norm. ``tau``, ``acc`` and
        ``block_streaks`` describe the tokens ``propose`` would draft, teacher-forced."""
        loss_config = loss_config or self.loss_config
        if self.head is None:
            return draft_loss(hidden, blocks, self.target_head.lm_head_weight, loss_config, target_hidden)
        return self.head.objective(
            ObjectiveInput(hidden, blocks, self.target_head, loss_config, target_hidden, context)
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of draft hidden states through the target's head."""
        head = self.target_head.lm_head_weight
        return (hidden.to(head.dtype) @ head.T).float()

    @torch.no_grad()
    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
        context: torch.Tensor | None = None,
    ) -> Proposal:
        """Draft tokens of slots 1..B-1 from the block's hidden states ``[R, B, H]`` (after the final norm);
        ``anchor_ids`` [R] are the blocks' given tokens. DFlash's greedy: the argmax; sampled: drawn from the sampling
        distribution, which the proposal keeps for rejection sampling. A kind's head walks the slots its own way."""
        rows, block_size, width = hidden.shape
        # Contiguous rows: a strided 3-d product runs as a batched matmul, several times slower at a vocabulary's width.
        logits = self.logits(hidden[:, 1:].reshape(rows * (block_size - 1), width)).view(rows, block_size - 1, -1)
        if self.head is not None:
            walk = ProposalInput(hidden, logits, anchor_ids, self.target_head, sampling, generator, context)
            return self.head.propose(walk)
        if sampling is None or sampling.greedy:
            return Proposal(tokens=logits.argmax(-1))
        probs = sampling_probs(logits, sampling)
        return Proposal(tokens=sample_from(probs, generator), probs=probs)

    def warm_start(self, state: dict[str, torch.Tensor]) -> None:
        """Load a drafter's weights of this kind, or of a kind in its ``warm_starts_from`` (DFlash: the backbone's),
        with the head at the values where this drafter proposes what that one did; ValueError for anything else."""
        if self.head is None or set(state) == set(self.state_dict()):
            self.load_state_dict(state, strict=True)
            return
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected or not all(self.head.owns(name) for name in missing):
            raise ValueError(
                f"not a DFlash or {self.head.title} drafter of this shape: unexpected {sorted(unexpected)[:3]}, "
                f"missing {sorted(n for n in missing if not self.head.owns(n))[:3]}"
            )
        self.head.reset(self)

    def backend_for(self, device: torch.device) -> str:
        """flex on CUDA; tiles of SDPA on CPU (flex has no CPU backward, and its eager path computes every
        query-key pair); ``sdpa`` (one dense mask) when asked for."""
        return self.attention_backend or ("flex" if device.type == "cuda" else "tiled")

    def masks(self, blocks: DraftBlocks) -> dict[str, AttentionMask]:
        """The per-layer-type masks of ``blocks`` in the form this drafter attends with on their device."""
        backend = self.backend_for(blocks.anchors.device)
        return build_masks(blocks, self.config, form="dense" if backend == "sdpa" else backend)

    def prepare(
        self, batch: PackedBatch, num_anchors: int, generator: torch.Generator
    ) -> tuple[DraftBlocks, dict[str, AttentionMask]]:
        """Anchors, blocks and per-layer-type masks of a batch; no host sync on CUDA, can run ahead of the step."""
        blocks = build_blocks(batch, num_anchors, self.config.block_size, self.config.mask_token_id, generator)
        return blocks, self.masks(blocks)

    def rope(self, block_positions: torch.Tensor, context_positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary tables of one forward, for the block slots at ``block_positions`` and the context tokens at
        ``context_positions``."""
        return Rope(self.rotary(block_positions, dtype), self.rotary(context_positions, dtype))

    def fuse_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, n * H_target] target features -> [T, H] injected context."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def forward(self, aux_hidden: torch.Tensor, blocks: DraftBlocks, masks: dict[str, AttentionMask]) -> torch.Tensor:
        """Draft hidden states [N, B, H] after the final norm."""
        num_blocks, block_size = blocks.block_ids.shape
        ctx = self.fuse_context(aux_hidden)
        x = self.target_head.embed(blocks.block_ids.reshape(-1)).to(ctx.dtype)
        rope = self.rope(blocks.block_positions.reshape(-1), blocks.context_positions, ctx.dtype)
        for layer in self.layers:
            x = layer(x, ctx, rope, masks[layer.layer_type])
        # Normed after the reshape so the output is no view: FSDP's backward hook on a view returned
        # by a sharded module would be lost to an in-place op on it.
        return self.norm(x.view(num_blocks, block_size, -1))

    def block_context(self, aux_hidden: torch.Tensor, blocks: DraftBlocks) -> torch.Tensor:
        """[N, H] each block's context row: the fused features of the token before its given one, zeros where the
        block starts its document (the row before belongs to another)."""
        before = (blocks.anchors - 1).clamp_min(0)
        rows = self.fuse_context(aux_hidden[before])
        return rows * (blocks.anchors > blocks.doc_start)[:, None].to(rows.dtype)

    def noisy_features(
        self, aux_hidden: torch.Tensor, generator: torch.Generator, step_fraction: float
    ) -> torch.Tensor:
        """Target features plus Gaussian noise relative to each layer's per-token RMS (cosine-annealed)."""
        scale = self.loss_config.noise_scale(step_fraction)
        if scale == 0.0 or not self.training:
            return aux_hidden
        per_layer = aux_hidden.view(aux_hidden.shape[0], len(self.config.target_layer_ids), -1).float()
        rms = per_layer.pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(per_layer.shape, generator=generator, device=generator.device).to(aux_hidden.device)
        return (per_layer + scale * rms * noise).view_as(aux_hidden).to(aux_hidden.dtype)

    def forward_train(
        self,
        batch: PackedBatch,
        num_anchors: int,
        generator: torch.Generator,
        step_fraction: float = 0.0,
        prepared: tuple[DraftBlocks, dict[str, AttentionMask]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss (scalar, differentiable) and metrics (device tensors, no host sync) of one packed batch.

        ``generator`` drives anchor sampling and feature noise; keep it on the batch's device.
        ``step_fraction`` in [0, 1] is the training progress (feature-noise schedule).
        ``prepared`` is the result of :meth:`prepare` when built ahead of time.
        """
        if batch.aux_hidden is None:
            raise ValueError("batch has no aux_hidden (the target features)")
        blocks, masks = prepared if prepared is not None else self.prepare(batch, num_anchors, generator)
        aux_hidden = self.noisy_features(batch.aux_hidden, generator, step_fraction)
        hidden = self(aux_hidden, blocks, masks)
        target_hidden = None
        if batch.last_hidden is not None:
            target_hidden = self.target_head.final_norm(batch.last_hidden.to(self.target_head.norm_weight.dtype))
        elif self.loss_config.labels_from_target:
            raise ValueError(f"label_mode {self.loss_config.label_mode!r} needs batch.last_hidden")
        context = self.block_context(aux_hidden, blocks) if self.reads_block_context else None
        loss, metrics = self.objective(hidden, blocks, target_hidden, context=context)
        metrics["coverage"] = label_coverage(blocks, batch.loss_mask)
        metrics["attention_pairs"] = visible_pairs(blocks, self.config)  # for the step's model FLOPs
        return loss, metrics


def train_flops(
    config: DraftConfig, num_context: int, num_anchors: int, attention_pairs: float | torch.Tensor
) -> dict[str, float | torch.Tensor]:
    """Matmul FLOPs of one training step on one packed sequence (forward + backward).

    Backward of a trainable matmul costs 2x its forward (input and weight gradients); attention
    backward ~2.5x forward (flash-style: dQ, dK, dV plus the recomputed scores); the frozen head
    needs only the input gradient (1x). Attention counts the query-key pairs the masks let attend,
    summed over the layers (``masks.visible_pairs``: the step's metric ``attention_pairs``), as a
    block-sparse kernel skips the rest; a device tensor there keeps the count free of host syncs.
    """
    hidden, inter, heads, kv_heads, head_dim = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    queries = num_anchors * config.block_size
    kv_width = kv_heads * head_dim
    per_layer = (
        2 * queries * hidden * (heads * head_dim) * 2  # q_proj, o_proj
        + 2 * (queries + num_context) * hidden * kv_width * 2  # k_proj, v_proj over blocks and context
        + 2 * queries * hidden * inter * 3  # gate, up, down
    )
    attention = 2 * 2 * attention_pairs * heads * head_dim  # QK^T and PV, all layers
    fc = 2 * num_context * config.fused_feature_size * hidden
    head = 2 * num_anchors * (config.block_size - 1) * hidden * config.vocab_size
    gemm = float(config.num_hidden_layers * 3 * per_layer + 3 * fc)
    return {
        "total": gemm + 2 * head + 3.5 * attention,
        "head": float(2 * head),
        "attention": 3.5 * attention,
        "gemm": gemm,
    }


def build_drafter(
    config: DraftConfig,
    target_head: TargetHead,
    loss_config: LossConfig | None = None,
    attention_backend: str | None = None,
    device: torch.device | None = None,
) -> Drafter:
    """A fresh drafter of ``config.kind`` (built on ``device`` when given): the backbone, which owns its kind's head."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return DFlashDrafter(config, target_head, loss_config, attention_backend)

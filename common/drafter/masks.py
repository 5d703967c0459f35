"""Attention masks of a DFlash training step.

Keys are ``[context (T tokens) ; blocks (N * B)]``; queries are the N * B block slots. A query of
block j (anchor a_j, slot s, position p = a_j + s) sees:
  - context key kv iff kv is in a_j's document and kv < a_j (strict: the anchor's own hidden state
    is never context at inference), and in a windowed layer p - pos(kv) < window;
  - block keys of its own block only (padding blocks too, so no row is empty): every slot t of it in
    a bidirectional layer, slots t <= s in a causal one (``DraftConfig.causal_in_block``), and in a
    windowed layer only those with |s - t| < window (a window smaller than the block bounds the
    block's own keys, as flash attention's window does at serving time).
Visibility depends on the anchor position, never on the block index.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import DraftConfig

FLEX_BLOCK = 128


def in_block_mask(block_size: int, causal: bool, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, B]`` bool: which slots t of its own block slot s sees."""
    slot = torch.arange(block_size, device=device)
    offset = slot[:, None] - slot[None, :]  # s - t
    visible = offset >= 0 if causal else torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window is not None:
        visible = visible & (offset.abs() < window)
    return visible


def context_bounds(blocks: DraftBlocks, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query slot ``[N * B]``: the visible context is ``lo <= kv < hi`` (empty for padding blocks)."""
    block_size = blocks.block_size
    slot = torch.arange(block_size, device=blocks.anchors.device)
    lo = blocks.doc_start[:, None].expand(-1, block_size)
    if window is not None:
        lo = torch.maximum(lo, blocks.anchors[:, None] + slot[None, :] - window + 1)
    hi = torch.where(blocks.valid, blocks.anchors, 0)[:, None].expand(-1, block_size)
    return lo.reshape(-1).contiguous(), hi.reshape(-1).contiguous()


def flex_block_mask(blocks: DraftBlocks, window: int | None = None, causal: bool = False,
                    compile_mask: bool = False) -> BlockMask:
    """Flex-attention block mask for one layer type (shared by all layers of that type)."""
    num_context = blocks.num_context
    block_size = blocks.block_size
    q_len = blocks.num_blocks * block_size
    lo, hi = context_bounds(blocks, window)
    # A window of at least the block bounds no slot of it: leave the term out of the kernel.
    block_window = window if window is not None and window < block_size else None

    def mask_mod(b, h, q, kv):
        in_context = (kv < num_context) & (kv >= lo[q]) & (kv < hi[q])
        key = kv - num_context
        own_block = (kv >= num_context) & (key // block_size == q // block_size)
        offset = q % block_size - key % block_size  # s - t
        if causal:
            own_block = own_block & (offset >= 0)
        if block_window is not None:
            own_block = own_block & (offset < block_window) & (-offset < block_window)
        return in_context | own_block

    return create_block_mask(mask_mod, None, None, q_len, num_context + q_len, device=blocks.anchors.device,
                             BLOCK_SIZE=FLEX_BLOCK, _compile=compile_mask)


def dense_reference_mask(blocks: DraftBlocks, window: int | None = None, causal: bool = False) -> torch.Tensor:
    """``[N * B, T + N * B]`` bool mask written from the definition (document ids and positions)."""
    num_blocks, block_size = blocks.block_ids.shape
    device = blocks.anchors.device
    kv_index = torch.arange(blocks.num_context, device=device)
    anchor_doc = blocks.context_doc_ids[blocks.anchors]
    query_pos = blocks.block_positions.reshape(-1)  # in-document position a_j + s
    query_anchor = blocks.anchors.repeat_interleave(block_size)
    query_doc = anchor_doc.repeat_interleave(block_size)
    query_valid = blocks.valid.repeat_interleave(block_size)
    context = (
        (blocks.context_doc_ids[None, :] == query_doc[:, None])
        & (kv_index[None, :] < query_anchor[:, None])
        & query_valid[:, None]
    )
    if window is not None:
        context &= (query_pos[:, None] - blocks.context_positions[None, :]) < window
    block_of_query = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    own = block_of_query[:, None] == block_of_query[None, :]
    key_pos = blocks.block_positions.reshape(-1)  # positions of the block keys
    if causal:
        own &= key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        own &= (query_pos[:, None] - key_pos[None, :]).abs() < window
    return torch.cat([context, own], dim=1)


def build_masks(blocks: DraftBlocks, config: DraftConfig, dense: bool = False,
                compile_mask: bool = False) -> dict[str, BlockMask | torch.Tensor]:
    """One mask per layer type of ``config``: flex block masks, or dense boolean masks (SDPA path)."""
    masks: dict[str, BlockMask | torch.Tensor] = {}
    for layer_type in dict.fromkeys(config.layer_types):
        window, causal = config.window_of(layer_type), config.causal_in_block(layer_type)
        masks[layer_type] = (dense_reference_mask(blocks, window, causal) if dense
                             else flex_block_mask(blocks, window, causal, compile_mask))
    return masks

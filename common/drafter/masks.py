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

Three forms of the same mask: flex-attention block masks (CUDA), tiled masks (CPU: each tile of query blocks
attends over the one stretch of keys its queries can see, so a sliding layer's cost follows the window, not the
document), and the dense reference (tests, and SDPA when asked for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from common.drafter.blocks import DraftBlocks
from common.drafter.draft_config import DraftConfig

FLEX_BLOCK = 128


def in_block_mask(
    block_size: int, causal: bool, window: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[B, B]`` bool: which slots t of its own block slot s sees."""
    slot = torch.arange(block_size, device=device)
    offset = slot[:, None] - slot[None, :]  # s - t
    visible = offset >= 0 if causal else torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    if window is not None:
        visible = visible & (offset.abs() < window)
    return visible


def in_block_pairs(block_size: int, causal: bool, window: int | None) -> int:
    """How many pairs (s, t) of ``in_block_mask`` are visible, counted on the host: no tensor is read back, so the
    step that counts them stays free of host reads."""
    reach = block_size if window is None else window  # |s - t| < reach
    return sum(1 for s in range(block_size) for t in range(block_size) if abs(s - t) < reach and (t <= s or not causal))


def context_bounds(blocks: DraftBlocks, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query slot ``[N * B]``: the visible context is ``lo <= kv < hi`` (empty for padding blocks)."""
    block_size = blocks.block_size
    slot = torch.arange(block_size, device=blocks.anchors.device)
    lo = blocks.doc_start[:, None].expand(-1, block_size)
    if window is not None:
        lo = torch.maximum(lo, blocks.anchors[:, None] + slot[None, :] - window + 1)
    hi = torch.where(blocks.valid, blocks.anchors, 0)[:, None].expand(-1, block_size)
    return lo.reshape(-1).contiguous(), hi.reshape(-1).contiguous()


def flex_block_mask(
    blocks: DraftBlocks, window: int | None = None, causal: bool = False, tile: int = FLEX_BLOCK
) -> BlockMask:
    """Flex-attention block mask for one layer type (shared by all layers of that type).

    Its tiles (``tile`` queries by ``tile`` keys) come from the anchors' context ranges and the blocks' own keys
    (``tile_layout``), so building it costs memory and time in tiles, not in query-key pairs: asking flex
    attention to find them instead evaluates the mask at every pair, 40 GiB at 4,096 anchors of 16 slots."""
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

    partial, full = tile_layout(lo, hi, num_context, q_len, block_size, tile)
    return block_mask_of_tiles(partial, full, tile, mask_mod, (q_len, num_context + q_len))


def tile_layout(
    lo: torch.Tensor, hi: torch.Tensor, num_context: int, q_len: int, block_size: int, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[query tiles, key tiles]`` bool pair (partial, full): the tiles where some query may see some key (the mask
    is applied there), and those where every query sees every key (no mask needed). Each query slot sees the
    context keys ``lo <= kv < hi`` and keys of its own block; a tile's queries are taken to see the union of their
    context ranges (the gaps between documents count as seen: a tile too many is slower, never wrong)."""
    device = lo.device
    q_tiles, kv_tiles = -(-q_len // tile), -(-(num_context + q_len) // tile)
    pad, never = q_tiles * tile - q_len, num_context + q_len + 1
    seen = hi > lo
    # What some query of the tile sees, and what all of them see (the padding past q_len is no query).
    some_lo = F.pad(torch.where(seen, lo, never), (0, pad), value=never).view(q_tiles, tile).amin(1)
    some_hi = F.pad(torch.where(seen, hi, 0), (0, pad), value=0).view(q_tiles, tile).amax(1)
    all_lo = F.pad(lo, (0, pad), value=0).view(q_tiles, tile).amax(1)
    all_hi = F.pad(hi, (0, pad), value=never).view(q_tiles, tile).amin(1)
    start = torch.arange(kv_tiles, device=device) * tile
    end = start + tile
    context_some = (
        (start < num_context)[None]
        & (start[None] < some_hi[:, None])
        & (end.clamp(max=num_context)[None] > some_lo[:, None])
    )
    context_all = (end <= num_context)[None] & (all_lo[:, None] <= start[None]) & (end[None] <= all_hi[:, None])
    if pad:  # a last query tile cut short by q_len stays partial, as flex attention's own masks keep it
        context_all[-1] = False
    # Block keys: the queries of a tile see the keys of their own blocks, which lie at the same offsets past the
    # context (a block may straddle two query tiles when ``tile`` is no multiple of B).
    q_start = torch.arange(q_tiles, device=device) * tile
    own_lo = num_context + q_start // block_size * block_size
    own_hi = num_context + -(-(q_start + tile).clamp(max=q_len) // block_size) * block_size
    own = (start[None] < own_hi[:, None]) & (end[None] > own_lo[:, None])
    return (context_some | own) & ~context_all, context_all


def block_mask_of_tiles(
    partial: torch.Tensor, full: torch.Tensor, tile: int, mask_mod: Callable, seq_lengths: tuple[int, int]
) -> BlockMask:
    """A flex-attention BlockMask from ``[query tiles, key tiles]`` bools: ``mask_mod`` is applied in the partial
    tiles, the full ones are computed whole, the others skipped. Building it costs memory in tiles, where
    ``create_block_mask`` evaluates ``mask_mod`` at every query-key pair to find them."""

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts, and the listed tiles first
        counts = tiles.sum(dim=-1, dtype=torch.int32)
        indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=seq_lengths
    )


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


def visible_pairs(blocks: DraftBlocks, config: DraftConfig) -> torch.Tensor:
    """Query-key pairs the masks let attend, summed over the drafter's layers (a device scalar, no host sync).

    The useful work of attention: a block-sparse kernel computes whole tiles, so it does a little more; a count
    from the sequence length alone would take every query to see half the packed sequence, where it sees the
    context of its own document up to its anchor (a packed batch of 160 documents: about 1/160 of that)."""
    pairs = torch.zeros((), dtype=torch.float64, device=blocks.anchors.device)
    for layer_type in dict.fromkeys(config.layer_types):
        window, causal = config.window_of(layer_type), config.causal_in_block(layer_type)
        lo, hi = context_bounds(blocks, window)
        own = in_block_pairs(blocks.block_size, causal, window) * blocks.num_blocks
        pairs = pairs + config.layer_types.count(layer_type) * ((hi - lo).clamp(min=0).sum() + own)
    return pairs


@dataclass
class TiledMask:
    """The mask of one layer type as tiles of whole blocks (the CPU attention path, ``tiled_attention`` in
    common/drafter/model.py): the queries ``q_start:q_end`` of a tile see context keys ``kv_start:kv_end`` at most
    (each query ``lo <= kv < hi`` of them) and the keys of their own blocks. Nothing in it is quadratic: a tile's
    dense mask is made when it is attended, tile queries by its stretch of keys, and a sliding layer's stretch is
    its window plus the span of the tile's anchors, whatever the document's length."""

    lo: torch.Tensor
    """[N * B] int64: first context key each query sees (``context_bounds``)."""
    hi: torch.Tensor
    """[N * B] int64: one past the last context key each query sees (``lo >= hi``: none)."""
    in_block: torch.Tensor
    """[B, B] bool: which slots of its own block a slot sees (``in_block_mask``)."""
    tiles: list[tuple[int, int, int, int]]
    """Per tile, host ints ``(q_start, q_end, kv_start, kv_end)``: its queries and the stretch of context keys."""
    context_index: torch.Tensor
    """[sum of the stretches] int64: the context keys of every tile's stretch, tile after tile (one gather of them
    all: a slice per tile would cost a gradient the size of the whole context per tile in the backward)."""

    @property
    def query_sizes(self) -> list[int]:
        return [q_end - q_start for q_start, q_end, _, _ in self.tiles]

    @property
    def context_sizes(self) -> list[int]:
        return [kv_end - kv_start for _, _, kv_start, kv_end in self.tiles]

    def tile_mask(self, index: int) -> torch.Tensor:
        """``[q_end - q_start, (kv_end - kv_start) + (q_end - q_start)]`` bool: the dense mask of tile ``index``
        over its stretch of context keys, then its own blocks' keys."""
        q_start, q_end, kv_start, kv_end = self.tiles[index]
        block_size = self.in_block.shape[0]
        kv = torch.arange(kv_start, kv_end, device=self.lo.device)
        context = (kv[None, :] >= self.lo[q_start:q_end, None]) & (kv[None, :] < self.hi[q_start:q_end, None])
        own = torch.block_diag(*[self.in_block] * ((q_end - q_start) // block_size))
        return torch.cat([context, own], dim=1)


def tiled_mask(
    blocks: DraftBlocks, window: int | None = None, causal: bool = False, tile: int = FLEX_BLOCK
) -> TiledMask:
    """The ``TiledMask`` of one layer type: tiles of ``tile // B`` blocks (at least one), each with the stretch of
    context keys from the lowest ``lo`` to the highest ``hi`` of its queries. Anchors are sorted, so a tile's blocks
    are neighbours and its stretch is short; a tile spanning two documents also covers the gap between them (masked:
    a few keys too many, never a wrong one). Reads the tile bounds on the host: a CPU path."""
    block_size = blocks.block_size
    q_len = blocks.num_blocks * block_size
    lo, hi = context_bounds(blocks, window)
    tile_queries = max(1, tile // block_size) * block_size
    num_tiles, pad = -(-q_len // tile_queries), -q_len % tile_queries
    seen = hi > lo
    never = blocks.num_context
    kv_start = F.pad(torch.where(seen, lo, never), (0, pad), value=never).view(num_tiles, -1).amin(1)
    kv_end = F.pad(torch.where(seen, hi, 0), (0, pad), value=0).view(num_tiles, -1).amax(1)
    kv_start = torch.minimum(kv_start, kv_end)  # a tile that sees no context gets an empty stretch
    q_start = torch.arange(num_tiles) * tile_queries
    q_end = (q_start + tile_queries).clamp(max=q_len)
    tiles = list(zip(q_start.tolist(), q_end.tolist(), kv_start.tolist(), kv_end.tolist()))
    device = blocks.anchors.device
    context_index = torch.cat([torch.arange(start, end, device=device) for _, _, start, end in tiles])
    return TiledMask(lo, hi, in_block_mask(block_size, causal, window, device), tiles, context_index)


MASK_FORMS = ("flex", "tiled", "dense")


def build_masks(
    blocks: DraftBlocks, config: DraftConfig, dense: bool = False, form: str | None = None
) -> dict[str, BlockMask | TiledMask | torch.Tensor]:
    """One mask per layer type of ``config``, in ``form``: flex block masks (the default), tiled masks (the CPU
    path) or dense boolean masks (the reference; ``dense=True`` says the same)."""
    form = form or ("dense" if dense else "flex")
    if form not in MASK_FORMS:
        raise ValueError(f"mask form must be one of {MASK_FORMS}, got {form!r}")
    build = {"flex": flex_block_mask, "tiled": tiled_mask, "dense": dense_reference_mask}[form]
    masks: dict[str, BlockMask | TiledMask | torch.Tensor] = {}
    for layer_type in dict.fromkeys(config.layer_types):
        masks[layer_type] = build(blocks, config.window_of(layer_type), config.causal_in_block(layer_type))
    return masks

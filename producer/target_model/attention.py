"""The target's attention over a packed row: causal inside each document, never across a boundary.

The decoder layers are the model's own modules; only their attention kernel is swapped, through transformers'
attention-function registry, for one that reads the packing (``PackedAttention``) passed down as a keyword argument:

- ``varlen``: FlashAttention-2 varlen (``aten._flash_attention_forward`` with ``cu_seqlens``), CUDA
  bf16/fp16. No mask to build, no host sync.
- ``flex``: ``flex_attention`` with a document-causal ``BlockMask`` (compiled), CUDA.
- ``sdpa``: one ``scaled_dot_product_attention`` per document, any device; the exact reference. A sliding-window
  layer attends in chunks of queries over the keys their window reaches: nothing of length x length is made, so
  one document of 64K or 128K tokens in one packed row costs memory linear in its length.

Sharded over a tensor-parallel group, the kernels see this rank's heads only, which they take from the tensors'
shapes. Without packing (an ordinary HF forward with a cache, as the greedy target runs) the kernel is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_BACKENDS = ("auto", "varlen", "flex", "sdpa")
# Registered in transformers' attention registry; falls back to plain SDPA when no packing is given,
# so the same model object still serves an ordinary HF forward (references, baselines).
PACKED_ATTENTION_NAME = "dflash_packed"


@dataclass
class PackedAttention:
    """How the documents of one packed batch attend; passed to every layer's attention kernel."""

    backend: str
    cu_seqlens: torch.Tensor
    """int32 ``[D + 1]`` on the model's device."""
    linear: str = "per_document"
    """How Gated-DeltaNet layers run (producer/target_model/linear_attention.py): fla or per_document."""
    document_bounds: tuple[tuple[int, int], ...] = ()
    """Host copy of (start, end) per document; ``sdpa`` attention and ``per_document`` linear layers only."""
    block_masks: dict[int | None, Any] = field(default_factory=dict)
    """``flex`` only: a document-causal BlockMask per sliding window (None: full attention)."""


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    dflash_packed: PackedAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface kernel. q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    if dflash_packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch dimension 1)")
    if dflash_packed.backend == "varlen":
        out = _varlen_attention(query, key, value, dflash_packed.cu_seqlens, scaling, sliding_window)
    elif dflash_packed.backend == "flex":
        out = _flex_attention(query, key, value, dflash_packed.block_masks[sliding_window], scaling)
    else:
        out = _per_document_sdpa(query, key, value, dflash_packed.document_bounds, scaling, sliding_window)
    return out, None


def _varlen_attention(query, key, value, cu_seqlens, scaling, sliding_window):
    # FA2 varlen wants [T, heads, D]; it handles GQA itself. max_seqlen = T (from the shape, so no host
    # value enters a compiled graph): the kernel's blocks past a document's end exit at once.
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    total = q.shape[0]
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1, "window_size_right": 0}
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, total, total, 0.0, True, False, scale=scaling, **window
    )[0]
    return out.unsqueeze(0)


_compiled_flex_attention = None


def _flex_attention(query, key, value, block_mask, scaling):
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Uncompiled flex attention is a slow reference; inside an outer torch.compile this is inlined.
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
    out = _compiled_flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


SLIDING_QUERY_CHUNK = 512
"""Queries per SDPA call of a sliding-window layer in the ``sdpa`` kernel (see ``_sliding_window_sdpa``)."""


def _per_document_sdpa(query, key, value, document_bounds, scaling, sliding_window):
    outputs = []
    for start, end in document_bounds:
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if sliding_window is not None and end - start > sliding_window:
            out = _sliding_window_sdpa(q, k, v, sliding_window, scaling)
        else:
            # Causal without a mask: CPU and CUDA SDPA run it as flash attention, in memory linear in the length.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _sliding_window_sdpa(q, k, v, window: int, scaling, chunk: int = SLIDING_QUERY_CHUNK):
    """Causal attention of one document within ``window``, ``chunk`` queries at a time over the keys they can see
    (the window before the chunk and the chunk itself): a mask of chunk x (chunk + window) per call, where one mask
    over the document is length x length (16 GiB at 128K tokens, 64 GiB with SDPA's float copy of it)."""
    length = q.shape[2]
    outputs = []
    for q_start in range(0, length, chunk):
        q_end = min(q_start + chunk, length)
        kv_start = max(0, q_start - window + 1)
        distance = torch.arange(q_start, q_end, device=q.device)[:, None] - torch.arange(
            kv_start, q_end, device=q.device
        )
        mask = (distance >= 0) & (distance < window)
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, q_start:q_end],
                k[:, :, kv_start:q_end],
                v[:, :, kv_start:q_end],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=2)


def document_causal_block_mask(document_ids: torch.Tensor, sliding_window: int | None = None, tile: int = 128):
    """flex_attention BlockMask: causal inside each document (and within ``sliding_window`` if set). Its tiles
    come from the documents' bounds (``document_causal_tiles``), not from the mask at every pair of tokens."""
    from common.drafter.masks import block_mask_of_tiles

    def same_document_causal(batch, head, q_index, kv_index):
        visible = (document_ids[q_index] == document_ids[kv_index]) & (q_index >= kv_index)
        if sliding_window is not None:
            visible = visible & (q_index - kv_index < sliding_window)
        return visible

    total = document_ids.numel()
    partial, full = document_causal_tiles(document_ids, sliding_window, tile)
    return block_mask_of_tiles(partial, full, tile, same_document_causal, (total, total))


def document_causal_tiles(
    document_ids: torch.Tensor, sliding_window: int | None, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tiles, tiles]`` bool pair (partial, full) of the packed causal mask, from the sorted document ids: a
    key tile before the query tile holds a visible pair exactly when its last token's document reaches the query
    tile's first token (their closest pair), and is visible throughout when one document spans both tiles."""
    total = document_ids.numel()
    tiles = -(-total // tile)
    start = torch.arange(tiles, device=document_ids.device) * tile
    first, last = document_ids[start], document_ids[(start + tile - 1).clamp(max=total - 1)]
    q, kv = start[:, None], start[None, :]
    earlier = kv < q
    some = (kv == q) | (earlier & (last[None, :] == first[:, None]))
    full = earlier & (first[None, :] == last[:, None]) & (q + tile <= total)
    if sliding_window is not None:
        some &= (kv == q) | (q - (kv + tile - 1) < sliding_window)  # the closest pair of the two tiles
        full &= q + tile - 1 - kv < sliding_window  # the farthest
    return some & ~full, full


_registered = False


def register_packed_attention() -> None:
    """Register the packed kernel (and SDPA's masks) under ``PACKED_ATTENTION_NAME`` in transformers (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION_NAME, packed_attention_forward)
    # An ordinary HF forward through this model builds the masks SDPA would get.
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION_NAME, sdpa_mask)
    _registered = True


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> varlen on CUDA in bf16/fp16 (sm80+), flex on other CUDA, sdpa on CPU."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: {requested!r} is not one of {ATTENTION_BACKENDS}")
    if requested != "auto":
        if requested in ("varlen", "flex") and device.type != "cuda":
            raise ValueError(f"attention: {requested!r} needs a CUDA device, got {device}")
        if requested == "varlen" and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("attention: 'varlen' (FlashAttention-2) needs bfloat16 or float16")
        return requested
    if device.type != "cuda":
        return "sdpa"
    flash_ok = dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(device)[0] >= 8
    return "varlen" if flash_ok else "flex"

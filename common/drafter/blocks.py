"""Training samples of a packed batch: anchors per document and the draft blocks built on them.

Everything here runs on the batch's device without host synchronisation, so it can be queued
ahead of the step that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.batch import PackedBatch, document_ids, position_ids


@dataclass
class DraftBlocks:
    """N draft blocks of B slots over one packed sequence of T tokens (padding blocks have valid False)."""

    anchors: torch.Tensor
    """[N] int64: anchor position a_j in the packed sequence (0 for padding blocks)."""
    valid: torch.Tensor
    """[N] bool: real block (False: padding up to N)."""
    doc_start: torch.Tensor
    """[N] int64: first packed index of the anchor's document."""
    block_ids: torch.Tensor
    """[N, B] int64: ``[x_a, MASK, ..., MASK]``."""
    block_positions: torch.Tensor
    """[N, B] int64: in-document positions ``pos(a) .. pos(a) + B - 1`` (for RoPE)."""
    label_index: torch.Tensor
    """[N, B-1] int64: packed index a_j + k of the label of slot k = 1..B-1 (clamped to T - 1)."""
    label_ids: torch.Tensor
    """[N, B-1] int64: data token x_{a_j + k}."""
    label_mask: torch.Tensor
    """[N, B-1] bool: slot k is supervised (loss_mask, same document, inside the batch, valid block)."""
    context_doc_ids: torch.Tensor
    """[T] int32: document of every context token."""
    context_positions: torch.Tensor
    """[T] int64: in-document position of every context token."""

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[0]

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[1]

    @property
    def num_context(self) -> int:
        return self.context_positions.shape[0]


def valid_anchor_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """[T] bool: a is a valid anchor iff ``loss_mask[a + 1] == 1`` and a + 1 is in a's document."""
    valid = torch.zeros_like(doc_ids, dtype=torch.bool)
    valid[:-1] = loss_mask[1:].bool() & (doc_ids[1:] == doc_ids[:-1])
    return valid


def label_coverage(blocks: DraftBlocks, loss_mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the batch's supervised tokens that are the label of at least one slot (a 0-d tensor, no host
    synchronisation): how much of the data a step trains on."""
    covered = torch.zeros(loss_mask.shape[0], dtype=torch.float32, device=loss_mask.device)
    covered.scatter_reduce_(0, blocks.label_index.reshape(-1), blocks.label_mask.reshape(-1).float(), reduce="amax")
    return covered.sum() / loss_mask.float().sum().clamp_min(1.0)


def sample_anchors(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``num_anchors`` valid anchors of the whole packed batch without replacement, spread over documents
    and evenly over each document.

    The number is per packed batch (not per document, not per sequence of a batch): its density, anchors per
    supervised token, is what sets how much of the data a step covers (``label_coverage``). How many anchors each
    document gets: candidate r of a document with c candidates gets priority r / c, and the N lowest priorities win
    (random tie-break). So every document gets its first anchor before any gets a second share, and beyond that
    documents get anchors in proportion to their supervised tokens: a short document packed beside long ones is
    never starved. Where in a document: its k anchors are stratified over its c candidates in position order, one
    drawn uniformly from each of k consecutive strata of c / k candidates, so a 64K-token document's anchors reach
    from its first supervised tokens to its last with no stretch left out (a uniform draw of the same k leaves gaps
    of about ln k strata). Returns sorted ``(anchors, valid)``, both ``[N]``, padded with invalid blocks at anchor 0.
    """
    total = loss_mask.shape[0]
    device = loss_mask.device
    num_docs = cu_seqlens.shape[0] - 1
    doc_ids = document_ids(cu_seqlens, total).long()
    candidate = valid_anchor_mask(loss_mask, doc_ids)

    # [T, 2]: a token's draws do not depend on how many follow it (a padding document appended changes none).
    noise = torch.rand(total, 2, generator=generator, device=generator.device, dtype=torch.float64).to(device).T
    group = torch.where(candidate, doc_ids, num_docs)  # non-candidates form one last group
    # Candidates in position order, which is document order (documents are contiguous), non-candidates last.
    by_position = torch.argsort(group, stable=True)
    counts = torch.zeros(num_docs + 1, dtype=torch.long, device=device).scatter_add_(0, group, torch.ones_like(group))
    first = torch.cumsum(counts, 0) - counts  # index in by_position of each document's first candidate
    group_sorted = group[by_position]
    rank = torch.arange(total, device=device) - first[group_sorted]
    priority = rank.double() / counts[group_sorted].clamp_min(1)
    priority = torch.where(group_sorted < num_docs, priority, 2.0)
    # Distinct priorities differ by at least 1 / T^2, so this jitter only breaks ties.
    priority = priority + noise[0] * (0.5 / total**2)
    take = min(num_anchors, total)
    chosen = torch.argsort(priority)[:take]
    chosen_valid = priority[chosen] < 2.0
    # A document's chosen priorities are its lowest ranks 0 .. k - 1: rank j picks a candidate of stratum j.
    doc = group_sorted[chosen]
    stratum = rank[chosen]
    per_doc = torch.zeros(num_docs + 1, dtype=torch.long, device=device).scatter_add_(0, doc, chosen_valid.long())
    k, c = per_doc[doc].clamp_min(1), counts[doc]
    stratum_start, stratum_end = stratum * c // k, (stratum + 1) * c // k  # c >= k: never empty, never shared
    offset = (noise[1, :take] * (stratum_end - stratum_start)).long().clamp_max(stratum_end - stratum_start - 1)
    positions = by_position[(first[doc] + stratum_start + offset).clamp(0, total - 1)]
    # Sort the real anchors ascending (block-sparse friendly), padding last.
    sort_key = torch.where(chosen_valid, positions, total + torch.arange(take, device=device))
    sort_order = torch.argsort(sort_key)
    anchors = torch.where(chosen_valid[sort_order], positions[sort_order], 0)
    valid = chosen_valid[sort_order]
    if take < num_anchors:
        pad = num_anchors - take
        anchors = torch.cat([anchors, anchors.new_zeros(pad)])
        valid = torch.cat([valid, valid.new_zeros(pad)])
    return anchors, valid


def build_blocks(
    batch: PackedBatch,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    generator: torch.Generator | None,
    anchors: torch.Tensor | None = None,
) -> DraftBlocks:
    """Anchors and draft blocks of one packed batch: ``num_anchors`` drawn by ``sample_anchors`` with ``generator``,
    or the given sorted ``anchors`` (all valid; the evaluation scores the positions a decoding started blocks at)."""
    input_ids = batch.input_ids.long()
    total = input_ids.shape[0]
    device = input_ids.device
    doc_ids = document_ids(batch.cu_seqlens, total)
    positions = position_ids(batch.cu_seqlens, total)
    if anchors is None:
        anchors, valid = sample_anchors(batch.loss_mask, batch.cu_seqlens, num_anchors, generator)
    else:
        anchors = anchors.to(device=device, dtype=torch.long)
        valid = torch.ones_like(anchors, dtype=torch.bool)
        num_anchors = anchors.shape[0]

    doc_start = batch.cu_seqlens.long()[doc_ids[anchors].long()]
    offsets = torch.arange(1, block_size, device=device)
    raw_index = anchors[:, None] + offsets[None, :]
    label_index = raw_index.clamp_max(total - 1)
    label_mask = (
        (raw_index < total)
        & (doc_ids[label_index] == doc_ids[anchors][:, None])
        & batch.loss_mask[label_index].bool()
        & valid[:, None]
    )
    block_ids = torch.full((num_anchors, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = input_ids[anchors]
    block_positions = positions[anchors][:, None] + torch.arange(block_size, device=device)[None, :]
    return DraftBlocks(
        anchors=anchors,
        valid=valid,
        doc_start=doc_start,
        block_ids=block_ids,
        block_positions=block_positions,
        label_index=label_index,
        label_ids=input_ids[label_index],
        label_mask=label_mask,
        context_doc_ids=doc_ids,
        context_positions=positions,
    )

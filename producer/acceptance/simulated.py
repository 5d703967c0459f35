"""The simulated acceptance: the training metric (teacher-forced blocks, the drafter kind's ``objective``) on the
held-out documents with the same weights, beside the real tau. Their gap is what teacher forcing hides, and the
report splits it in three with one more run of the training forward, over the text the decoding produced (the
target's greedy text, whose features the reference holds: ``greedy_text``), read at every anchor of that text
(``sim_tau_greedy``; the documents' distance from it: data that is not the target's own text) and at the anchors
the decoding started its blocks at (``sim_tau_walk``; from every anchor to these: what a walk that restarts after
each rejection costs; from these to real tau: any difference between the trained forward and the served one, zero
when the two agree).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np
import torch

from common.acceptance.arithmetic import Decoded, Transcript, decoding_anchors
from common.batch import Document, PackedBatch
from common.drafter.base import Drafter
from common.drafter.blocks import DraftBlocks, build_blocks, valid_anchor_mask
from common.drafter.loss import LossConfig
from common.drafter.masks import build_masks
from producer.acceptance.held_out import prompt_of
from producer.acceptance.transcripts import DocumentFeatures


@torch.no_grad()
def simulated_acceptance(
    drafter: Drafter,
    documents: Sequence[Document],
    features: Iterable[DocumentFeatures],
    num_anchors: int,
    seed: int = 0,
    anchors: Sequence[torch.Tensor] | None = None,
) -> tuple[float, list[float]]:
    """The training metric on ``documents`` with their target ``features`` (taken one document at a time, so they
    may be made as they are needed, and may be those of a longer text that begins with the document): (tau, acc_k)
    of teacher-forced blocks at up to ``num_anchors`` anchors per document, sampled as in training or drawn from
    each document's given sorted ``anchors``, labelled as ``drafter.loss_config`` says. Dense masks; tau pools the
    blocks of every document, as real tau pools verify forwards."""
    config = drafter.config
    device = drafter.fc.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    streaks = blocks_seen = 0.0
    correct = torch.zeros(config.block_size - 1, device=device)
    supervised = torch.zeros(config.block_size - 1, device=device)
    for i, (document, kept) in enumerate(zip(documents, features)):
        chosen = None
        if anchors is not None:
            chosen = anchors[i].to(device)
            if not chosen.numel():
                continue
            if chosen.numel() > num_anchors:
                keep = torch.randperm(chosen.numel(), generator=generator, device=device)[:num_anchors]
                chosen = chosen[keep.sort().values]
        blocks, metrics = teacher_forced(drafter, drafter.loss_config, document, kept, num_anchors, generator, chosen)
        streaks += float((metrics["tau"] - 1) * metrics["num_blocks"])
        blocks_seen += float(metrics["num_blocks"])
        per_slot = blocks.label_mask.float().sum(0)
        correct += metrics["acc"] * per_slot
        supervised += per_slot
    return 1.0 + streaks / max(blocks_seen, 1.0), (correct / supervised.clamp_min(1.0)).tolist()


def teacher_forced(
    drafter: Drafter,
    loss_config: LossConfig,
    document: Document,
    kept: DocumentFeatures,
    num_anchors: int,
    generator: torch.Generator | None,
    anchors: torch.Tensor | None = None,
) -> tuple[DraftBlocks, dict[str, torch.Tensor]]:
    """One document's teacher-forced blocks, at up to ``num_anchors`` sampled anchors or at the given sorted
    ``anchors``, labelled as ``loss_config`` says, and their ``draft_metrics``. Tiled masks on every device: each
    tile of blocks attends over only the keys it can see, so a long document costs memory linear in its length
    (a dense mask is [blocks x B, T]), and nothing is compiled per document shape."""
    config = drafter.config
    device = drafter.fc.weight.device
    input_ids = torch.as_tensor(document.input_ids, device=device)
    # Features of a longer text (the whole document of a decoded span) are cut to this one: they are causal.
    aux_hidden = kept.aux_hidden[: len(document)].to(device, non_blocking=True)
    batch = PackedBatch(
        input_ids=input_ids,
        loss_mask=torch.as_tensor(document.loss_mask, device=device),
        cu_seqlens=torch.tensor([0, len(document)], dtype=torch.int32, device=device),
        sample_ids=torch.tensor([document.sample_id], device=device),
        aux_hidden=aux_hidden,
    )
    blocks = build_blocks(batch, num_anchors, config.block_size, config.mask_token_id, generator, anchors)
    hidden = drafter(aux_hidden, blocks, build_masks(blocks, config, form="tiled"))
    target_hidden = None
    if kept.last_hidden is None and loss_config.labels_from_target:
        raise ValueError(
            f"label_mode {loss_config.label_mode!r}: this evaluator does not capture the target's last layer "
            "(capture_last)"
        )
    if kept.last_hidden is not None:
        head = drafter.target_head
        target_hidden = head.final_norm(
            kept.last_hidden[: len(document)].to(device, head.norm_weight.dtype, non_blocking=True)
        )
    context = drafter.block_context(aux_hidden, blocks) if drafter.reads_block_context else None
    _, metrics = drafter.objective(hidden, blocks, target_hidden, loss_config, context)
    return blocks, metrics


def decoded_span(
    document: Document, prompt_len: int, max_new_tokens: int, block_size: int
) -> tuple[Document, torch.Tensor]:
    """The part of the document that real decoding of its prompt produces, and the anchors decoding can start blocks
    at in it, for its simulated acceptance: (the document as far as those blocks read, the sorted anchors).

    The anchors run from the answer's first token (the prefill's) to the one before its ``max_new_tokens``-th: a
    longer answer's later anchors would weigh in the simulation and never in the decoding. Each block reads its
    labels on past that cut, as the decoding's last block does (its acceptance counts whole), so a block near the
    end is not cut short. The answer's first token is no label: decoding takes it from the prefill, never from a
    block."""
    start = prompt_of(document, prompt_len).numel()
    end = min(len(document), start + max_new_tokens + block_size - 2)
    loss_mask = document.loss_mask[:end].copy()
    loss_mask[: start + 1] = 0
    span = Document(document.sample_id, document.input_ids[:end], loss_mask)
    mask = torch.as_tensor(loss_mask)
    candidates = valid_anchor_mask(mask, torch.zeros_like(mask, dtype=torch.int32)).nonzero()[:, 0]
    return span, candidates[candidates <= start + max_new_tokens - 2]


def greedy_text(transcript: Transcript, sample_id: int) -> Document:
    """A held-out prompt's greedy text as a document, as far as the decoding's blocks read it (every token with
    features: all but the last): labels from the continuation's second token on (the first comes from the
    prefill)."""
    end = len(transcript.tokens) - 1
    loss_mask = np.zeros(end, dtype=np.uint8)
    loss_mask[transcript.prompt_len + 1 :] = 1
    return Document(sample_id, np.asarray(transcript.tokens[:end], dtype=np.int32), loss_mask)


@torch.no_grad()
def on_greedy_text(
    drafter: Drafter, transcripts: Sequence[Transcript], decoded: Sequence[Decoded]
) -> tuple[float, float]:
    """The training metric on the text the decoding produced: at every anchor, and at the decoding's own anchors
    (``AcceptanceReport.sim_tau_greedy`` and ``sim_tau_walk``). Data labels: that text is the target's argmax.
    One forward per prompt serves both: the decoding's anchors are some of every anchor, and a block's result
    does not depend on the blocks beside it."""
    data_labels = replace(drafter.loss_config, label_mode="data")
    every_streaks = walk_streaks = 0.0
    every_blocks = walk_blocks = 0
    for r, (transcript, one) in enumerate(zip(transcripts, decoded)):
        # Every anchor whose first label is a token the decoding kept; its block reads on past the cut, as the
        # decoding's last block does, so the two sets of anchors differ in nothing else.
        first = transcript.prompt_len
        every = torch.arange(first, first + len(one.tokens) - 1)
        if not every.numel():
            continue  # a decoding that ended at its prefill started no block
        _, metrics = teacher_forced(
            drafter,
            data_labels,
            greedy_text(transcript, r),
            DocumentFeatures(transcript.features, transcript.last_hidden),
            0,
            None,
            every,
        )
        streaks = metrics["block_streaks"]
        walk = torch.as_tensor(decoding_anchors(transcript, one), device=streaks.device) - first
        every_streaks += float(streaks.sum())
        walk_streaks += float(streaks[walk].sum())
        every_blocks += every.numel()
        walk_blocks += walk.numel()
    return 1.0 + every_streaks / max(every_blocks, 1), 1.0 + walk_streaks / max(walk_blocks, 1)

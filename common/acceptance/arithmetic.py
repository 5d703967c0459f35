"""Acceptance evaluation: speculative decoding of the target with the drafter (greedy, or sampled), on held-out prompts.

    python -m launch.evaluate --checkpoint RUN/checkpoints/step-N     # offline: the run's target and held-out data

Producer 0 runs it for a training run (producer/evaluation.py builds it from the run's data). This module is the
drafter's side and the arithmetic: drafting rows, replaying the target's greedy text, what each block accepts,
simulated acceptance, both tau conventions, acceptance by context length and the report. The target's side (its
KV-cached verification ``GreedyTarget``, its greedy transcripts, live ``speculative_decode``, timing its forwards)
and the ``Evaluator`` that runs both are producer/verify.py's.

A server decodes a prompt in rounds: the drafter fills the block ``[last kept token, MASK x (B-1)]`` from the
features (outputs of the captured target layers) of every kept token before it; the target verifies the block
in one forward and keeps the drafted tokens that equal its own greedy tokens, plus its token after them (the
correction, or a bonus when all B-1 were right); the kept tokens' features from that forward extend the
drafter's context. Rejected tokens never enter it.

The target's half of this does not depend on the drafter. Every kept token is the target's greedy choice after
the kept prefix (that is what makes the decoding lossless), so the text is the target's greedy text whatever
is drafted, and the features of the kept tokens are the features of that text. So the evaluator computes once,
per held-out prompt, the target's greedy continuation and the features of every token (``TargetReference``:
the same forward hooks and KV-cached forwards as live decoding), and each evaluation runs only the drafter
(``replay_rows``): every round it drafts from the features of the kept tokens, the target's greedy text
decides how many drafts are kept, and the next round starts after them. The acceptance is exactly live
decoding's (``speculative_decode`` is the live decoder, one prompt at a time; the tests hold the two
together, for plain, sliding-window and hybrid Gated-DeltaNet targets). An evaluation after the first runs no
target forward at all, and prompts are drafted together whatever the target's layers.

tau is the mean number of tokens kept per verify forward, correction included (1 <= tau <= B), pooled over every
verify forward, the last block counted whole; ``zlab_tau`` beside it counts as z-lab's ``dflash_generate`` does
(tokens added per step, cut at the stop token and max_new_tokens, mean per prompt, then over prompts).

At ``eval.temperature`` > 0 the decoding is sampled: lossless rejection sampling (``common.drafter.sampling.
rejection_sample``) of the drafter kind's proposal against the target's sampling distribution. Its text depends on
the draws, so nothing is replayed: ``speculative_decode`` runs live, one prompt at a time, each prompt with its own
generator seeded by ``eval.seed``; the figures on the greedy text (``sim_tau_greedy``, ``sim_tau_walk``) are left out.

Next to it the simulated tau: the training metric (teacher-forced blocks, the drafter kind's ``objective``)
on the same held-out documents with the same weights. Their gap is what teacher forcing hides, and the report
splits it in three with one more run of the training forward, over the text the decoding produced (the
target's greedy text, whose features the reference holds), read at every anchor of that text
(``sim_tau_greedy``; the documents' distance from it: data that is not the target's own text) and at the
anchors the decoding started its blocks at (``sim_tau_walk``; from every anchor to these: what a walk that
restarts after each rejection costs; from these to real tau: any difference between the trained forward and
the served one, zero when the two agree). The documents' target features are kept too (within ``eval.reference_cache_gb``).

By context length: a multi-turn held-out record is a prompt per assistant turn (``turn_documents``: the conversation
before the turn), each verify forward counts in the bucket of ``eval.length_buckets`` its context falls in (the prompt
and the tokens generated before its block: ``block_contexts``), and per bucket the target's verify and decode forwards
and the drafter's round are timed at one context (``time_target_round``, ``time_draft_round``) for the tau above which
speculation pays there (``RoundCosts.break_even_tau``; docs/evaluation.md derives it).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from common.batch import Document, PackedBatch
from common.drafter.base import Drafter
from common.drafter.blocks import DraftBlocks, build_blocks, valid_anchor_mask
from common.drafter.loss import LossConfig
from common.drafter.masks import build_masks, in_block_mask
from common.drafter.sampling import Proposal, Sampling

log = logging.getLogger(__name__)


# -- the target side ------------------------------------------------------------------------------


# -- the target's half, computed once ------------------------------------------------------------


@dataclass
class Transcript:
    """One held-out prompt's decoding as far as the target decides it."""

    prompt_len: int
    tokens: list[int]
    """The prompt, then the target's greedy continuation (not stopped at a stop token: a block may run past it)."""
    features: torch.Tensor
    """``[len(tokens) - 1, n * H]``: the drafter's features of every token but the last, kept on the host."""
    last_hidden: torch.Tensor | None = None
    """``[len(tokens) - 1, H]``: the target's last layer's output at the same tokens, where it is captured (for an
    objective that reads the target's distribution)."""

    @property
    def continuation(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass
class DocumentFeatures:
    """A held-out document's target features for the simulated acceptance, kept on the host (or, past the cache's
    budget, None: that document runs through the target at every evaluation)."""

    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor | None = None


def reference_length(max_new_tokens: int, block_size: int) -> int:
    """Greedy tokens a replay may read: a round starts below ``max_new_tokens`` and reads up to B past its anchor."""
    return max_new_tokens + block_size - 1


# -- the drafter side -----------------------------------------------------------------------------


class DraftContext:
    """The drafter during live decoding of one prompt: the fused context of every kept token before the block.

    The context is cached fused (``hidden_norm(fc(features))``, one row per kept token); each proposal runs
    the drafter's own layers on it, so decoding exercises exactly the trained forward. ``confidence_min``: a drafter
    with a confidence head proposes only the drafts before its first below it (``Proposal.kept_drafts``).
    """

    def __init__(self, drafter: Drafter, confidence_min: float = 0.0) -> None:
        self.drafter = drafter
        self.confidence_min = confidence_min
        config = drafter.config
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.ctx = torch.empty(0, config.hidden_size, device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)

    def extend(self, features: torch.Tensor) -> None:
        """Append the target features ``[n, n_layers * H]`` of newly kept tokens."""
        self.ctx = torch.cat([self.ctx, self.drafter.fuse_context(features)])

    def propose(self, token: int, position: int) -> torch.Tensor:
        """Greedy draft tokens ``[B - 1]`` (fewer where the confidence cut them) for slots 1.. of the block anchored at
        ``token``, at ``position`` (equal to the number of context tokens: the anchor's own features are never
        context)."""
        return self.proposal(token, position).tokens[0]

    def proposal(
        self, token: int, position: int, sampling: Sampling | None = None, generator: torch.Generator | None = None
    ) -> Proposal:
        """The drafter kind's proposal of the same block (one row), greedy or under ``sampling``: the tokens and, when
        sampled, the distribution they were drawn from (DFlash 2: over its candidates)."""
        device = self.ctx.device
        anchor = torch.tensor([token], device=device)
        hidden = draft_rows(self.drafter, [self.ctx], anchor, torch.tensor([position], device=device))
        proposal = self.drafter.propose(hidden, anchor, sampling, generator, context_rows(self.drafter, [self.ctx]))
        return proposal.first(int(proposal.kept_drafts(self.confidence_min)[0]))


class DraftRows:
    """The drafter over several transcripts: each row's features fused once, and one drafter forward drafts a block
    for every row, over the context of its kept tokens (a prefix of its transcript)."""

    def __init__(self, drafter: Drafter, features: Sequence[torch.Tensor], confidence_min: float = 0.0) -> None:
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.confidence_min = confidence_min
        device = drafter.fc.weight.device
        lengths = [int(f.shape[0]) for f in features]
        fused = drafter.fuse_context(torch.cat([f.to(device, non_blocking=True) for f in features]))
        self.contexts = list(fused.split(lengths))

    def propose(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
        """Greedy drafts ``[len(rows)][B - 1]`` (fewer where the confidence cut them) of the blocks anchored at
        ``tokens`` at ``positions``: row ``rows[i]`` drafts over the features of its first ``positions[i]`` tokens
        (the anchor's own are never context)."""
        device = self.contexts[0].device
        contexts = [self.contexts[r][:p] for r, p in zip(rows, positions)]
        anchors = torch.tensor(list(tokens), device=device)
        hidden = draft_rows(self.drafter, contexts, anchors, torch.tensor(list(positions), device=device))
        proposal = self.drafter.propose(hidden, anchors, context=context_rows(self.drafter, contexts))
        kept = proposal.kept_drafts(self.confidence_min).tolist()
        return [draft[:count] for draft, count in zip(proposal.tokens.tolist(), kept)]  # one copy for all rows


@torch.no_grad()
def propose_rows(
    drafter: Drafter, contexts: list[torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Greedy draft tokens ``[R, B - 1]`` of one block per row in one drafter forward (see :func:`draft_rows`); the
    drafter's kind turns the slots' hidden states into tokens (DFlash: the argmax; DFlash 2: the selector's walk)."""
    hidden = draft_rows(drafter, contexts, tokens, positions)
    return drafter.propose(hidden, tokens, context=context_rows(drafter, contexts)).tokens


def context_rows(drafter: Drafter, contexts: list[torch.Tensor]) -> torch.Tensor | None:
    """[R, H] each row's context row (its last fused context token; zeros for an empty context), for a kind that
    reads it; else None."""
    if not drafter.reads_block_context:
        return None
    width = drafter.config.hidden_size
    return torch.stack([c[-1] if c.shape[0] else c.new_zeros(width) for c in contexts])


@torch.no_grad()
def draft_rows(
    drafter: Drafter, contexts: list[torch.Tensor], tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Draft hidden states ``[R, B, H]`` (after the final norm) of the slots of one block per row, in one drafter
    forward: row r's block is anchored at ``tokens[r]``, at ``positions[r]``, over its fused context ``contexts[r]``
    ``[C_r, H]``. The rows are packed as in training (every block sees only its own row's context), with the
    training masks."""
    config = drafter.config
    block_size, device = config.block_size, contexts[0].device
    num_rows = len(contexts)
    ctx = torch.cat(contexts)
    lengths = torch.tensor([c.shape[0] for c in contexts], device=device)
    context_rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    context_positions = torch.arange(ctx.shape[0], device=device) - torch.repeat_interleave(
        lengths.cumsum(0) - lengths, lengths
    )
    block_ids = torch.full((num_rows, block_size), config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = tokens
    block_positions = (positions[:, None] + torch.arange(block_size, device=device)).reshape(-1)
    block_rows = torch.arange(num_rows, device=device).repeat_interleave(block_size)
    slot = torch.arange(block_size, device=device).repeat(num_rows)
    x = drafter.target_head.embed(block_ids.reshape(-1)).to(ctx.dtype)
    block_rope = drafter.rotary(block_positions, ctx.dtype)
    context_rope = drafter.rotary(context_positions, ctx.dtype)
    masks = {}
    for layer_type in dict.fromkeys(config.layer_types):
        # The training mask of common.drafter.masks for one block per document: the row's whole context (a windowed
        # layer only the window before each slot), and its own block as the layer type trained it.
        window = config.window_of(layer_type)
        context = block_rows[:, None] == context_rows[None, :]
        if window is not None:
            context &= (block_positions[:, None] - context_positions[None, :]) < window
        own = in_block_mask(block_size, config.causal_in_block(layer_type), window, device)[
            slot[:, None], slot[None, :]
        ]
        masks[layer_type] = torch.cat([context, own & (block_rows[:, None] == block_rows[None, :])], dim=1)
    for layer in drafter.layers:
        x = layer(x, ctx, block_rope, context_rope, masks[layer.layer_type])
    return drafter.norm(x).view(num_rows, block_size, -1)


# -- decoding -------------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One prompt's speculative decoding."""

    tokens: list[int]
    """The generated tokens (prompt excluded), cut at max_new_tokens or after the first stop token."""
    accepted: list[int]
    """Per verify forward: how many drafted tokens the target accepted (0 .. B-1)."""
    drafted: list[int] = field(default_factory=list)
    """Per verify forward: how many drafted tokens it verified (B - 1 but where a confidence cut them)."""
    replayed: list[int] = field(default_factory=list)
    """Live decoding of a hybrid target only: per replay after a rejection, how many kept tokens ran again."""


def cut_answer(tokens: list[int], max_new_tokens: int, stop_token_ids: frozenset[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def answer_finished(generated: Sequence[int], max_new_tokens: int, stop_token_ids: frozenset[int]) -> bool:
    """A server stops once ``max_new_tokens`` are kept or a stop token is among them."""
    return len(generated) >= max_new_tokens or not stop_token_ids.isdisjoint(generated)


@torch.no_grad()
def replay_rows(
    drafts: DraftRows,
    transcripts: Sequence[Transcript],
    max_new_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
) -> list[Decoded]:
    """Speculative decoding of every transcript's prompt with the drafter alone: what live decoding keeps, round by
    round, from one drafter forward per round for all unfinished rows (``drafts`` holds the transcripts' features).

    Each round drafts B-1 tokens after the row's anchor (its last kept token), keeps the drafts that equal the
    target's greedy text and then the target's own next token, exactly as a verify forward would. Blocks are
    always full: the last may run past max_new_tokens or a stop token, and the text is cut there while its
    acceptance still counts, so tau measures the drafter and not where the text ends.
    """
    block_size = drafts.block_size
    kept = [1] * len(transcripts)  # the prefill's greedy token is the first kept token
    accepted: list[list[int]] = [[] for _ in transcripts]
    drafted: list[list[int]] = [[] for _ in transcripts]
    while True:
        rows = [
            r
            for r, t in enumerate(transcripts)
            if not answer_finished(t.continuation[: kept[r]], max_new_tokens, stop_token_ids)
        ]
        if not rows:
            break
        anchors = [transcripts[r].prompt_len + kept[r] - 1 for r in rows]
        if any(a + block_size >= len(transcripts[r].tokens) for r, a in zip(rows, anchors)):
            raise ValueError(f"a transcript is shorter than {max_new_tokens} + B - 1 greedy tokens")
        proposed = drafts.propose(rows, [transcripts[r].tokens[a] for r, a in zip(rows, anchors)], anchors)
        for r, anchor, draft in zip(rows, anchors, proposed):
            truth = transcripts[r].tokens[anchor + 1 : anchor + block_size]
            num_accepted = next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t), len(draft))
            accepted[r].append(num_accepted)
            drafted[r].append(len(draft))
            kept[r] += num_accepted + 1  # the accepted drafts and the target's token after them
    return [
        Decoded(cut_answer(t.continuation[: kept[r]], max_new_tokens, stop_token_ids), accepted[r], drafted[r])
        for r, t in enumerate(transcripts)
    ]


def drafts_per_accepted(decoded: Sequence[Decoded], block_size: int) -> float | None:
    """Drafted tokens verified per drafted token accepted, over every verify forward (None: none accepted)."""
    verified = sum(sum(d.drafted) if d.drafted else (block_size - 1) * len(d.accepted) for d in decoded)
    accepted = sum(sum(d.accepted) for d in decoded)
    return verified / accepted if accepted else None


def zlab_acceptance_lengths(decoded: Decoded) -> list[int]:
    """The decoding's steps as z-lab's ``dflash_generate`` counts them (its ``acceptance_lengths``): tokens each verify
    forward added to the output, the accepted drafts and the target's token after them, cut at the stop token and at
    max_new_tokens (``decoded.tokens`` is cut at both). The prefill's token is no step. Our ``accepted`` counts
    the last block whole instead. (dflash_generate also drafts a shorter last block where fewer than B - 1 tokens are
    left, so its last step's drafts may differ from a full block's; every step before it is the same.)"""
    lengths, generated = [], 1
    for num_accepted in decoded.accepted:
        if generated >= len(decoded.tokens):
            break
        produced = min(num_accepted + 1, len(decoded.tokens) - generated)
        lengths.append(produced)
        generated += produced
    return lengths


def zlab_tau(decoded: Sequence[Decoded]) -> float:
    """z-lab's tau: each prompt's mean acceptance length (``zlab_acceptance_lengths``), then the mean over prompts (a
    prompt that ended at its prefill, with no step, is left out; 0.0 when all did)."""
    means = [sum(lengths) / len(lengths) for lengths in map(zlab_acceptance_lengths, decoded) if lengths]
    return sum(means) / len(means) if means else 0.0


def sampling_seed(seed: int, index: int) -> int:
    """The seed of prompt ``index``'s generator in a sampled evaluation seeded with ``seed``."""
    return seed * 1_000_003 + index


# -- simulated acceptance ------------------------------------------------------------------------


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
    if kept.last_hidden is None and loss_config.label_mode != "data":
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


# -- acceptance by context length ----------------------------------------------------------------


def supervised_runs(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of supervised tokens, in order: a chat record's assistant turns."""
    edges = np.diff(np.concatenate([[0], (np.asarray(loss_mask) != 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def turn_documents(document: Document, max_turns: int = 0) -> list[Document]:
    """The document once per assistant turn (``supervised_runs``): the conversation through that turn, supervised on
    that turn alone, so that its prompt (``prompt_of`` at 0) is the conversation before the turn and its decoded span
    (``decoded_span``) that turn's answer. At most ``max_turns`` turns (0: all), spread evenly from the first to the
    last."""
    runs = supervised_runs(document.loss_mask)
    if max_turns and len(runs) > max_turns:
        runs = [runs[i] for i in np.linspace(0, len(runs) - 1, max_turns).round().astype(int).tolist()]
    turns = []
    for start, end in runs:
        loss_mask = np.zeros(end, dtype=document.loss_mask.dtype)
        loss_mask[start:end] = document.loss_mask[start:end]
        turns.append(Document(document.sample_id, document.input_ids[:end], loss_mask))
    return turns


def _tokens_label(count: int) -> str:
    return f"{count // 1024}K" if count and count % 1024 == 0 else str(count)


def bucket_labels(edges: Sequence[int]) -> list[str]:
    """The buckets' names, ``0-2K``, ``2K-8K``, ..., ``32K+`` (``all`` without edges): they name the metrics."""
    if not edges:
        return ["all"]
    bounds = [0, *edges]
    return [f"{_tokens_label(low)}-{_tokens_label(high)}" for low, high in zip(bounds, bounds[1:])] + [
        f"{_tokens_label(edges[-1])}+"
    ]


def bucket_of(context: int, edges: Sequence[int]) -> int:
    """The index of the bucket a context length falls in: [0, edges[0]), [edges[0], edges[1]), ..., [edges[-1], ∞)."""
    return bisect.bisect_right(edges, context)


def timing_contexts(prompt_lengths: Sequence[int], max_new_tokens: int, edges: Sequence[int]) -> dict[int, int]:
    """Per bucket, the context its round costs are timed at: the median of the contexts its prompts' verify forwards
    can have (the positions from each prompt's end to before its ``max_new_tokens``-th token) that fall in it. It does
    not depend on the drafter, so the target's forwards are timed once for every evaluation."""
    positions = np.concatenate([np.arange(n, n + max_new_tokens) for n in prompt_lengths])
    buckets = np.searchsorted(np.asarray(edges, dtype=np.int64), positions, side="right")
    return {int(b): int(np.median(positions[buckets == b])) for b in np.unique(buckets)}


class ForwardTimer:
    """Seconds of work on ``device``: on a GPU the wall clock after the queued kernels are done; on a CPU the calling
    thread's CPU time, which is what a forward costs there whatever else the cores run (the evaluation runs the models
    on one thread, ``Evaluator.evaluation_context``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()


class _CachedProjection(nn.Module):
    """A draft attention's key or value projection whose context rows are projected once, as a server's draft KV cache
    holds them: a call on the context's rows returns them; any other (the block's slots) projects."""

    def __init__(self, projection: nn.Module, context: torch.Tensor) -> None:
        super().__init__()
        self.projection = projection
        self.context_rows = context.shape[0]
        self.projected = projection(context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projected if x.shape[0] == self.context_rows else self.projection(x)


@contextlib.contextmanager
def _context_kv_cached(drafter: Drafter, context: torch.Tensor):
    """The drafter's layers with their context keys and values projected once (``_CachedProjection``); the layers
    as they were afterwards."""
    attentions = [layer.self_attn for layer in drafter.layers]
    originals = [(attention.k_proj, attention.v_proj) for attention in attentions]
    try:
        for attention, (k_proj, v_proj) in zip(attentions, originals):
            attention.k_proj = _CachedProjection(k_proj, context)
            attention.v_proj = _CachedProjection(v_proj, context)
        yield
    finally:
        for attention, (k_proj, v_proj) in zip(attentions, originals):
            attention.k_proj, attention.v_proj = k_proj, v_proj


@torch.no_grad()
def time_draft_round(drafter: Drafter, context: int, repeats: int) -> float:
    """Seconds of the drafter's part of one decoding round at ``context`` tokens of context, as a server runs it (the
    fastest of ``repeats`` timed runs after a warm-up): the newly kept tokens' features fused and their keys and values
    projected (B of them, the most a round keeps), then one forward of the block over the context's cached keys and
    values, and its draft tokens through the target's head. Random features: the cost does not depend on them.

    The evaluator's own decoding (``draft_rows``) projects the whole context again at every round, which a server
    never does; here each layer's context projections are made once beforehand (``_context_kv_cached``). Their
    per-head norm and rotary embedding still run per round: a slight overstatement, linear in the context."""
    config = drafter.config
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    generator = torch.Generator(device=device).manual_seed(0)
    features = torch.randn(
        context + config.block_size, config.fused_feature_size, generator=generator, device=device, dtype=dtype
    )
    fused = drafter.fuse_context(features[:context])
    anchor = torch.zeros(1, dtype=torch.long, device=device)
    position = torch.tensor([context], device=device)
    # A context no longer than a block cannot be told from the block's slots by its rows; projecting it costs nothing.
    cached = _context_kv_cached(drafter, fused) if context > config.block_size else contextlib.nullcontext()
    timer = ForwardTimer(device)
    times = []
    with cached:
        for repeat in range(repeats + 1):
            started = timer.now()
            new = drafter.fuse_context(features[context:])
            for layer in drafter.layers:
                layer.self_attn.k_proj(new)
                layer.self_attn.v_proj(new)
            drafter.propose(
                draft_rows(drafter, [fused], anchor, position), anchor, context=context_rows(drafter, [fused])
            )
            if repeat:
                times.append(timer.now() - started)
    return min(times)


@dataclass
class RoundCosts:
    """What one round of speculative decoding and one step of plain decoding cost at one context length, timed."""

    context: int
    draft_seconds: float
    """The drafter's round (``time_draft_round``)."""
    verify_seconds: float
    """The target's verify forward of one block (``time_target_round``)."""
    decode_seconds: float
    """The target's forward of one token: a step of plain decoding."""

    @property
    def break_even_tau(self) -> float:
        """The tau above which speculation beats plain decoding here: a round costs draft + verify and keeps tau
        tokens, plain decoding costs one decode forward per token, so it pays when tau > (draft + verify) / decode
        (about 1 + draft / decode where verifying a block costs what decoding one token does)."""
        return (self.draft_seconds + self.verify_seconds) / self.decode_seconds


@dataclass
class LengthBucket:
    """Real acceptance of the verify forwards whose context falls in one bucket of context length."""

    label: str
    low: int
    high: int | None
    """Contexts in [low, high); None: no upper bound."""
    prompts: int
    """Prompts with a verify forward here (a prompt whose decoding crosses an edge counts in both buckets)."""
    blocks: int
    """Verify forwards here."""
    tau: float | None
    """As ``AcceptanceReport.tau``, over this bucket's verify forwards (None without any)."""
    zlab_tau: float | None
    """As ``AcceptanceReport.zlab_tau``, over this bucket's steps: per prompt, then over prompts."""
    accept_pos: list[float]
    """As ``AcceptanceReport.accept_pos``, over this bucket's verify forwards (empty without any)."""
    costs: RoundCosts | None = None
    """Timed at this bucket's timing context (None: not timed, eval.timing_repeats = 0)."""

    @property
    def speedup(self) -> float | None:
        """Plain decoding's time over speculative decoding's for the same tokens here: tau / break-even tau."""
        if self.tau is None or self.costs is None:
            return None
        return self.tau / self.costs.break_even_tau

    def as_dict(self) -> dict[str, Any]:
        out = {
            "bucket": self.label,
            "low": self.low,
            "high": self.high,
            "prompts": self.prompts,
            "blocks": self.blocks,
            "tau": self.tau,
            "zlab_tau": self.zlab_tau,
            "accept_pos": self.accept_pos,
        }
        if self.costs is not None:
            out.update(
                context=self.costs.context,
                draft_ms=1e3 * self.costs.draft_seconds,
                verify_ms=1e3 * self.costs.verify_seconds,
                decode_ms=1e3 * self.costs.decode_seconds,
                break_even_tau=self.costs.break_even_tau,
                speedup=self.speedup,
            )
        return out


def streak_figures(accepted: Sequence[int], block_size: int) -> tuple[float | None, list[float]]:
    """(tau, accept_pos) of verify forwards that accepted ``accepted`` drafts each: 1 + their mean, and per slot k the
    fraction whose streak reaches it; (None, []) without any."""
    if not accepted:
        return None, []
    counts = torch.tensor(list(accepted), dtype=torch.float64)
    slots = torch.arange(1, block_size, dtype=torch.float64)
    return 1.0 + float(counts.mean()), (counts[:, None] >= slots[None, :]).double().mean(0).tolist()


def acceptance_by_length(
    decoded: Sequence[Decoded],
    prompt_lengths: Sequence[int],
    edges: Sequence[int],
    block_size: int,
    costs: Mapping[int, RoundCosts] | None = None,
) -> list[LengthBucket]:
    """Every bucket's acceptance (``LengthBucket``): each verify forward counts in the bucket of its context
    (``block_contexts``), so pooling the buckets gives the whole evaluation's tau; ``costs`` per bucket index."""
    labels = bucket_labels(edges)
    accepted: list[list[int]] = [[] for _ in labels]
    prompts: list[set[int]] = [set() for _ in labels]
    zlab_means: list[list[float]] = [[] for _ in labels]
    for i, (one, prompt_len) in enumerate(zip(decoded, prompt_lengths)):
        buckets = [bucket_of(c, edges) for c in block_contexts(prompt_len, one.accepted)]
        for bucket, num_accepted in zip(buckets, one.accepted):
            accepted[bucket].append(num_accepted)
            prompts[bucket].add(i)
        steps: dict[int, list[int]] = {}
        for bucket, length in zip(buckets, zlab_acceptance_lengths(one)):  # step i is verify forward i
            steps.setdefault(bucket, []).append(length)
        for bucket, lengths in steps.items():
            zlab_means[bucket].append(sum(lengths) / len(lengths))
    bounds = [0, *edges]
    out = []
    for b, label in enumerate(labels):
        tau, accept_pos = streak_figures(accepted[b], block_size)
        out.append(
            LengthBucket(
                label=label,
                low=bounds[b],
                high=bounds[b + 1] if b + 1 < len(bounds) else None,
                prompts=len(prompts[b]),
                blocks=len(accepted[b]),
                tau=tau,
                zlab_tau=sum(zlab_means[b]) / len(zlab_means[b]) if zlab_means[b] else None,
                accept_pos=accept_pos,
                costs=(costs or {}).get(b),
            )
        )
    return out


# -- the report ----------------------------------------------------------------------------------


def _cell(value: float | None, width: int, spec: str) -> str:
    """A table cell: the value in ``spec``, or a dash where there is none."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


@dataclass
class AcceptanceReport:
    """Real and simulated acceptance of one drafter on a set of held-out prompts."""

    block_size: int
    num_prompts: int
    tau: float
    """Mean tokens kept per verify forward, the correction token included (1 .. B), pooled over every prompt's verify
    forwards, the last block counted whole (as vLLM counts its acceptance length)."""
    accept_pos: list[float]
    """k = 1..B-1: fraction of verify forwards whose accepted streak reaches slot k (tau = 1 + their sum)."""
    sim_tau: float
    """The training metric (teacher-forced tau) on the same held-out documents, each cut to what decoding its prompt
    produces: the prompt and ``max_new_tokens`` tokens."""
    sim_acc: list[float]
    """Teacher-forced per-slot accuracy acc_k, k = 1..B-1."""
    sim_tau_greedy: float | None
    """The training metric on the text the decoding produced (the target's greedy text of the same prompts), at
    every anchor: beside ``sim_tau``, how far the documents are from the target's own text."""
    sim_tau_walk: float | None
    """The training metric on that text at the anchors the decoding started its blocks at: the training forward
    where the server ran its own, so it equals ``tau`` unless the two differ (masks, positions, features). Beside
    ``sim_tau_greedy``, what those anchors cost: a block starts after each rejection, where the text is harder
    than on average. None for a sampled evaluation (as ``sim_tau_greedy``): its text is not the greedy text."""
    generated_tokens: int
    target_forwards: int
    """Prefills plus verify forwards: what live decoding runs for this text and these acceptances."""
    seconds: float
    reference_seconds: float = 0.0
    """Of ``seconds``: making the target's reference (greedy continuations and features by target forwards);
    0 when an earlier evaluation made it."""
    decode_seconds: float = 0.0
    """Of ``seconds``: decoding the prompts. The rest, past the reference, is the simulated acceptance."""
    zlab_tau: float = 0.0
    """tau as z-lab's benchmark gives it from ``dflash_generate``'s acceptance lengths: tokens each verify forward
    added to the output, cut at the stop token and at max_new_tokens, averaged per prompt and then over prompts
    (``zlab_tau``). Below ``tau`` where last blocks are cut, and it weighs short answers as much as long ones."""
    sampling: Sampling = field(default_factory=Sampling)
    """How the target's tokens were chosen (temperature 0: greedy)."""
    seed: int = 0
    """The sampled decoding's seed (``eval.seed``)."""
    by_length: list[LengthBucket] = field(default_factory=list)
    """The same acceptance per bucket of context length (``eval.length_buckets``), with each bucket's timed costs
    and break-even tau."""
    num_records: int = 0
    """Held-out records the prompts come from (with ``eval.every_turn``, one prompt per assistant turn)."""
    skipped_records: list[str] = field(default_factory=list)
    """``file:line reason`` of each held-out record left out (bad, or turns that do not alternate)."""
    timing_seconds: float = 0.0
    """Of ``seconds``: timing the forwards for the break-even tau (the target's only at the first evaluation)."""
    confidence_min: float = 0.0
    """``eval.confidence_min``: a confidence head's cut of each block (0: none)."""
    drafts_per_accepted: float | None = None
    """Drafted tokens the target verified per drafted token it accepted (1: no draft verified in vain)."""
    uncut_tau: float | None = None
    """With a confidence cut: ``tau`` of the same decoding without it."""
    uncut_drafts_per_accepted: float | None = None
    """With a confidence cut: ``drafts_per_accepted`` of the same decoding without it."""

    @property
    def tau_gap(self) -> float:
        """Real minus simulated tau."""
        return self.tau - self.sim_tau

    def gap_within(self, tolerance: float) -> bool:
        """Whether |real - simulated tau| is at most ``tolerance`` of the most a block can gain (B - 1)."""
        return abs(self.tau_gap) <= tolerance * (self.block_size - 1)

    @property
    def greedy_forwards(self) -> int:
        """Target forwards plain greedy decoding needs for the same text: one per generated token."""
        return self.generated_tokens

    @property
    def forwards_saved(self) -> float:
        """Fraction of the plain-greedy target forwards that speculative decoding saved."""
        return 1.0 - self.target_forwards / max(self.greedy_forwards, 1)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """The figures by name; a sampled evaluation's adds its sampling settings and has no ``sim_tau_greedy`` nor
        ``sim_tau_walk``."""
        out = {
            "tau": self.tau,
            "zlab_tau": self.zlab_tau,
            "sim_tau": self.sim_tau,
            "tau_gap": self.tau_gap,
            "sim_tau_greedy": self.sim_tau_greedy,
            "sim_tau_walk": self.sim_tau_walk,
            "forwards_saved": self.forwards_saved,
            "target_forwards": self.target_forwards,
            "greedy_forwards": self.greedy_forwards,
            "generated_tokens": self.generated_tokens,
            "num_prompts": self.num_prompts,
            "seconds": self.seconds,
            "reference_seconds": self.reference_seconds,
            "decode_seconds": self.decode_seconds,
            "timing_seconds": self.timing_seconds,
            "num_records": self.num_records,
            "skipped_records": len(self.skipped_records),
            "drafts_per_accepted": self.drafts_per_accepted,
        }
        if self.confidence_min > 0:
            out.update(
                confidence_min=self.confidence_min,
                uncut_tau=self.uncut_tau,
                uncut_drafts_per_accepted=self.uncut_drafts_per_accepted,
            )
        out = {key: value for key, value in out.items() if value is not None}
        if not self.sampling.greedy:
            out.update(
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                seed=self.seed,
            )
        out.update({f"accept_pos_{k}": p for k, p in enumerate(self.accept_pos, start=1)})
        out.update({f"sim_acc_{k}": a for k, a in enumerate(self.sim_acc, start=1)})
        for bucket in self.by_length:
            if not bucket.blocks:
                continue  # no point rather than a made-up one: the bucket's curve has a gap
            figures = bucket.as_dict()
            for name in ("bucket", "low", "high", "accept_pos"):  # in the names, or a series of their own below
                figures.pop(name)
            out.update({f"{name}_by_length/{bucket.label}": v for name, v in figures.items() if v is not None})
            out.update(
                {f"accept_pos_by_length/{bucket.label}/{k}": p for k, p in enumerate(bucket.accept_pos, start=1)}
            )
        return {prefix + key: value for key, value in out.items()}

    def by_length_table(self, positions: int = 4) -> str:
        """The acceptance per bucket of context length beside the break-even tau there, as ``launch.evaluate
        --by-length`` prints it (the first ``positions`` slots' acceptance)."""
        shown = min(positions, self.block_size - 1)
        slots = " ".join(f"{f'k={k}':>5}" for k in range(1, shown + 1))
        lines = [
            "acceptance by context length (a verify forward counts at its context: the prompt and the tokens generated "
            "before its block)",
            f"{'bucket':<10} {'prompts':>7} {'blocks':>7} {'tau':>6} {'zlab':>6}  {slots}  {'context':>8} "
            f"{'draft ms':>9} {'verify ms':>9} {'decode ms':>9} {'break-even':>10} {'speedup':>7}",
        ]
        for bucket in self.by_length:
            costs = bucket.costs
            cells = [
                f"{bucket.label:<10}",
                f"{bucket.prompts:>7}",
                f"{bucket.blocks:>7}",
                _cell(bucket.tau, 6, ".3f"),
                _cell(bucket.zlab_tau, 6, ".3f"),
                " " + " ".join(_cell(p, 5, ".3f") for p in (bucket.accept_pos or [None] * shown)[:shown]),
                " " + _cell(costs and costs.context, 8, "d"),
                _cell(costs and 1e3 * costs.draft_seconds, 9, ".3f"),
                _cell(costs and 1e3 * costs.verify_seconds, 9, ".3f"),
                _cell(costs and 1e3 * costs.decode_seconds, 9, ".3f"),
                _cell(costs and costs.break_even_tau, 10, ".3f"),
                _cell(bucket.speedup, 6, ".2f") + ("x" if bucket.speedup is not None else " "),
            ]
            row = " ".join(cells)
            lines.append(row)
        lines.append(
            "break-even: (draft + verify) / decode, timed at the bucket's context (batch of one prompt); speculation "
            "pays where tau exceeds it, and speedup = tau / break-even"
        )
        if self.skipped_records:
            lines.append(
                f"{len(self.skipped_records)} held-out records skipped: "
                + "; ".join(self.skipped_records[:3])
                + (" ..." if len(self.skipped_records) > 3 else "")
            )
        return "\n".join(lines)

    def table(self) -> str:
        sampling = self.sampling
        how = (
            "greedy"
            if sampling.greedy
            else f"sampled at temperature {sampling.temperature:g}, top_p "
            f"{sampling.top_p:g}, top_k {sampling.top_k}, seed {self.seed}"
        )
        prompts = f"{self.num_prompts} prompts"
        if self.num_records and self.num_records != self.num_prompts:
            prompts += f" (assistant turns of {self.num_records} records)"
        lines = [
            f"{prompts}, {self.generated_tokens} tokens generated, block size {self.block_size}, {how}",
            f"tau (real)       {self.tau:6.3f}   mean tokens per target verify forward (max {self.block_size}), "
            "pooled, last blocks whole",
            f"tau (z-lab)      {self.zlab_tau:6.3f}   tokens added per step, cut at the stop token and max_new_tokens, "
            "mean per prompt, then over prompts",
            f"tau (simulated)  {self.sim_tau:6.3f}   teacher-forced on the same documents; gap {self.tau_gap:+.3f}",
        ]
        if self.sim_tau_greedy is not None and self.sim_tau_walk is not None:
            lines += [
                f"  on the target's text       {self.sim_tau_greedy:6.3f}   teacher-forced on what the decoding produced "
                f"(documents {self.sim_tau - self.sim_tau_greedy:+.3f} from it)",
                f"  at the decoding's anchors  {self.sim_tau_walk:6.3f}   the blocks the decoding ran, in the training "
                f"forward (anchors {self.sim_tau_walk - self.sim_tau_greedy:+.3f}, serving {self.tau - self.sim_tau_walk:+.3f})",
            ]
        if self.confidence_min > 0 and self.uncut_tau is not None:
            lines.append(
                f"confidence cut   {self.confidence_min:6.3f}   tau {self.tau:.3f} against {self.uncut_tau:.3f} without it; "
                f"drafts verified per accepted {_cell(self.drafts_per_accepted, 5, '.3f').strip()} against "
                f"{_cell(self.uncut_drafts_per_accepted, 5, '.3f').strip()}"
            )
        lines += [
            f"target forwards  {self.target_forwards:6d}   vs {self.greedy_forwards} for plain "
            f"{'greedy' if sampling.greedy else 'sampled'} decoding: {self.forwards_saved:.1%} saved",
        ]
        lines += ["slot k    accepted (real, streak reaches k)    acc_k (simulated)"]
        lines += [
            f"{k:6d}    {p:10.3f}                           {a:10.3f}"
            for k, (p, a) in enumerate(zip(self.accept_pos, self.sim_acc), start=1)
        ]
        return "\n".join(lines)


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


def decoding_anchors(transcript: Transcript, decoded: Decoded) -> list[int]:
    """The positions the decoding started its blocks at: the prefill's token, then each round's anchor after the
    kept drafts and the target's token."""
    return block_contexts(transcript.prompt_len, decoded.accepted)


def block_contexts(prompt_len: int, accepted: Sequence[int]) -> list[int]:
    """Per verify forward of a prompt's decoding, its context: the tokens before its block's anchor (the prompt and
    the tokens generated before the anchor), which is also the anchor's position."""
    contexts, context = [], prompt_len
    for num_accepted in accepted:
        contexts.append(context)
        context += num_accepted + 1
    return contexts


def prompt_of(document: Document, prompt_len: int) -> torch.Tensor:
    """The document's first ``prompt_len`` tokens, or with 0 those before its first supervised token."""
    if prompt_len == 0:
        supervised = document.loss_mask.nonzero()[0]
        prompt_len = int(supervised[0]) if supervised.size else len(document)
    return torch.as_tensor(document.input_ids[:prompt_len], dtype=torch.long)


# -- from a loaded target ------------------------------------------------------------------------


def by_length_summary(metrics: Mapping[str, float]) -> str:
    """The tau of each context-length bucket in an evaluation's ``metrics`` (``AcceptanceReport.metrics()``), with its
    break-even tau where timed, in one line for a log; empty without them."""
    parts = []
    for key, tau in metrics.items():
        if key.startswith("eval/tau_by_length/"):
            bucket = key.removeprefix("eval/tau_by_length/")
            break_even = metrics.get(f"eval/break_even_tau_by_length/{bucket}")
            parts.append(f"{bucket} {tau:.3f}" + (f" (break-even {break_even:.3f})" if break_even is not None else ""))
    return ", ".join(parts)


def warn_if_gap(metrics: Mapping[str, float], block_size: int, tolerance: float) -> None:
    """The warning of a real tau far from the simulated one (more than ``tolerance`` of B - 1) in an evaluation's
    ``metrics`` (``AcceptanceReport.metrics()``), with the three steps the gap is made of."""
    gap = metrics.get("eval/tau_gap", 0.0)
    if abs(gap) <= tolerance * (block_size - 1):
        return
    if "eval/sim_tau_walk" not in metrics:
        log.warning(
            "real and simulated tau differ by more than eval.gap_tolerance (%.2f of B - 1): check the "
            "target layer ids, the rope settings, the loss mask and whether the data is the target's "
            "own text",
            tolerance,
        )
        return
    greedy, walk = metrics["eval/sim_tau_greedy"], metrics["eval/sim_tau_walk"]
    log.warning(
        "real and simulated tau differ by more than eval.gap_tolerance (%.2f of B - 1): %+.3f in all, of it "
        "%+.3f the documents against the target's own text (data it did not write), %+.3f the anchors decoding "
        "starts its blocks at (after each rejection), %+.3f serving against training (not about 0: check the "
        "target layer ids, the rope settings and the masks)",
        tolerance,
        gap,
        greedy - metrics["eval/sim_tau"],
        walk - greedy,
        metrics["eval/tau"] - walk,
    )

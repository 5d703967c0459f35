"""The drafter's side of speculative decoding, as a server runs it: its proposals over the kept tokens' features
(``DraftContext`` for one prompt; ``DraftRows`` for several, one drafter forward for all: ``draft_rows``), and the
live decoding loop against the target (``speculative_decode``, greedy or sampled; ``greedy_decode``, plain decoding,
is the text it must equal).

A server decodes a prompt in rounds: the drafter fills the block ``[last kept token, MASK x (B-1)]`` from the
features (outputs of the captured target layers) of every kept token before it; the target verifies the block
in one forward and keeps the drafted tokens that equal its own greedy tokens, plus its token after them (the
correction, or a bonus when all B-1 were right); the kept tokens' features from that forward extend the
drafter's context. Rejected tokens never enter it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.acceptance.arithmetic import Decoded, answer_finished, cut_answer
from common.drafter.base import Drafter
from common.drafter.masks import in_block_mask
from common.drafter.sampling import Proposal, Sampling, rejection_sample, sample_from, sampling_probs
from producer.target_model.greedy import GreedyTarget, left_padded


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
        return proposals([self], [token], [position], sampling, [generator])[0]


def proposals(
    contexts: Sequence[DraftContext],
    tokens: Sequence[int],
    positions: Sequence[int],
    sampling: Sampling | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[Proposal]:
    """``DraftContext.proposal`` of several prompts' blocks (one drafter): one drafter forward for all of them
    (``draft_rows``), then each row's kind proposal on its own, drawing from its own generator, so that a row draws
    what it draws alone."""
    drafter, device = contexts[0].drafter, contexts[0].ctx.device
    ctxs = [c.ctx for c in contexts]
    anchors = torch.tensor(list(tokens), device=device)
    hidden = draft_rows(drafter, ctxs, anchors, torch.tensor(list(positions), device=device))
    rows = context_rows(drafter, ctxs)
    made = []
    for i, context in enumerate(contexts):
        row = slice(i, i + 1)
        generator = generators[i] if generators is not None else None
        proposal = drafter.propose(hidden[row], anchors[row], sampling, generator, None if rows is None else rows[row])
        made.append(proposal.first(int(proposal.kept_drafts(context.confidence_min)[0])))
    return made


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
    rope = drafter.rope(block_positions, context_positions, ctx.dtype)
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
        x = layer(x, ctx, rope, masks[layer.layer_type])
    return drafter.norm(x).view(num_rows, block_size, -1)


@torch.no_grad()
def speculative_decode(
    context: DraftContext,
    target: GreedyTarget,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Live greedy speculative decoding of ``prompt`` ``[P]`` with a fresh drafter ``context``, as a server runs it
    (one prompt; the reference ``replay_rows`` must equal): the target's greedy text, and what was accepted.
    With ``sampling`` at a temperature above 0, sampled speculative decoding instead (``generator`` draws every
    token): the prefill's token is drawn from the target, the drafter's kind draws the block from its proposal q,
    and ``rejection_sample`` verifies it against the target's distribution p of the same forward, so the text is
    distributed as the target's own sampling.

      1. the target prefills the prompt into its KV cache: the first new token, and the features of every
         prompt token;
      2. the drafter fills the block from the features of every kept token before it;
      3. the target verifies the block in one forward;
      4. the KV cache is cropped to the kept tokens, and the drafter's context is extended with the kept
         tokens' features from that same forward. Back to 2.
    A hybrid target's Gated-DeltaNet layers hold a recurrent state and a convolution window that cannot be
    cropped: their state before the block is kept, and when a draft token was rejected it is put back and the
    kept tokens are run again (``Decoded.replayed``).
    """
    first, features = _prefill(target, prompt, sampling, generator)
    context.extend(features)
    tokens, accepted, drafted_counts, replayed = [first], [], [], []
    while not answer_finished(tokens, max_new_tokens, stop_token_ids):
        anchor = prompt.shape[0] + len(tokens) - 1  # position of the last kept token
        verified = _verify_block(context, target, tokens[-1], anchor, sampling, generator)
        accepted.append(verified.num_accepted)
        drafted_counts.append(int(verified.drafted.shape[0]))
        tokens += verified.drafted[: verified.num_accepted].tolist() + [verified.next_token]
        kept = verified.num_accepted + 1  # the anchor and the accepted drafts; the correction is the next anchor
        features, ran_again = _keep(target, verified, anchor, kept)
        if ran_again:
            replayed.append(kept)
        context.extend(features)
    return Decoded(cut_answer(tokens, max_new_tokens, stop_token_ids), accepted, drafted_counts, replayed)


@torch.no_grad()
def speculative_decode_rows(
    contexts: Sequence[DraftContext],
    target: GreedyTarget,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
    sampling: Sampling | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
) -> list[Decoded]:
    """``speculative_decode`` of several prompts at once, each with its fresh ``contexts[i]`` and its own
    ``generators[i]``: each round one drafter forward drafts every unfinished prompt's block and one target forward
    verifies them all, as a server batches its requests. Each prompt keeps exactly what it keeps alone: its draws
    come from its own generator in the same order, and its rows of the forwards are what its own forwards give
    (up to the rounding of a larger product).

    The prompts are rows of one cache (``GreedyTarget.forward_rows``; so ``target.batchable``). Every round appends
    a block of slots to every row; a row's rejected drafts and padding stay in it as holes no later query sees: one
    cache of several rows is cropped for all of them, past the most any row kept."""
    if not target.batchable:
        raise ValueError("decoding prompts together needs a target without Gated-DeltaNet or sliding-window layers")
    rows, block_size = len(prompts), contexts[0].block_size
    draws = list(generators) if generators is not None else [None] * rows
    lengths = [int(p.numel()) for p in prompts]
    tokens, kv_valid = _prefill_rows(contexts, target, prompts, sampling, draws)
    decoded = [Decoded(row, []) for row in tokens]  # each row's tokens, accepted and drafted counts, as they grow
    live = [r for r in range(rows) if not answer_finished(tokens[r], max_new_tokens, stop_token_ids)]
    while live:
        anchors = [lengths[r] + len(tokens[r]) - 1 for r in live]  # the positions of the last kept tokens
        made = proposals(
            [contexts[r] for r in live], [tokens[r][-1] for r in live], anchors, sampling, [draws[r] for r in live]
        )
        block_ids, block_positions, block_valid = _round_blocks(rows, block_size, live, tokens, anchors, made)
        kv_valid = torch.cat([kv_valid, block_valid], dim=1)
        logits, features = target.forward_rows_logits(block_ids, block_positions, kv_valid)
        at = block_ids.new_tensor(live)
        # the target's distributions (sampled) or tokens (greedy) after each slot of the live rows, all at once
        verdicts = sampling_probs(logits[at], sampling) if _sampled(sampling) else logits[at].argmax(-1)
        start, longest = kv_valid.shape[1] - block_size, 0
        for i, (r, proposal) in enumerate(zip(live, made)):
            drafted = proposal.tokens[0]
            num_accepted, after = _verdict(proposal, verdicts[i, : drafted.shape[0] + 1], sampling, draws[r])
            kept = num_accepted + 1  # the anchor and the accepted drafts; the token after them is the next anchor
            kv_valid[r, start + kept :] = False
            longest = max(longest, kept)
            contexts[r].extend(features[r, :kept])
            decoded[r].accepted.append(num_accepted)
            decoded[r].drafted.append(int(drafted.shape[0]))
            tokens[r] += drafted[:num_accepted].tolist() + [after]
        # the block's last slots that no row kept leave the cache
        target.crop(start + longest)
        kv_valid = kv_valid[:, : start + longest]
        live = [r for r in live if not answer_finished(tokens[r], max_new_tokens, stop_token_ids)]
    return [Decoded(cut_answer(d.tokens, max_new_tokens, stop_token_ids), d.accepted, d.drafted) for d in decoded]


def _verdict(
    proposal: Proposal, verdict: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None
) -> tuple[int, int]:
    """(drafts kept, the token after them) of one row's block from the target's ``verdict`` after each of its
    slots: its sampling distributions (``_sampled_verdict``) or its greedy tokens (``_greedy_verdict``)."""
    if _sampled(sampling):
        return _sampled_verdict(proposal, verdict, generator)
    return _greedy_verdict(proposal.tokens[0], verdict)


def _prefill_rows(
    contexts: Sequence[DraftContext],
    target: GreedyTarget,
    prompts: Sequence[torch.Tensor],
    sampling: Sampling | None,
    draws: Sequence[torch.Generator | None],
) -> tuple[list[list[int]], torch.Tensor]:
    """The prompts prefilled as left-padded rows of a fresh cache: each row's first token (``_first_token``, from its
    own generator) and its features in its context; the rows' tokens and which cache slots are real."""
    ids, positions, kv_valid = left_padded(prompts, target.device)
    target.reset()
    logits, features = target.forward_rows_logits(ids, positions, kv_valid, last_logits_only=True)
    tokens = []
    for r, (context, prompt) in enumerate(zip(contexts, prompts)):
        tokens.append([_first_token(logits[r, -1], sampling, draws[r])])
        context.extend(features[r, ids.shape[1] - prompt.numel() :])
    return tokens, kv_valid


def _round_blocks(
    rows: int,
    block_size: int,
    live: Sequence[int],
    tokens: Sequence[list[int]],
    anchors: Sequence[int],
    made: Sequence[Proposal],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A round's blocks as rows of one forward ``[rows, block_size]`` each: (token ids, positions, which slots are
    real). Live row r's block is its last kept token at its anchor, then its drafts; the rest of its row and a
    finished row's are padding."""
    device = made[0].tokens.device
    widths = [int(proposal.tokens.shape[1]) for proposal in made]
    drafts = torch.cat([F.pad(proposal.tokens, (0, block_size - 1 - w)) for proposal, w in zip(made, widths)])
    at, slots = torch.tensor(list(live), device=device), torch.arange(block_size, device=device)
    block_ids = torch.zeros(rows, block_size, dtype=torch.long, device=device)
    block_ids[at] = torch.cat([torch.tensor([tokens[r][-1] for r in live], device=device)[:, None], drafts], 1)
    block_positions = torch.zeros_like(block_ids)
    block_positions[at] = torch.tensor(list(anchors), device=device)[:, None] + slots
    block_valid = torch.zeros_like(block_ids, dtype=torch.bool)
    block_valid[at] = slots <= torch.tensor(widths, device=device)[:, None]
    return block_ids, block_positions, block_valid


def _first_token(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None) -> int:
    """The prefill's token from the target's logits ``[V]`` after the prompt: drawn when sampled, else greedy."""
    if _sampled(sampling):
        return int(sample_from(sampling_probs(logits, sampling), generator))
    return int(logits.argmax())


def _sampled(sampling: Sampling | None) -> bool:
    return sampling is not None and not sampling.greedy


def _prefill(
    target: GreedyTarget, prompt: torch.Tensor, sampling: Sampling | None, generator: torch.Generator | None
) -> tuple[int, torch.Tensor]:
    """A fresh target's prefill of ``prompt``: its first new token (drawn from its distribution when sampled, else
    its greedy token) and the features of every prompt token."""
    target.reset()
    if _sampled(sampling):
        logits, features = target.forward_logits(prompt, 0)
        return _first_token(logits[-1], sampling, generator), features
    greedy, features = target.forward(prompt, 0)
    return int(greedy[-1]), features


@dataclass
class VerifiedBlock:
    """One round's block as the target verified it."""

    drafted: torch.Tensor
    """The drafter's tokens ``[D]`` after the anchor."""
    block: torch.Tensor
    """The anchor and the drafts, ``[D + 1]``: what the target ran."""
    num_accepted: int
    """How many drafts the target kept."""
    next_token: int
    """The target's token after the kept drafts (the correction, or a bonus when it kept them all)."""
    features: torch.Tensor
    """The features of every token of ``block`` from the verifying forward."""


def _verify_block(
    context: DraftContext,
    target: GreedyTarget,
    last: int,
    anchor: int,
    sampling: Sampling | None,
    generator: torch.Generator | None,
) -> VerifiedBlock:
    """Draft the block anchored at the last kept token ``last`` (at ``anchor``) and verify it in one target forward:
    greedy, the drafts that equal the target's own tokens are kept; sampled, ``rejection_sample`` keeps them against
    the target's distribution. The target's state before the block is saved first (a hybrid target's recurrent
    state cannot be cropped)."""
    if _sampled(sampling):
        proposal = context.proposal(last, anchor, sampling, generator)
        drafted = proposal.tokens[0]
        block = torch.cat([drafted.new_tensor([last]), drafted])
        target.save_state()
        logits, features = target.forward_logits(block, anchor)
        verdict = _sampled_verdict(proposal, sampling_probs(logits, sampling), generator)
        return VerifiedBlock(drafted, block, *verdict, features)
    drafted = context.propose(last, anchor)
    block = torch.cat([drafted.new_tensor([last]), drafted])
    target.save_state()
    verified, features = target.forward(block, anchor)  # verified[i]: the target's token after block[:i + 1]
    return VerifiedBlock(drafted, block, *_greedy_verdict(drafted, verified), features)


def _sampled_verdict(
    proposal: Proposal, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """(drafts kept, the token after them) of one sampled block: ``rejection_sample`` of the proposal's drafts
    against the target's sampling distribution ``target_probs`` ``[D + 1, V]`` from the verifying forward."""
    draft_probs = proposal.dense(target_probs.shape[-1]).probs
    kept_drafts, after = rejection_sample(proposal.tokens, target_probs[None], draft_probs, generator)
    return int(kept_drafts[0]), int(after[0])


def _greedy_verdict(drafted: torch.Tensor, verified: torch.Tensor) -> tuple[int, int]:
    """(drafts kept, the token after them) of one greedy block: the drafts equal to the target's greedy tokens
    ``verified`` ``[D + 1]`` (``verified[i]``: its token after the block's first i + 1), and its token after them."""
    num_accepted = int((drafted == verified[:-1]).long().cumprod(0).sum())
    return num_accepted, int(verified[num_accepted])


def _keep(target: GreedyTarget, verified: VerifiedBlock, anchor: int, kept: int) -> tuple[torch.Tensor, bool]:
    """Leave the target's cache at the ``kept`` first tokens of the verified block: their features, and whether they
    were run again."""
    if target.recurrent and kept < verified.block.shape[0]:
        # The state ran over rejected tokens and cannot be cropped: back to before the block, run the kept again.
        target.restore_state()
        target.crop(anchor)
        _, features = target.forward(verified.block[:kept], anchor, logits=False)
        return features, True
    target.crop(anchor + kept)
    return verified.features[:kept], False


@torch.no_grad()
def greedy_decode(
    target: GreedyTarget, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset()
) -> list[int]:
    """Plain greedy decoding, one target forward per token: the reference speculative decoding must equal."""
    target.reset()
    greedy, _ = target.forward(prompt, 0)
    tokens = [int(greedy[-1])]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
        greedy, _ = target.forward(greedy[-1:], prompt.shape[0] + len(tokens) - 1)
        tokens.append(int(greedy[-1]))
    return tokens

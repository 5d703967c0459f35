"""The acceptance arithmetic: what a speculative decoding keeps, counted as the reports count it, over token lists.
The drafter and the target run on the producer's side (producer/acceptance/); a replay asks the drafter for its
drafts through ``RowProposer``, and counts.

Replay (``replay_rows``): every kept token is the target's greedy choice after the kept prefix (that is what makes
the decoding lossless), so the text is the target's greedy text whatever is drafted, and a decoding is the target's
greedy ``Transcript`` of the prompt walked with the drafter's proposals: every round drafts from the kept tokens, the
target's greedy text decides how many drafts are kept, and the next round starts after them and the target's token.

tau is the mean number of tokens kept per verify forward, correction included (1 <= tau <= B), pooled over every
verify forward, the last block counted whole (``streak_figures``); ``zlab_tau`` beside it counts as z-lab's
``dflash_generate`` does (tokens added per step, cut at the stop token and max_new_tokens, mean per prompt, then over
prompts).

By context length: each verify forward counts in the bucket of ``eval.length_buckets`` its context falls in (the
prompt and the tokens generated before its block: ``block_contexts``), and per bucket a round's timed costs give the
tau above which speculation pays there (``RoundCosts.break_even_tau``; docs/evaluation.md derives it).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


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


def reference_length(max_new_tokens: int, block_size: int) -> int:
    """Greedy tokens a replay may read: a round starts below ``max_new_tokens`` and reads up to B past its anchor."""
    return max_new_tokens + block_size - 1


def cut_answer(tokens: list[int], max_new_tokens: int, stop_token_ids: frozenset[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1]
    return tokens


def answer_finished(generated: Sequence[int], max_new_tokens: int, stop_token_ids: frozenset[int]) -> bool:
    """A server stops once ``max_new_tokens`` are kept or a stop token is among them."""
    return len(generated) >= max_new_tokens or not stop_token_ids.isdisjoint(generated)


class RowProposer(Protocol):
    """The drafter as a replay asks it (producer/acceptance/decoder.py's ``DraftRows``): greedy drafts of one block
    per row, ``[len(rows)][B - 1]`` (fewer where a confidence cut them), anchored at ``tokens`` at ``positions``."""

    block_size: int

    def propose(self, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int]) -> list[list[int]]: ...


@torch.no_grad()
def replay_rows(
    drafts: RowProposer,
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


def streak_figures(accepted: Sequence[int], block_size: int) -> tuple[float | None, list[float]]:
    """(tau, accept_pos) of verify forwards that accepted ``accepted`` drafts each: 1 + their mean, and per slot k the
    fraction whose streak reaches it; (None, []) without any."""
    if not accepted:
        return None, []
    counts = torch.tensor(list(accepted), dtype=torch.float64)
    slots = torch.arange(1, block_size, dtype=torch.float64)
    return 1.0 + float(counts.mean()), (counts[:, None] >= slots[None, :]).double().mean(0).tolist()


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

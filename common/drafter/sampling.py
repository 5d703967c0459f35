"""Sampling settings and what a drafter proposes: the tokens, and at temperature > 0 the distribution they were
drawn from, which lossless rejection sampling needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the target's tokens are chosen (the server's sampling parameters); temperature 0 is greedy."""

    temperature: float = 0.0
    """0: greedy; > 0: logits divided by it before the softmax."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of most likely tokens whose mass reaches top_p (1: all)."""
    top_k: int = 0
    """Keep the top_k most likely tokens (0: all)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 probabilities over the last dimension after temperature, top-k and top-p (a server's sampler)."""
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # A token is kept while the mass before it is below top_p: the most likely token always is.
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < sampling.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class Proposal:
    """The drafted tokens of R blocks, slots 1..B-1."""

    tokens: torch.Tensor
    """[R, B-1] int64."""
    probs: torch.Tensor | None = None
    """Sampled only: [R, B-1, V] the distribution each token was drawn from, or [R, B-1, K] over ``candidates``."""
    candidates: torch.Tensor | None = None
    """[R, B-1, K] int64 when ``probs`` is over a candidate set (a DFlash 2 selector), else None."""
    confidence: torch.Tensor | None = None
    """[R, B-1] fp32 from a drafter with a confidence head: the probability that each token is accepted given that
    the earlier ones are (what a server cuts a block short by, ``eval.confidence_min``), else None."""

    def kept_drafts(self, confidence_min: float) -> torch.Tensor:
        """[R] drafts a server verifies of each row: those before the first whose confidence is below
        ``confidence_min``, as llama.cpp cuts a block by its drafts' confidences (``--spec-draft-p-min``: each slot's own confidence, not
        their product); every draft without a confidence head or at 0."""
        rows, slots = self.tokens.shape
        if self.confidence is None or confidence_min <= 0:
            return torch.full((rows,), slots, dtype=torch.long, device=self.tokens.device)
        return (self.confidence >= confidence_min).long().cumprod(1).sum(1)

    def first(self, count: int) -> Proposal:
        """The proposal of the first ``count`` drafts of each row."""
        cut = slice(0, count)
        return Proposal(
            tokens=self.tokens[:, cut],
            probs=None if self.probs is None else self.probs[:, cut],
            candidates=None if self.candidates is None else self.candidates[:, cut],
            confidence=None if self.confidence is None else self.confidence[:, cut],
        )

    def dense(self, vocab_size: int) -> Proposal:
        """The same proposal with ``probs`` over the whole vocabulary (a candidate set scattered into it)."""
        if self.probs is None or self.candidates is None:
            return self
        dense = torch.zeros(*self.probs.shape[:-1], vocab_size, dtype=self.probs.dtype, device=self.probs.device)
        dense.scatter_add_(-1, self.candidates, self.probs)
        return Proposal(tokens=self.tokens, probs=dense)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` ``[..., V]`` (int64 ``[...]``)."""
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])


def rejection_sample(
    drafted: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless verification of R sampled blocks: (accepted drafts ``[R]`` in 0..n, the target's token after them
    ``[R]``), whose text is distributed exactly as sampling the target token by token.

    ``drafted`` ``[R, n]`` are the draft tokens, drawn from ``draft_probs`` ``[R, n, V]`` (dense over the vocabulary:
    ``Proposal.dense``); ``target_probs`` ``[R, n + 1, V]`` the target's sampling distribution after the block's given
    token and after each draft. Draft k is kept with probability min(1, p_k(x) / q_k(x)) while every draft before it
    was; at the first rejection the token comes from the residual max(0, p_k - q_k) normalised, and after n kept
    drafts the bonus from p_n (the residual with q = 0)."""
    rows, n = drafted.shape
    p_drafted = target_probs[:, :n].gather(-1, drafted[..., None]).squeeze(-1)
    q_drafted = draft_probs.gather(-1, drafted[..., None]).squeeze(-1)
    uniform = torch.rand(rows, n, generator=generator, device=drafted.device, dtype=p_drafted.dtype)
    kept = uniform * q_drafted < p_drafted  # u < p / q without dividing (q > 0 for a drawn token)
    accepted = kept.long().cumprod(1).sum(1)
    at = torch.arange(rows, device=drafted.device)
    p = target_probs[at, accepted]
    q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[at, accepted]
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    # All mass cancelled (p = q up to rounding, where no rejection can happen): p itself.
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p)
    return accepted, sample_from(residual, generator)

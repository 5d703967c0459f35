"""Batched generation with the target, what a request and its result are: ``GenerationConfig``, ``Request``,
``Finished``, the counters, and the sampler every engine draws next tokens with.

A producer that writes its own training data has the target answer prompts, or (Magpie) has the target
write the user's message itself from its chat template's user prefix and then answer it: the second turn
is a follow-up request that ``on_finish`` returns when the question is done (producer/target_model/generator.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

STATIC_CACHE_ENGINE = "static-cache"
TRANSFORMERS_ENGINE = "transformers-generate"


@dataclass
class GenerationConfig:
    """How the target generates: sampling, stopping, and the static batch it runs in."""

    max_new_tokens: int = 256
    """New tokens per request unless the request sets its own."""
    temperature: float = 0.0
    """0 is greedy (argmax); above 0 the logits are divided by it and sampled."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p."""
    seed: int = 0
    """Seeds the sampling generator: the same requests in the same order give the same outputs."""
    stop_token_ids: tuple[int, ...] = ()
    """A sequence ends after producing one of these (kept in its output), e.g. the chat template's end of turn."""
    rows: int = 64
    """Sequences decoded together: the static batch."""
    max_prompt_tokens: int = 1024
    """Longest prompt admitted; a longer one finishes at once with stop reason ``prompt_too_long``."""
    max_len: int | None = None
    """Cache length per row, prompt included (default max_prompt_tokens + max_new_tokens). A sequence that
    reaches it ends with stop reason ``max_len``."""
    prefill_tokens: int = 16384
    """Padded tokens per prefill forward: bounds the activations of admitting many prompts at once."""
    refill_rows: int | None = None
    """Free rows gathered before they are refilled (default rows // 16, at least 1): one prefill forward
    for several prompts. All rows free always refills."""
    cuda_graph: bool = True
    """Capture the decode step in CUDA graphs on a GPU (eager when False, and always on a CPU)."""

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)

        def require(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"GenerationConfig.{name} must be {what}, got {getattr(self, name)!r}")

        def integer(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, int) and not isinstance(value, bool)

        require("max_new_tokens", integer("max_new_tokens") and self.max_new_tokens >= 1, "an integer >= 1")
        require(
            "temperature",
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            "a finite number >= 0",
        )
        require("top_p", isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "in (0, 1]")
        require("seed", integer("seed") and self.seed >= 0, "an integer >= 0")
        require(
            "stop_token_ids",
            all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            "token ids (integers >= 0)",
        )
        require("rows", integer("rows") and self.rows >= 1, "an integer >= 1")
        require("max_prompt_tokens", integer("max_prompt_tokens") and self.max_prompt_tokens >= 1, "an integer >= 1")
        require(
            "max_len",
            self.max_len is None or (integer("max_len") and self.max_len >= self.max_prompt_tokens),
            f"None or an integer >= max_prompt_tokens ({self.max_prompt_tokens})",
        )
        require(
            "prefill_tokens",
            integer("prefill_tokens") and self.prefill_tokens >= self.max_prompt_tokens,
            f"an integer >= max_prompt_tokens ({self.max_prompt_tokens}): one prompt must fit a prefill",
        )
        require(
            "refill_rows",
            self.refill_rows is None or (integer("refill_rows") and 1 <= self.refill_rows <= self.rows),
            f"None or an integer in [1, rows={self.rows}]",
        )
        require("cuda_graph", isinstance(self.cuda_graph, bool), "a bool")

    @property
    def cache_len(self) -> int:
        """Positions per row of the cache."""
        return self.max_len if self.max_len is not None else self.max_prompt_tokens + self.max_new_tokens

    @property
    def refill_threshold(self) -> int:
        """Free rows that trigger a refill."""
        return self.refill_rows if self.refill_rows is not None else max(1, self.rows // 16)


@dataclass
class Request:
    """One prompt to continue; ``key`` comes back with its result."""

    key: Any
    prompt_ids: list[int]
    max_new_tokens: int | None = None
    """Overrides GenerationConfig.max_new_tokens for this request."""

    def __post_init__(self) -> None:
        self.prompt_ids = [int(t) for t in self.prompt_ids]
        if not self.prompt_ids:
            raise ValueError(f"Request.prompt_ids of {self.key!r} is empty: generation continues a prompt")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens of {self.key!r} must be >= 1, got {self.max_new_tokens!r}")


@dataclass
class Finished:
    """A request's result: the new tokens (the stop id included when one ended it)."""

    key: Any
    prompt_ids: list[int]
    new_ids: list[int]
    stop_reason: str
    """``stop`` (a stop id), ``length`` (its max_new_tokens), ``max_len`` (the cache row is full) or
    ``prompt_too_long`` (not admitted; no new ids)."""


@dataclass
class GenerationStats:
    """Counters over every ``generate`` call of one Generator."""

    new_tokens: int = 0
    finished: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    """Prompt tokens prefilled (padding not counted)."""
    prefill_forwards: int = 0
    seconds: float = 0.0
    """Time spent generating: inside generate, less the caller's code (while it holds a yielded result, pulls
    the next request from its source, or runs on_finish)."""
    warmup_seconds: float = 0.0
    """Graph capture and its warm-up runs: once per Generator, not in ``seconds``."""
    busy_row_steps: int = 0
    """Sum over decode steps of the rows holding a live sequence."""
    generated_tokens: int = 0
    """New tokens so far, counted as they are made: the static engine's rows still generating included, the
    fallback's at the end of each chunk (what a caller's progress reads between two finished requests)."""
    active_rows: int = 0
    """Rows holding a sequence not finished yet (the static engine's, after its last step)."""
    row_steps: int = 0
    """Sum over decode steps of all rows."""
    sampling_seconds: float = 0.0
    """Host time the decode steps spent choosing their tokens from the logits: the sampler's whole cost on a CPU (a
    nucleus draw sorts the vocabulary of every row), its launches on a GPU. Synthesis's progress takes it out of a
    sampled kind's step to price a greedy kind's that has not run yet."""

    @property
    def occupancy(self) -> float:
        """Mean fraction of rows busy per decode step."""
        return self.busy_row_steps / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def new_token_limit(config: GenerationConfig, request: Request) -> int:
    """New tokens the request may have: its own limit, or fewer when its cache row would overflow
    (the last token needs no position: it is never fed)."""
    wanted = request.max_new_tokens or config.max_new_tokens
    return min(wanted, config.cache_len - len(request.prompt_ids) + 1)


def refused_as_too_long(config: GenerationConfig, request: Request) -> Finished | None:
    """The result of a request whose prompt is longer than ``max_prompt_tokens`` (None for any other)."""
    if len(request.prompt_ids) <= config.max_prompt_tokens:
        return None
    return Finished(request.key, request.prompt_ids, [], "prompt_too_long")


def stop_reason(config: GenerationConfig, new_ids: list[int], request: Request) -> str:
    """Why a sequence of ``new_ids`` ended: ``stop``, ``length`` or ``max_len`` (see ``Finished``)."""
    if new_ids and new_ids[-1] in config.stop_token_ids:
        return "stop"
    if len(new_ids) >= (request.max_new_tokens or config.max_new_tokens):
        return "length"
    return "max_len"


class Sampler:
    """Next tokens from logits: argmax at temperature 0, else temperature and nucleus sampling."""

    def __init__(self, config: GenerationConfig, device: torch.device) -> None:
        self.temperature = config.temperature
        self.top_p = config.top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if self.top_p >= 1:
            return torch.multinomial(scores.softmax(dim=-1), 1, generator=self.generator)[:, 0]
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # A token stays while the more likely ones before it hold less than top_p: the most likely always does.
        outside = probs.cumsum(dim=-1) - probs >= self.top_p
        nucleus = sorted_scores.masked_fill(outside, -math.inf).softmax(dim=-1)
        choice = torch.multinomial(nucleus, 1, generator=self.generator)
        return order.gather(-1, choice)[:, 0]

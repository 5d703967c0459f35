"""The generator's two engines: each takes requests as rows free up and yields the results of each step.

- ``StaticCacheEngine``: the static-cache decoder (producer/target_model/static_cache.py) with **continuous refill**: a row
  whose sequence ended (a stop id, its ``max_new_tokens``, or the cache's end) is handed to the next prompt; the
  newly admitted prompts are prefilled together (right-padded, causal) straight into their rows of the cache while
  the other rows keep their state, so the batch stays full. Rows are refilled once ``refill_rows`` of them are
  free, so a prefill forward is paid for several prompts at once rather than after every ending. Sampling runs
  outside the decode step's graph, on the logits it leaves.
- ``TransformersEngine``: plain ``model.generate`` in chunks of ``rows`` prompts, without refill, for any other
  model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from producer.target_model.generation import (
    Finished,
    GenerationConfig,
    GenerationStats,
    Request,
    Sampler,
    new_token_limit,
    refused_as_too_long,
    stop_reason,
)
from producer.target_model.static_cache import StaticCacheDecoder

log = logging.getLogger(__name__)

NextRequest = Callable[[], Request | None]
"""The generator's queue: the next request (a follow-up first, else the caller's next), None when none is left."""


@dataclass
class _RowState:
    """Per-row bookkeeping on the device, updated in place after each prefill and decode step."""

    generated: torch.Tensor
    """[rows] new tokens so far."""
    limits: torch.Tensor
    """[rows] new tokens allowed (the request's max_new_tokens, cut to what the cache row holds)."""
    active: torch.Tensor
    """[rows] bool: the row's sequence is still going."""
    outputs: torch.Tensor
    """[rows, max_len + 1] new tokens; one column spare for the steps of finished rows."""
    stop_ids: torch.Tensor


@dataclass
class _Busy:
    """What the host knows of a row holding a sequence."""

    request: Request
    position: int
    """Where the row's next fed token goes."""


class StaticCacheEngine:
    """Admit, prefill, decode and retire rows of the static cache until no request is left."""

    def __init__(self, model: nn.Module, config: GenerationConfig, stats: GenerationStats) -> None:
        self.config, self.stats = config, stats
        self.device = next(model.parameters()).device
        self.decoder = StaticCacheDecoder(model, config.rows, config.cache_len)
        on = {"device": self.device}
        self._state = _RowState(
            generated=torch.zeros(config.rows, dtype=torch.long, **on),
            limits=torch.ones(config.rows, dtype=torch.long, **on),
            active=torch.zeros(config.rows, dtype=torch.bool, **on),
            outputs=torch.zeros(config.rows, config.cache_len + 1, dtype=torch.long, **on),
            stop_ids=torch.tensor(config.stop_token_ids, dtype=torch.long, **on),
        )
        self._sampler = Sampler(config, self.device)

    def run(self, next_request: NextRequest) -> Iterator[list[Finished]]:
        """Yields each step's results."""
        config = self.config
        busy: dict[int, _Busy] = {}
        self._state.active.zero_()  # rows a closed earlier generate left running
        while True:
            finished: list[Finished] = []
            free = [row for row in range(config.rows) if row not in busy]
            if free and (len(free) >= config.refill_threshold or not busy):
                admitted: list[tuple[int, Request]] = []
                while len(admitted) < len(free) and (request := next_request()) is not None:
                    if (refused := refused_as_too_long(config, request)) is not None:
                        finished.append(refused)
                    else:
                        admitted.append((free[len(admitted)], request))
                if admitted:
                    finished += self._prefill(admitted, busy)
            if busy:
                finished += self._decode_step(busy)
            elif not finished:
                return
            self.stats.active_rows = len(busy)
            if finished:
                yield finished

    def _prefill(self, admitted: list[tuple[int, Request]], busy: dict[int, _Busy]) -> list[Finished]:
        """Prefill the admitted requests into their rows, in forwards of at most prefill_tokens padded
        tokens (shortest prompts together, so little padding), and sample their first tokens."""
        admitted = sorted(admitted, key=lambda item: len(item[1].prompt_ids))
        chunks: list[list[tuple[int, Request]]] = [[]]
        for item in admitted:
            width = len(item[1].prompt_ids)  # the longest so far, as the list is sorted
            if chunks[-1] and (len(chunks[-1]) + 1) * width > self.config.prefill_tokens:
                chunks.append([])
            chunks[-1].append(item)
        done_rows: list[int] = []
        for chunk in chunks:
            rows = [row for row, _ in chunk]
            prompts = [request.prompt_ids for _, request in chunk]
            limits = [new_token_limit(self.config, request) for _, request in chunk]
            row_tensor = torch.tensor(rows, device=self.device)
            logits = self.decoder.prefill(row_tensor, prompts)
            done = self._record_first(row_tensor, self._sampler(logits), prompts, limits)
            for (row, request), ended in zip(chunk, done.tolist()):
                busy[row] = _Busy(request, len(request.prompt_ids))
                if ended:
                    done_rows.append(row)
            self.stats.prefill_tokens += sum(len(p) for p in prompts)
            self.stats.prefill_forwards += 1
            self.stats.generated_tokens += len(prompts)  # each row's first token
        return self._retire(sorted(done_rows), busy)

    @torch.no_grad()
    def _record_first(
        self, rows: torch.Tensor, first: torch.Tensor, prompts: list[list[int]], limits: list[int]
    ) -> torch.Tensor:
        """Start the rows' sequences with their first sampled token; returns which ended with it."""
        state, decoder = self._state, self.decoder
        limit = torch.tensor(limits, device=self.device)
        state.outputs[rows, 0] = first
        state.generated[rows] = 1
        state.limits[rows] = limit
        done = torch.isin(first, state.stop_ids) | (limit <= 1)
        state.active[rows] = ~done
        decoder.tokens[rows] = first
        decoder.positions[rows] = torch.tensor([len(p) for p in prompts], device=self.device)
        return done

    @torch.no_grad()
    def _decode_step(self, busy: dict[int, _Busy]) -> list[Finished]:
        """One decode step of all rows; returns the sequences it ended."""
        state, decoder = self._state, self.decoder
        longest = max(entry.position for entry in busy.values())
        logits = decoder.decode(decoder.attention_length_for(longest))
        sampling = time.perf_counter()
        tokens = self._sampler(logits)
        self.stats.sampling_seconds += time.perf_counter() - sampling
        state.outputs[decoder.row_index, state.generated] = tokens
        state.generated += state.active
        done = state.active & (torch.isin(tokens, state.stop_ids) | (state.generated >= state.limits))
        state.active &= ~done
        decoder.tokens.copy_(tokens)
        decoder.positions += state.active
        # The one wait for the device per step: which rows ended decides what the next step runs.
        ended = done.nonzero()[:, 0].tolist()
        self.stats.decode_steps += 1
        self.stats.busy_row_steps += len(busy)
        self.stats.generated_tokens += len(busy)
        self.stats.row_steps += self.config.rows
        for row, entry in busy.items():
            entry.position += 1
        return self._retire(ended, busy)

    def _retire(self, rows: list[int], busy: dict[int, _Busy]) -> list[Finished]:
        """Read the ended rows' outputs and free the rows."""
        if not rows:
            return []
        index = torch.tensor(rows, device=self.device)
        outputs = self._state.outputs[index].tolist()
        counts = self._state.generated[index].tolist()
        finished = []
        for row, output, count in zip(rows, outputs, counts):
            request = busy.pop(row).request
            new_ids = output[:count]
            finished.append(
                Finished(request.key, request.prompt_ids, new_ids, stop_reason(self.config, new_ids, request))
            )
        return finished


class TransformersEngine:
    """Plain ``model.generate`` on chunks of up to ``rows`` requests (a chunk ends when its longest does)."""

    def __init__(self, model: nn.Module, config: GenerationConfig, stats: GenerationStats) -> None:
        self.model, self.config, self.stats = model, config, stats
        self.device = next(model.parameters()).device
        # Chunks generated so far: each samples from its own seed, also across generate calls
        # (the same Magpie prefix asked again must not get the same questions).
        self._chunks = 0

    def run(self, next_request: NextRequest) -> Iterator[list[Finished]]:
        """Yields each chunk's results (and the refused requests' before it)."""
        while True:
            refused: list[Finished] = []
            chunk: list[Request] = []
            while len(chunk) < self.config.rows and (request := next_request()) is not None:
                if (too_long := refused_as_too_long(self.config, request)) is not None:
                    refused.append(too_long)
                else:
                    chunk.append(request)
            if refused:
                yield refused
            if not chunk:
                if refused:
                    continue  # their follow-ups may have queued more
                return
            self._chunks += 1
            yield self._chunk(chunk, self.config.seed + self._chunks)

    @torch.no_grad()
    def _chunk(self, chunk: list[Request], seed: int) -> list[Finished]:
        from transformers import GenerationConfig as HFGenerationConfig

        config, model = self.config, self.model
        limits = [new_token_limit(config, request) for request in chunk]
        pad = getattr(model.config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        width = max(len(request.prompt_ids) for request in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, request in enumerate(chunk):
            ids[i, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            mask[i, width - len(request.prompt_ids) :] = 1
        sampling = (
            {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p, "top_k": 0}
            if config.temperature > 0
            else {"do_sample": False}
        )
        settings = HFGenerationConfig(
            max_new_tokens=max(limits), eos_token_id=list(config.stop_token_ids) or None, pad_token_id=pad, **sampling
        )
        # The model's own generation defaults (sampling settings, penalties, its EOS) must not leak into a
        # generation this config describes: only transformers' global defaults fill what it leaves unset.
        saved = model.generation_config
        model.generation_config = HFGenerationConfig()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                torch.manual_seed(seed)
                sequences = model.generate(
                    ids.to(self.device), attention_mask=mask.to(self.device), generation_config=settings
                )
        finally:
            model.generation_config = saved
        steps = sequences.shape[1] - width
        self.stats.decode_steps += steps
        self.stats.row_steps += steps * config.rows
        finished = []
        for request, limit, row in zip(chunk, limits, sequences[:, width:].tolist()):
            new_ids = row[:limit]
            stop_at = next((i for i, token in enumerate(new_ids) if token in config.stop_token_ids), None)
            if stop_at is not None:
                new_ids = new_ids[: stop_at + 1]
            self.stats.busy_row_steps += len(new_ids)
            self.stats.generated_tokens += len(new_ids)
            finished.append(Finished(request.key, request.prompt_ids, new_ids, stop_reason(config, new_ids, request)))
        return finished

"""Batched, KV-cached generation with the target: on-policy answers and Magpie-style self-synthesis.

``model.generate`` is bound by Python overhead on every decode step (a few hundred kernel launches, a growing cache)
and its batch drains as sequences end. ``Generator`` keeps the GPU busy instead: a static KV cache of ``rows``
sequences, one CUDA graph per decode step, and continuous refill as rows free up (producer/target_model/engines.py,
static_cache.py). Models outside the static cache's family (sliding windows, hybrid linear attention, mixtures of
experts, other layouts) run through plain ``model.generate`` in chunks of ``rows`` prompts, without refill;
``Generator.engine`` says which ran, and a warning is logged.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from torch import nn

from producer.target_model.engines import StaticCacheEngine, TransformersEngine
from producer.target_model.generation import (
    STATIC_CACHE_ENGINE,
    TRANSFORMERS_ENGINE,
    Finished,
    GenerationConfig,
    GenerationStats,
    Request,
)
from producer.target_model.static_cache import static_cache_refusal

log = logging.getLogger(__name__)


class Generator:
    """Generates with a Hugging Face causal LM, in a static batch of rows refilled as sequences end.

    ``engine`` is ``static-cache`` (the engine's own cached forward, CUDA graphs on a GPU) or
    ``transformers-generate`` (plain ``model.generate`` in chunks of rows, for models outside the
    supported family).
    """

    def __init__(self, model: nn.Module, config: GenerationConfig) -> None:
        self.model = model.eval()
        self.config = config
        self.device = next(model.parameters()).device
        self.stats = GenerationStats()
        self.refusal = static_cache_refusal(model, config.cache_len)
        self.engine = STATIC_CACHE_ENGINE if self.refusal is None else TRANSFORMERS_ENGINE
        self._warm = False
        self._running = False
        if self.refusal is not None:
            log.warning(
                "generation falls back to model.generate in chunks of %d rows, without refill: %s",
                config.rows,
                self.refusal,
            )
            self._engine: StaticCacheEngine | TransformersEngine = TransformersEngine(model, config, self.stats)
            return
        self._engine = StaticCacheEngine(model, config, self.stats)
        log.info(
            "generation: static KV cache of %d rows x %d positions (%.2f GiB), key lengths %s, %s",
            config.rows,
            config.cache_len,
            self._engine.decoder.cache_bytes / 2**30,
            self._engine.decoder.attention_lengths,
            "CUDA graphs" if self.uses_cuda_graphs else "eager",
        )

    @property
    def uses_cuda_graphs(self) -> bool:
        static = isinstance(self._engine, StaticCacheEngine)
        return static and self.config.cuda_graph and self.device.type == "cuda"

    def warm_up(self) -> float:
        """Capture the decode graphs (once; generate does it on first use). Returns the seconds it took."""
        if self._warm:
            return 0.0
        started = time.perf_counter()
        if self.uses_cuda_graphs:
            self._engine.decoder.capture_graphs()
        self._warm = True
        self.stats.warmup_seconds = time.perf_counter() - started
        return self.stats.warmup_seconds

    def generate(
        self,
        requests: Iterable[Request],
        on_finish: Callable[[Finished], Iterable[Request] | None] | None = None,
    ) -> Iterator[Finished]:
        """Yield each request's result as soon as its sequence ends (not in request order).

        ``requests`` is pulled lazily, as rows free up. ``on_finish`` sees every result before it is
        yielded and may return follow-up requests (the answer turn after a Magpie question, say): they
        go to the front of the queue, ahead of the requests not yet pulled.
        """
        if self._running:
            raise RuntimeError(
                "Generator.generate is already running: exhaust or close that iterator first "
                "(they share the cache rows)"
            )
        self._running = True
        try:
            self.warm_up()
            queue: deque[Request] = deque()
            source = iter(requests)
            started = time.perf_counter()
            callers = 0.0  # seconds spent in the caller's code (the request source, on_finish): not generating

            def next_request() -> Request | None:
                nonlocal callers
                if queue:
                    return queue.popleft()
                pulling = time.perf_counter()
                request = next(source, None)
                callers += time.perf_counter() - pulling
                return request

            def count_time() -> None:
                nonlocal started, callers
                now = time.perf_counter()
                self.stats.seconds += now - started - callers
                started, callers = now, 0.0

            for batch in self._engine.run(next_request):
                follow_ups: list[Request] = []
                for finished in batch:
                    self.stats.finished += 1
                    self.stats.new_tokens += len(finished.new_ids)
                    if on_finish is not None:
                        asking = time.perf_counter()
                        follow_ups.extend(on_finish(finished) or ())
                        callers += time.perf_counter() - asking
                queue.extendleft(reversed(follow_ups))
                for finished in batch:
                    count_time()
                    yield finished
                    started = time.perf_counter()
            count_time()
        finally:
            self._running = False

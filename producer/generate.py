"""Batched, KV-cached generation with the target: on-policy answers and Magpie-style self-synthesis.

A producer that writes its own training data has the target answer prompts, or (Magpie) has the target
write the user's message itself from its chat template's user prefix and then answer it: the second turn
is a follow-up request that ``on_finish`` returns when the question is done. ``model.generate`` is bound
by Python overhead on every decode step (a few hundred kernel launches, a growing cache) and its batch
drains as sequences end. ``Generator`` keeps the GPU busy instead:

- **Static KV cache.** ``rows`` sequences at once, each in its own row of a preallocated cache
  (``[rows, kv_heads, max_len, head_dim]`` for the keys and for the values of every layer: rows * max_len
  * layers * 2 * kv_heads * head_dim * bytes, 11.5 GB for Qwen3-8B at 256 rows of 304 tokens in bf16).
  Every row has its own position: a decode step writes each row's new key/value at that row's position and
  attends to the keys up to it.
- **One CUDA graph per decode step.** The whole step (embedding, every layer, final norm, lm_head) is
  captured once per key length it attends to (a few lengths up to ``max_len``: a step reads only the
  cache prefix that its longest row needs) and replayed with one launch. Its inputs are static buffers
  (token id and position per row) that the bookkeeping between steps updates in place. Sampling runs
  outside the graph, on the logits it leaves. On a CPU the same step runs eagerly.
- **Continuous refill.** A row whose sequence ended (a stop id, its ``max_new_tokens``, or the cache's end)
  is handed to the next prompt: the newly admitted prompts are prefilled together (right-padded, causal)
  straight into their rows of the cache while the other rows keep their state, so the batch stays full.
  Rows are refilled once ``refill_rows`` of them are free, so a prefill forward is paid for several
  prompts at once rather than after every ending.

The forward is the engine's own, over the model's modules, for decoder-only models of the Llama layout
with full attention (Llama, Mistral, Qwen2, Qwen3). Anything else (sliding windows, hybrid linear
attention, mixtures of experts, other layouts) runs through plain ``model.generate`` in chunks of
``rows`` prompts, without refill; ``Generator.engine`` says which ran, and a warning is logged.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

STATIC_CACHE_ENGINE = "static-cache"
TRANSFORMERS_ENGINE = "transformers-generate"
STATIC_CACHE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# RoPE variants whose frequencies change with the length generated so far: a table of cos/sin computed once
# per position cannot reproduce them.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


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

    @property
    def occupancy(self) -> float:
        """Mean fraction of rows busy per decode step."""
        return self.busy_row_steps / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def static_cache_refusal(model: nn.Module, cache_len: int) -> str | None:
    """Why the static-cache engine cannot run ``model``, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in STATIC_CACHE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(STATIC_CACHE_MODEL_TYPES)}"
    base = getattr(model, "model", None)
    missing = [f"model.{name}" for name in ("embed_tokens", "layers", "rotary_emb", "norm") if not hasattr(base, name)]
    missing += ["lm_head"] if not hasattr(model, "lm_head") else []
    if missing:
        return f"no {', '.join(missing)}"
    layer_types = getattr(config, "layer_types", None) or []
    other_layers = sorted(set(layer_types) - {"full_attention"})
    if other_layers:
        return f"layers other than full attention: {other_layers}"
    window = getattr(config, "sliding_window", None)
    if window is not None and window < cache_len:
        return f"sliding window {window} shorter than max_len {cache_len}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") in LENGTH_DEPENDENT_ROPE:
        return f"rope type {rope['rope_type']!r} depends on the sequence length"
    if any(getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        return "a mixture of experts"
    if (getattr(model, "_tp_size", None) or 1) > 1:
        return "tensor-parallel shards (each rank holds some heads)"
    parts = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "input_layernorm",
        "post_attention_layernorm",
        "mlp",
    )
    for index, layer in enumerate(base.layers):
        for part in parts:
            owner = layer
            for name in part.split("."):
                owner = getattr(owner, name, None)
            if owner is None:
                return f"layer {index} has no {part}"
    return None


class GenerationMemoryError(ValueError):
    """The static KV cache asked for cannot fit in the memory its device has available: the same on every try."""


def available_memory(device: torch.device) -> int | None:
    """Bytes that ``device`` can give now: a GPU's free memory, a Linux host's MemAvailable; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


CACHE_SHARE = 0.9
"""The most of the available memory a static KV cache may take: the rest is for the forwards' activations."""


def attention_lengths(cache_len: int) -> list[int]:
    """Key lengths a decode step is built for: about 8 steps up to ``cache_len``, multiples of 16 (what the
    fused attention kernels align masks to). A step attends to the shortest one covering its longest row."""
    step = max(16, (-(-cache_len // 8) + 15) // 16 * 16)
    return sorted({min(cache_len, step * i) for i in range(1, -(-cache_len // step) + 1)})


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of the Llama layout (the two halves of head_dim rotate together)."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


class StaticCacheDecoder:
    """The model's forward over a static per-row KV cache: a prefill of chosen rows, and a decode step of all.

    ``tokens`` and ``positions`` ([rows]) are the decode step's inputs: the token each row feeds next and the
    position it goes to. They are updated in place only, because captured graphs read them by address.
    """

    def __init__(self, model: nn.Module, rows: int, cache_len: int) -> None:
        config = model.config
        base = model.model
        self.embed_tokens = base.embed_tokens
        self.layers = list(base.layers)
        self.final_norm = base.norm
        self.lm_head = model.lm_head
        self.rows = rows
        self.cache_len = cache_len
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.scaling = getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.has_qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._check_fits(rows, cache_len, parameter.element_size())
        on = {"device": self.device}
        with torch.no_grad():
            shape = (rows, self.kv_heads, cache_len, self.head_dim)
            self.keys = [torch.zeros(shape, dtype=self.dtype, **on) for _ in self.layers]
            self.values = [torch.zeros(shape, dtype=self.dtype, **on) for _ in self.layers]
            self.tokens = torch.zeros(rows, dtype=torch.long, **on)
            self.positions = torch.zeros(rows, dtype=torch.long, **on)
            self.row_index = torch.arange(rows, **on)
            self.key_index = torch.arange(cache_len, **on)
            # The model's own rotary embedding, once per position: a decode step gathers each row's entry
            # (same values as calling it per step, since every supported rope type is elementwise in position).
            probe = torch.zeros(1, dtype=self.dtype, **on)
            cos, sin = base.rotary_emb(probe, self.key_index[None])
            self.cos, self.sin = cos[0], sin[0]
        self.attention_lengths = attention_lengths(cache_len)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _check_fits(self, rows: int, cache_len: int, element_size: int) -> None:
        """Refuse, before allocating it, a cache larger than ``CACHE_SHARE`` of the device's available memory (a
        host would otherwise kill the process, and kill it again at every restart)."""
        per_row = cache_len * len(self.layers) * 2 * self.kv_heads * self.head_dim * element_size
        available = available_memory(self.device)
        if available is None or rows * per_row <= CACHE_SHARE * available:
            return
        fit = int(CACHE_SHARE * available // per_row)
        raise GenerationMemoryError(
            f"a static KV cache of {rows} rows x {cache_len} positions needs {rows * per_row / 2**30:.2f} GiB, and "
            f"{self.device} has {available / 2**30:.2f} GiB available: at most {fit} rows of {cache_len} positions fit"
        )

    def attention_length_for(self, longest_position: int) -> int:
        """The shortest captured key length that covers a row at ``longest_position``."""
        return next(length for length in self.attention_lengths if length > longest_position)

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture the decode step once per attention length, sharing one memory pool.

        Each capture is preceded by eager runs on a side stream (cuBLAS and attention kernels pick their
        algorithms and workspaces there, not inside the capture). Those runs write keys/values at the
        current positions of every row: the same values the next real step writes, or rows not in use.
        """
        pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        for length in self.attention_lengths:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._decode_forward(length)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):
                logits = self._decode_forward(length)
            self.graphs[length] = (graph, logits)
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def decode(self, attention_length: int) -> torch.Tensor:
        """Logits [rows, vocab] of every row's next token (a graph's static output when captured: read it
        before the next decode)."""
        captured = self.graphs.get(attention_length)
        if captured is None:
            return self._decode_forward(attention_length)
        graph, logits = captured
        graph.replay()
        return logits

    def _decode_forward(self, attention_length: int) -> torch.Tensor:
        rows, kv_heads, group, head_dim = self.rows, self.kv_heads, self.group, self.head_dim
        hidden = self.embed_tokens(self.tokens[:, None])
        cos, sin = self.cos[self.positions], self.sin[self.positions]
        # Keys of a row up to its own position; the rest of its row is stale or unused.
        visible = (self.key_index[:attention_length] <= self.positions[:, None])[:, None, None, :]
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            # One query per row: the query heads sharing a key/value head stack as that head's queries, so
            # attention is plain multi-head over the kv heads (fused kernels take it with a mask; GQA they may not).
            q = attn.q_proj(x).view(rows, kv_heads, group, head_dim)
            k = attn.k_proj(x).view(rows, kv_heads, head_dim)
            v = attn.v_proj(x).view(rows, kv_heads, head_dim)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = rotate(q, cos[:, None, None], sin[:, None, None])
            k = rotate(k, cos[:, None], sin[:, None])
            keys[self.row_index, :, self.positions] = k
            values[self.row_index, :, self.positions] = v
            out = F.scaled_dot_product_attention(
                q,
                keys[:, :, :attention_length],
                values[:, :, :attention_length],
                attn_mask=visible,
                scale=self.scaling,
            )
            hidden = hidden + attn.o_proj(out.reshape(rows, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.lm_head(self.final_norm(hidden[:, 0]))

    @torch.no_grad()
    def prefill(self, rows: torch.Tensor, prompts: list[list[int]]) -> torch.Tensor:
        """Run ``prompts`` (one per entry of ``rows``) from position 0, write their keys/values into those
        rows of the cache, and return the logits [n, vocab] after each prompt's last token."""
        count, width = len(prompts), max(len(p) for p in prompts)
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        ids = torch.zeros(count, width, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt)
        ids = ids.to(self.device, non_blocking=True)
        last = torch.tensor([len(p) - 1 for p in prompts]).to(self.device, non_blocking=True)
        hidden = self.embed_tokens(ids)
        cos, sin = self.cos[:width], self.sin[:width]
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(count, width, heads, head_dim)
            k = attn.k_proj(x).view(count, width, kv_heads, head_dim)
            v = attn.v_proj(x).view(count, width, kv_heads, head_dim).transpose(1, 2)
            if self.has_qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = rotate(q.transpose(1, 2), cos, sin)
            k = rotate(k.transpose(1, 2), cos, sin)
            keys[rows, :, :width] = k
            values[rows, :, :width] = v
            # Right padding: causal attention alone keeps every real token away from the padding after it.
            # The padding's own keys land past the prompt, where decode overwrites them before reading.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.group > 1)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(count, width, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last_hidden = hidden[torch.arange(count, device=self.device), last]
        return self.lm_head(self.final_norm(last_hidden))


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


class Generator:
    """Generates with a Hugging Face causal LM, in a static batch of rows refilled as sequences end.

    ``engine`` is ``static-cache`` (the engine's own cached forward, CUDA graphs on a GPU) or
    ``transformers-generate`` (plain ``model.generate`` in chunks of rows, for models outside the
    supported family).
    """

    def __init__(self, model: nn.Module, config: GenerationConfig) -> None:
        self.model = model.eval()
        self.config = config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.stats = GenerationStats()
        self.refusal = static_cache_refusal(model, config.cache_len)
        self.engine = STATIC_CACHE_ENGINE if self.refusal is None else TRANSFORMERS_ENGINE
        self._decoder: StaticCacheDecoder | None = None
        self._warm = False
        self._running = False
        # Chunks the fallback generated so far: each samples from its own seed, also across generate calls
        # (the same Magpie prefix asked again must not get the same questions).
        self._fallback_chunks = 0
        if self.refusal is not None:
            log.warning(
                "generation falls back to model.generate in chunks of %d rows, without refill: %s",
                config.rows,
                self.refusal,
            )
            return
        self._decoder = StaticCacheDecoder(model, config.rows, config.cache_len)
        on = {"device": self.device}
        self._state = _RowState(
            generated=torch.zeros(config.rows, dtype=torch.long, **on),
            limits=torch.ones(config.rows, dtype=torch.long, **on),
            active=torch.zeros(config.rows, dtype=torch.bool, **on),
            outputs=torch.zeros(config.rows, config.cache_len + 1, dtype=torch.long, **on),
            stop_ids=torch.tensor(config.stop_token_ids, dtype=torch.long, **on),
        )
        self._sampler = Sampler(config, self.device)
        log.info(
            "generation: static KV cache of %d rows x %d positions (%.2f GiB), key lengths %s, %s",
            config.rows,
            config.cache_len,
            self._decoder.cache_bytes / 2**30,
            self._decoder.attention_lengths,
            "CUDA graphs" if self.uses_cuda_graphs else "eager",
        )

    @property
    def uses_cuda_graphs(self) -> bool:
        return self._decoder is not None and self.config.cuda_graph and self.device.type == "cuda"

    def warm_up(self) -> float:
        """Capture the decode graphs (once; generate does it on first use). Returns the seconds it took."""
        if self._warm:
            return 0.0
        started = time.perf_counter()
        if self.uses_cuda_graphs:
            self._decoder.capture_graphs()
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
            run = self._run_static if self._decoder is not None else self._run_transformers
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

            for batch in run(next_request):
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

    def _limit(self, request: Request) -> int:
        """New tokens the request may have: its own limit, or fewer when its cache row would overflow
        (the last token needs no position: it is never fed)."""
        wanted = request.max_new_tokens or self.config.max_new_tokens
        return min(wanted, self.config.cache_len - len(request.prompt_ids) + 1)

    def _too_long(self, request: Request) -> Finished | None:
        if len(request.prompt_ids) <= self.config.max_prompt_tokens:
            return None
        return Finished(request.key, request.prompt_ids, [], "prompt_too_long")

    def _stop_reason(self, new_ids: list[int], request: Request) -> str:
        if new_ids and new_ids[-1] in self.config.stop_token_ids:
            return "stop"
        if len(new_ids) >= (request.max_new_tokens or self.config.max_new_tokens):
            return "length"
        return "max_len"

    # ------------------------------------------------------------------------------ static-cache engine

    def _run_static(self, next_request: Callable[[], Request | None]) -> Iterator[list[Finished]]:
        """Admit, prefill, decode and retire rows until no request is left; yields each step's results."""
        config = self.config
        busy: dict[int, _Busy] = {}
        self._state.active.zero_()  # rows a closed earlier generate left running
        while True:
            finished: list[Finished] = []
            free = [row for row in range(config.rows) if row not in busy]
            if free and (len(free) >= config.refill_threshold or not busy):
                admitted: list[tuple[int, Request]] = []
                while len(admitted) < len(free) and (request := next_request()) is not None:
                    if (refused := self._too_long(request)) is not None:
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
            limits = [self._limit(request) for _, request in chunk]
            row_tensor = torch.tensor(rows, device=self.device)
            logits = self._decoder.prefill(row_tensor, prompts)
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
        state, decoder = self._state, self._decoder
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
        state, decoder = self._state, self._decoder
        longest = max(entry.position for entry in busy.values())
        logits = decoder.decode(decoder.attention_length_for(longest))
        tokens = self._sampler(logits)
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
            finished.append(Finished(request.key, request.prompt_ids, new_ids, self._stop_reason(new_ids, request)))
        return finished

    # ------------------------------------------------------------------------------ fallback engine

    def _run_transformers(self, next_request: Callable[[], Request | None]) -> Iterator[list[Finished]]:
        """Plain ``model.generate`` on chunks of up to ``rows`` requests (a chunk ends when its longest does)."""
        while True:
            refused: list[Finished] = []
            chunk: list[Request] = []
            while len(chunk) < self.config.rows and (request := next_request()) is not None:
                if (too_long := self._too_long(request)) is not None:
                    refused.append(too_long)
                else:
                    chunk.append(request)
            if refused:
                yield refused
            if not chunk:
                if refused:
                    continue  # their follow-ups may have queued more
                return
            self._fallback_chunks += 1
            yield self._transformers_chunk(chunk, self.config.seed + self._fallback_chunks)

    @torch.no_grad()
    def _transformers_chunk(self, chunk: list[Request], seed: int) -> list[Finished]:
        from transformers import GenerationConfig as HFGenerationConfig

        config, model = self.config, self.model
        limits = [self._limit(request) for request in chunk]
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
            finished.append(Finished(request.key, request.prompt_ids, new_ids, self._stop_reason(new_ids, request)))
        return finished

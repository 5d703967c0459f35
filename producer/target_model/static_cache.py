"""The static-cache decoder: the target's forward over a preallocated per-row KV cache, for decoder-only models of
the Llama layout with full attention (Llama, Mistral, Qwen2, Qwen3).

``rows`` sequences at once, each in its own row of the cache (``[rows, kv_heads, max_len, head_dim]`` for the keys and
for the values of every layer: rows * max_len * layers * 2 * kv_heads * head_dim * bytes, 11.5 GB for Qwen3-8B at 256
rows of 304 tokens in bf16). Every row has its own position: a decode step writes each row's new key/value at that
row's position and attends to the keys up to it. On a GPU the whole step (embedding, every layer, final norm,
lm_head) is captured as one CUDA graph per key length it attends to (a few lengths up to ``max_len``: a step reads
only the cache prefix that its longest row needs) and replayed with one launch. Anything else (sliding windows,
hybrid linear attention, mixtures of experts, other layouts, tensor-parallel shards) is refused
(``static_cache_refusal``): the generator falls back to plain ``model.generate``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

STATIC_CACHE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# RoPE variants whose frequencies change with the length generated so far: a table of cos/sin computed once
# per position cannot reproduce them.
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


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

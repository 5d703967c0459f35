"""The target side of a producer: load the target LLM and capture the hidden states a drafter needs.

Layer numbering follows docs/dflash.md: the feature of layer ``k`` is the OUTPUT of decoder layer ``k``,
which is ``hidden_states[k + 1]`` of a Hugging Face forward with ``output_hidden_states=True``.
``last_hidden`` is the output of the last decoder layer BEFORE the final norm; note that HF's
``hidden_states[-1]`` is NOT that: transformers overwrites its last entry with the normed output.

The packed forward does not call the HF model's ``forward``. It runs the embedding, the rotary
embedding (from per-document positions) and the decoder layers itself, and stops after the deepest
layer it needs: no later layers, no final norm, no lm_head, never logits. Attention is causal inside
each document and never crosses a document boundary. The decoder layers are the model's own modules;
only their attention kernel is swapped, through transformers' attention-function registry, for one
that reads the packing (``PackedAttention``) passed down as a keyword argument:

- ``varlen``: FlashAttention-2 varlen (``aten._flash_attention_forward`` with ``cu_seqlens``), CUDA
  bf16/fp16. No mask to build, no host sync.
- ``flex``: ``flex_attention`` with a document-causal ``BlockMask`` (compiled), CUDA.
- ``sdpa``: one ``scaled_dot_product_attention`` per document, any device; the exact reference. A sliding-window
  layer attends in chunks of queries over the keys their window reaches: nothing of length x length is made, so
  one document of 64K or 128K tokens in one packed row costs memory linear in its length.

Supported: decoder-only HF models whose base model is ``embed_tokens -> rotary_emb -> layers -> norm``
(Llama, Mistral, Qwen2, Qwen3 and their kin) and whose every decoder layer mixes tokens through
``self_attn`` (the attention interface) or a Gated-DeltaNet ``linear_attn`` (the hybrid Qwen3.5 /
Qwen3.6 family, dense or mixture-of-experts; producer/linear_attention.py restarts its convolution and
recurrent state at each document). Sliding-window layers are honoured. A multimodal checkpoint
(``Qwen3_5ForConditionalGeneration``) loads its language model only. Anything else is refused at
load with ``UnsupportedTarget``, naming the model type and what is missing.

Tensor parallel (``load_target_model(cfg, tensor_parallel=N)`` on each rank of an initialised
process group, see producer/tensor_parallel.py): the model is sharded by transformers' own plan for
its type (q/k/v and gate/up column-wise, o/down row-wise with an all-reduce, the embedding by
vocabulary). The attention kernels see this rank's heads only, which they take from the tensors'
shapes; the output of every decoder layer is whole and identical on every rank after the row-wise
all-reduce, so the captured features are those of the unsharded model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from common.batch import PackedBatch, document_ids, position_ids
from common.codec import DTYPES
from common.config import TargetConfig
from common.hf import target_identity, text_config_of
from producer.linear_attention import install_packed_forward, is_gated_deltanet, resolve_linear_backend

if TYPE_CHECKING:
    from producer.tensor_parallel import TensorParallelGroup

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "varlen", "flex", "sdpa")
# Registered in transformers' attention registry; falls back to plain SDPA when no packing is given,
# so the same model object still serves an ordinary HF forward (references, baselines).
PACKED_ATTENTION_NAME = "dflash_packed"
# The tiny default target: a Qwen3 that runs anywhere in milliseconds.
TINY_TARGET_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def resolve_device(cfg: TargetConfig) -> torch.device:
    """``cfg.device`` with ``auto`` made concrete: cuda when available, else cpu."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


class CapturedFeatures(NamedTuple):
    """What one packed forward produced (views of the caller's buffers when it gave them)."""

    aux_hidden: torch.Tensor
    """``[T, n * H]``: concat over ``layer_ids`` of the outputs of those decoder layers."""
    last_hidden: torch.Tensor | None
    """``[T, H]``: output of the last decoder layer before the final norm, when requested."""


# ---------------------------------------------------------------------------------------------- loading


class UnsupportedTarget(ValueError):
    """A target this producer cannot capture from: the same on every try, so the run stops (exit 2)."""


WEIGHT_SHAPE_KEYS = frozenset(
    {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"}
)
"""Config fields that set the shapes of stored weights: an override may not change them for target.path
(num_hidden_layers may: fewer layers load a prefix of the stored ones)."""


def build_target_config(cfg: TargetConfig):
    """The transformers config the target is built from (the path's, the json's or the tiny default)."""
    from transformers import AutoConfig

    if cfg.path is not None:
        # A multimodal checkpoint (Qwen3.5's ForConditionalGeneration): its language model's config.
        config = text_config_of(AutoConfig.from_pretrained(cfg.path))
        for key, value in cfg.config_overrides.items():
            stored = getattr(config, key, None)
            if key in WEIGHT_SHAPE_KEYS and stored is not None and stored != value:
                # Else transformers fails deep in loading, on every restart, with a size-mismatch report.
                raise ValueError(
                    f"target.config_overrides.{key}={value!r} contradicts the stored target's {key}={stored!r} "
                    f"({cfg.path}/config.json): its weights would not fit. Drop the override (launch/tiny.toml sets "
                    f"vocab_size for the tiny default: pass target.config_overrides={{}} with target.path)"
                )
            setattr(config, key, value)
        return config
    if cfg.config_json is not None:
        fields = json.loads(Path(cfg.config_json).read_text())
    else:
        fields = dict(TINY_TARGET_CONFIG)
    fields.update(cfg.config_overrides)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("TargetConfig.config_json: the config has no 'model_type'")
    return text_config_of(AutoConfig.for_model(model_type, **fields))


def check_tensor_parallel(config, size: int) -> None:
    """Raise ValueError, naming the numbers, unless transformers can shard this target over ``size`` devices."""
    import transformers

    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"target model type {config.model_type!r} has no tensor-parallel plan in transformers "
            f"{transformers.__version__} (its config's base_model_tp_plan is empty): run it on one device"
        )
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    undivided = [name for name, count in (("attention heads", heads), ("key/value heads", kv_heads)) if count % size]
    if undivided:
        raise ValueError(
            f"tensor parallelism over {size} devices shards whole heads: {size} must divide the target's attention "
            f"heads ({heads}) and key/value heads ({kv_heads}), and does not divide the {' nor the '.join(undivided)}"
        )


def load_target_model(cfg: TargetConfig, tensor_parallel: int = 1) -> nn.Module:
    """The target as an eval-mode HF causal LM on ``cfg``'s device, its attention set to the packed kernel.

    From ``cfg.path`` the stored weights are loaded straight onto the device. Otherwise the weights are
    random (HF's own init, seeded by ``cfg.seed``) and are created on the device directly, so an
    8B-shaped target never passes through host memory.

    ``tensor_parallel`` > 1: this rank's shards, by transformers' tensor-parallel plan, in the process
    group every rank of the group has joined (``cfg.device`` is this rank's device). From a path each
    rank reads only its shards. Random weights are made whole on every rank by the same seeded init as
    on one device, then sharded: every rank holds consistent shards of the very model a one-device
    producer of the same seed builds (same ``target_identity``, on the same kind of device), so
    producers of one run agree whatever their degree. The whole model must then fit one device while
    loading.
    """
    from transformers import AutoModelForCausalLM

    _register_packed_attention()
    device = resolve_device(cfg)
    dtype = DTYPES[cfg.dtype]
    config = build_target_config(cfg)
    sharding = _sharding(config, tensor_parallel) if tensor_parallel > 1 else None
    if cfg.path is not None and sharding is None:
        placement = {"device_map": str(device)} if device.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=config, dtype=dtype, attn_implementation="sdpa", **placement
        ).to(device)
    elif cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, config=config, dtype=dtype, attn_implementation="sdpa", distributed_config=sharding
        )
    else:
        config._attn_implementation = "sdpa"
        # A private RNG stream: the seed fixes the weights without resetting the caller's generators.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if sharding is not None:
            whole = model
            model = type(whole).from_pretrained(
                None,
                config=whole.config,
                state_dict=whole.state_dict(),
                dtype=dtype,
                attn_implementation="sdpa",
                distributed_config=sharding,
            )
            del whole
    if sharding is not None and next(model.parameters()).device != device:
        # transformers puts rank r on accelerator r; the producer makes the group's GPUs the visible ones.
        raise ValueError(f"tensor-parallel shards landed on {next(model.parameters()).device}, expected {device}")
    model.config._attn_implementation = PACKED_ATTENTION_NAME
    return model.eval().requires_grad_(False)


def _sharding(config, size: int):
    """transformers' DistributedConfig for ``size``-way tensor parallelism by the model's own plan (checked)."""
    check_tensor_parallel(config, size)
    try:
        from transformers.distributed import DistributedConfig
    except ImportError as exc:
        import transformers

        raise ValueError(
            f"tensor parallelism needs transformers' DistributedConfig (transformers >= 5), "
            f"found transformers {transformers.__version__}"
        ) from exc
    return DistributedConfig(tp_size=size)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one rank's shard of a tensor-parallel parameter (a DTensor)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or all of a sharded one: a collective that every rank of the group must join."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


# -------------------------------------------------------------------------------------------- attention


@dataclass
class PackedAttention:
    """How the documents of one packed batch attend; passed to every layer's attention kernel."""

    backend: str
    cu_seqlens: torch.Tensor
    """int32 ``[D + 1]`` on the model's device."""
    linear: str = "per_document"
    """How Gated-DeltaNet layers run (producer/linear_attention.py): fla or per_document."""
    document_bounds: tuple[tuple[int, int], ...] = ()
    """Host copy of (start, end) per document; ``sdpa`` attention and ``per_document`` linear layers only."""
    block_masks: dict[int | None, Any] = field(default_factory=dict)
    """``flex`` only: a document-causal BlockMask per sliding window (None: full attention)."""


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    dflash_packed: PackedAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface kernel. q ``[1, Hq, T, D]``, k/v ``[1, Hkv, T, D]`` -> ``[1, T, Hq, D]``."""
    if dflash_packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row (batch dimension 1)")
    if dflash_packed.backend == "varlen":
        out = _varlen_attention(query, key, value, dflash_packed.cu_seqlens, scaling, sliding_window)
    elif dflash_packed.backend == "flex":
        out = _flex_attention(query, key, value, dflash_packed.block_masks[sliding_window], scaling)
    else:
        out = _per_document_sdpa(query, key, value, dflash_packed.document_bounds, scaling, sliding_window)
    return out, None


def _varlen_attention(query, key, value, cu_seqlens, scaling, sliding_window):
    # FA2 varlen wants [T, heads, D]; it handles GQA itself. max_seqlen = T (from the shape, so no host
    # value enters a compiled graph): the kernel's blocks past a document's end exit at once.
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    total = q.shape[0]
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1, "window_size_right": 0}
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, total, total, 0.0, True, False, scale=scaling, **window
    )[0]
    return out.unsqueeze(0)


_compiled_flex_attention = None


def _flex_attention(query, key, value, block_mask, scaling):
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        # Uncompiled flex attention is a slow reference; inside an outer torch.compile this is inlined.
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
    out = _compiled_flex_attention(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


SLIDING_QUERY_CHUNK = 512
"""Queries per SDPA call of a sliding-window layer in the ``sdpa`` kernel (see ``_sliding_window_sdpa``)."""


def _per_document_sdpa(query, key, value, document_bounds, scaling, sliding_window):
    outputs = []
    for start, end in document_bounds:
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if sliding_window is not None and end - start > sliding_window:
            out = _sliding_window_sdpa(q, k, v, sliding_window, scaling)
        else:
            # Causal without a mask: CPU and CUDA SDPA run it as flash attention, in memory linear in the length.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _sliding_window_sdpa(q, k, v, window: int, scaling, chunk: int = SLIDING_QUERY_CHUNK):
    """Causal attention of one document within ``window``, ``chunk`` queries at a time over the keys they can see
    (the window before the chunk and the chunk itself): a mask of chunk x (chunk + window) per call, where one mask
    over the document is length x length (16 GiB at 128K tokens, 64 GiB with SDPA's float copy of it)."""
    length = q.shape[2]
    outputs = []
    for q_start in range(0, length, chunk):
        q_end = min(q_start + chunk, length)
        kv_start = max(0, q_start - window + 1)
        distance = torch.arange(q_start, q_end, device=q.device)[:, None] - torch.arange(
            kv_start, q_end, device=q.device
        )
        mask = (distance >= 0) & (distance < window)
        outputs.append(
            F.scaled_dot_product_attention(
                q[:, :, q_start:q_end],
                k[:, :, kv_start:q_end],
                v[:, :, kv_start:q_end],
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return torch.cat(outputs, dim=2)


def document_causal_block_mask(document_ids: torch.Tensor, sliding_window: int | None = None, tile: int = 128):
    """flex_attention BlockMask: causal inside each document (and within ``sliding_window`` if set). Its tiles
    come from the documents' bounds (``document_causal_tiles``), not from the mask at every pair of tokens."""
    from common.drafter.masks import block_mask_of_tiles

    def same_document_causal(batch, head, q_index, kv_index):
        visible = (document_ids[q_index] == document_ids[kv_index]) & (q_index >= kv_index)
        if sliding_window is not None:
            visible = visible & (q_index - kv_index < sliding_window)
        return visible

    total = document_ids.numel()
    partial, full = document_causal_tiles(document_ids, sliding_window, tile)
    return block_mask_of_tiles(partial, full, tile, same_document_causal, (total, total))


def document_causal_tiles(
    document_ids: torch.Tensor, sliding_window: int | None, tile: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[tiles, tiles]`` bool pair (partial, full) of the packed causal mask, from the sorted document ids: a
    key tile before the query tile holds a visible pair exactly when its last token's document reaches the query
    tile's first token (their closest pair), and is visible throughout when one document spans both tiles."""
    total = document_ids.numel()
    tiles = -(-total // tile)
    start = torch.arange(tiles, device=document_ids.device) * tile
    first, last = document_ids[start], document_ids[(start + tile - 1).clamp(max=total - 1)]
    q, kv = start[:, None], start[None, :]
    earlier = kv < q
    some = (kv == q) | (earlier & (last[None, :] == first[:, None]))
    full = earlier & (first[None, :] == last[:, None]) & (q + tile <= total)
    if sliding_window is not None:
        some &= (kv == q) | (q - (kv + tile - 1) < sliding_window)  # the closest pair of the two tiles
        full &= q + tile - 1 - kv < sliding_window  # the farthest
    return some & ~full, full


_registered = False


def _register_packed_attention() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION_NAME, packed_attention_forward)
    # An ordinary HF forward through this model builds the masks SDPA would get.
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION_NAME, sdpa_mask)
    _registered = True


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> varlen on CUDA in bf16/fp16 (sm80+), flex on other CUDA, sdpa on CPU."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: {requested!r} is not one of {ATTENTION_BACKENDS}")
    if requested != "auto":
        if requested in ("varlen", "flex") and device.type != "cuda":
            raise ValueError(f"attention: {requested!r} needs a CUDA device, got {device}")
        if requested == "varlen" and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("attention: 'varlen' (FlashAttention-2) needs bfloat16 or float16")
        return requested
    if device.type != "cuda":
        return "sdpa"
    flash_ok = dtype in (torch.bfloat16, torch.float16) and torch.cuda.get_device_capability(device)[0] >= 8
    return "varlen" if flash_ok else "flex"


# ---------------------------------------------------------------------------------------------- capture


class Target:
    """A loaded target that captures the drafter's features from packed batches."""

    def __init__(
        self,
        model: nn.Module,
        layer_ids: list[int],
        *,
        capture_last_hidden: bool = False,
        attention: str = "auto",
        compile: bool | None = None,
        followers: TensorParallelGroup | None = None,
    ) -> None:
        _register_packed_attention()
        model.config._attn_implementation = PACKED_ATTENTION_NAME
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        for part in ("embed_tokens", "rotary_emb", "layers"):
            if not hasattr(self.base, part):
                raise UnsupportedTarget(
                    f"target model type {getattr(model.config, 'model_type', '?')!r} "
                    f"({type(model).__name__}): its base model has no '{part}'; packed capture "
                    "needs embed_tokens -> rotary_emb -> layers"
                )
        num_layers = len(self.base.layers)
        self.hybrid = _prepare_token_mixers(model)
        if (
            not layer_ids
            or sorted(set(layer_ids)) != list(layer_ids)
            or not 0 <= layer_ids[0] <= layer_ids[-1] < num_layers
        ):
            raise ValueError(f"layer_ids must be strictly increasing within [0, {num_layers}), got {layer_ids}")
        self.layer_ids = list(layer_ids)
        self.capture_last_hidden = capture_last_hidden
        # The forward stops after the deepest captured layer (runs all of them for last_hidden).
        self.num_layers_run = num_layers if capture_last_hidden else self.layer_ids[-1] + 1
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.hidden_size = int(model.config.hidden_size)
        self.aux_width = len(self.layer_ids) * self.hidden_size
        self.attention = resolve_attention_backend(attention, self.device, self.dtype)
        self.linear = resolve_linear_backend(self.device, self.dtype) if self.hybrid else None
        if self.linear == "per_document" and self.device.type == "cuda":
            log.warning(
                "Gated-DeltaNet layers run one document at a time (exact, slow): install flash-linear-attention "
                "(pip install -e '.[gpu]') for its varlen kernels"
            )
        # The per-document loops use host lengths: a compiled graph would specialise on every batch.
        host_loop = self.attention == "sdpa" or self.linear == "per_document"
        if compile and host_loop:
            raise ValueError(
                "compile: not supported with attention 'sdpa' or Gated-DeltaNet layers run per document "
                "(use varlen or flex attention, and flash-linear-attention on a GPU)"
            )
        sharded = any(is_sharded(param) for param in model.parameters())
        # transformers' tensor-parallel hooks swap parameters and all-reduce inside each projection;
        # compiling through them is unverified, so a sharded target compiles only when asked to; nor does a
        # mixture-of-experts target (``has_experts``).
        self.compiled = compiles_by_default(model, self.device, host_loop, sharded) if compile is None else compile
        if self.compiled and has_experts(model):
            log.warning(
                "target.compile = true with a mixture-of-experts target: compiling its decoder layer did not "
                "finish in minutes on an H200 (torch 2.11, transformers 5.24); leave target.compile unset if the "
                "first batch does not come"
            )
        layers = list(self.base.layers[: self.num_layers_run])
        # One compiled graph serves every layer (their parameters are graph inputs); dynamic token counts.
        self._run_layer = [torch.compile(layer, dynamic=True) for layer in layers] if self.compiled else layers
        self._sliding_windows = {
            getattr(layer.self_attn, "sliding_window", None) for layer in layers if hasattr(layer, "self_attn")
        }
        self._slot_of_layer = {layer_id: slot for slot, layer_id in enumerate(self.layer_ids)}
        self.followers = followers  # rank 0 of a tensor-parallel group tells them of every capture first
        self._identity: str | None = None
        if is_sharded(self.base.embed_tokens.weight):
            # Gathering the embedding is a collective: hash it now, while every rank is here, not on first use.
            self._identity = target_identity(self.model.config, whole_tensor(self.base.embed_tokens.weight))

    @classmethod
    def load(
        cls,
        cfg: TargetConfig,
        layer_ids: list[int],
        capture_last_hidden: bool = False,
        group: TensorParallelGroup | None = None,
    ) -> Target:
        """Load the target described by ``cfg`` and prepare capture of ``layer_ids``; with ``group``, this
        rank's shards (every rank of the group calls this at the same point)."""
        model = load_target_model(cfg, tensor_parallel=group.size if group is not None else 1)
        return cls(
            model,
            layer_ids,
            capture_last_hidden=capture_last_hidden,
            attention=cfg.attention,
            compile=cfg.compile,
            followers=group if group is not None and group.rank == 0 else None,
        )

    @property
    def identity(self) -> str:
        """``target_identity`` of this model (hashed once, on first use)."""
        if self._identity is None:
            self._identity = target_identity(self.model.config, self.base.embed_tokens.weight)
        return self._identity

    def head_tensors(self) -> dict[str, torch.Tensor]:
        """embed_tokens, the final norm and lm_head, whole, by their checkpoint names (what the trainer
        shares with the target). Sharded ones are gathered: every rank of a group must call this."""
        tensors = {
            "model.embed_tokens.weight": self.base.embed_tokens.weight,
            "model.norm.weight": self.base.norm.weight,
            "lm_head.weight": self.model.get_output_embeddings().weight,
        }
        return {name: whole_tensor(tensor).detach() for name, tensor in tensors.items()}

    @torch.inference_mode()
    def capture(
        self, batch: PackedBatch, out_aux: torch.Tensor | None = None, out_last: torch.Tensor | None = None
    ) -> CapturedFeatures:
        """Run the packed forward and write the features into ``out_aux`` / ``out_last`` when given
        (e.g. views of a ring slot, ``[T, n * H]`` / ``[T, H]``, any float dtype), else into new tensors.

        The batch may live on the host (pinned memory makes the upload asynchronous). Nothing in here
        waits for the GPU except the ``sdpa`` backend when ``cu_seqlens`` is on the GPU.
        """
        total = batch.num_tokens
        if total == 0 or int(batch.cu_seqlens.numel()) < 2:
            raise ValueError("capture: empty batch")
        aux = self._output(out_aux, (total, self.aux_width), "out_aux")
        last = self._output(out_last, (total, self.hidden_size), "out_last") if self.capture_last_hidden else None
        if out_last is not None and not self.capture_last_hidden:
            raise ValueError("capture: out_last given but this Target was built without capture_last_hidden")
        if self.followers is not None:  # after the checks: once told, they run this forward whatever happens here
            self.followers.send_capture(batch.input_ids, batch.cu_seqlens)
        return self._forward(batch.input_ids, batch.cu_seqlens, aux, last)

    @torch.inference_mode()
    def capture_tokens(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> CapturedFeatures:
        """The forward of ``capture`` on bare token ids and document bounds, into new tensors: what a
        follower of a tensor-parallel group runs for each batch of rank 0."""
        total = int(input_ids.numel())
        aux = self._output(None, (total, self.aux_width), "out_aux")
        last = self._output(None, (total, self.hidden_size), "out_last") if self.capture_last_hidden else None
        return self._forward(input_ids, cu_seqlens, aux, last)

    def _forward(
        self, host_input_ids: torch.Tensor, host_cu_seqlens: torch.Tensor, aux: torch.Tensor, last: torch.Tensor | None
    ) -> CapturedFeatures:
        total = int(host_input_ids.numel())
        input_ids = host_input_ids.to(self.device, non_blocking=True)
        cu_seqlens = host_cu_seqlens.to(self.device, dtype=torch.int32, non_blocking=True)
        positions = position_ids(cu_seqlens, total=total).unsqueeze(0)
        packed = self._packed_attention(host_cu_seqlens, cu_seqlens, total)

        hidden = self.base.embed_tokens(input_ids).unsqueeze(0)
        rotary = self.base.rotary_emb(hidden, positions)
        for index, layer in enumerate(self._run_layer):
            hidden = layer(
                hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary, dflash_packed=packed
            )
            if isinstance(hidden, tuple):  # older transformers return (hidden_states, ...)
                hidden = hidden[0]
            slot = self._slot_of_layer.get(index)
            if slot is not None:
                aux[:, slot * self.hidden_size : (slot + 1) * self.hidden_size].copy_(hidden[0])
        if last is not None:
            last.copy_(hidden[0])
        return CapturedFeatures(aux, last)

    def warmup(self, num_tokens: int = 4096) -> None:
        """One throwaway capture (two documents of ``num_tokens`` in all) so compilation happens at start."""
        half = max(1, num_tokens // 2)
        cu = torch.tensor([0, half, num_tokens], dtype=torch.int32)
        batch = PackedBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.int32),
            loss_mask=torch.zeros(num_tokens, dtype=torch.uint8),
            cu_seqlens=cu,
            sample_ids=torch.arange(2),
        )
        self.capture(batch)

    def _output(self, given: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor:
        if given is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        if tuple(given.shape) != shape:
            raise ValueError(f"capture: {name} has shape {tuple(given.shape)}, expected {shape}")
        if not given.is_floating_point():
            raise ValueError(f"capture: {name} must be a floating-point tensor, got {given.dtype}")
        return given

    def _packed_attention(self, host_cu_seqlens: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> PackedAttention:
        packed = PackedAttention(self.attention, cu_seqlens, linear=self.linear or "per_document")
        if self.attention == "sdpa" or self.linear == "per_document":
            bounds = host_cu_seqlens.tolist()
            packed.document_bounds = tuple(zip(bounds[:-1], bounds[1:]))
        elif self.attention == "flex":
            doc = document_ids(cu_seqlens, total=total)
            packed.block_masks = {w: document_causal_block_mask(doc, w) for w in self._sliding_windows}
        return packed


def _prepare_token_mixers(model: nn.Module) -> bool:
    """Check that every decoder layer mixes tokens in a way packed capture keeps per document, and wrap
    the Gated-DeltaNet ones (producer/linear_attention.py). Whether the target is hybrid (has those)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    model_type = getattr(model.config, "model_type", type(model).__name__)
    hybrid = False
    for index, layer in enumerate(base.layers):
        linear = getattr(layer, "linear_attn", None)
        if linear is not None:
            if not is_gated_deltanet(linear):
                raise UnsupportedTarget(
                    f"target model type {model_type!r}: layer {index}'s linear_attn ({type(linear).__name__}) is not a "
                    "Gated-DeltaNet layer this producer can run per document (it needs "
                    f"{', '.join(p for p in ('in_proj_qkv', 'conv1d', 'A_log') if not hasattr(linear, p))})"
                )
            install_packed_forward(linear)
            hybrid = True
        elif not hasattr(layer, "self_attn"):
            children = ", ".join(name for name, _ in layer.named_children())
            raise UnsupportedTarget(
                f"target model type {model_type!r}: layer {index} ({type(layer).__name__}: {children}) has neither "
                "self_attn nor a Gated-DeltaNet linear_attn, so packed capture cannot keep its documents apart"
            )
    return hybrid


def compiles_by_default(model: nn.Module, device: torch.device, host_loop: bool, sharded: bool) -> bool:
    """Whether a Target compiles its layers when its config leaves ``compile`` unset: on CUDA, with no
    per-document host loop, unsharded, and without mixture-of-experts blocks."""
    return device.type == "cuda" and not host_loop and not sharded and not has_experts(model)


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` has mixture-of-experts blocks (transformers' experts modules; Qwen3.5/3.6-MoE, Qwen3-MoE).

    Such a target is not compiled unless asked: compiling its decoder layer takes minutes (torch 2.11), with the
    experts in the graph or kept out of it, where uncompiled it captures at once."""
    return any(hasattr(module, "num_experts") and hasattr(module, "gate_up_proj") for module in model.modules())


def flops_per_document(config, num_layers: int, length: int, with_lm_head: bool = False) -> float:
    """Forward FLOPs of one document: 2 * (matmul params used) * tokens + token mixing.

    Matmul params per layer: the attention projections (q doubled where a gate rides on it, as in
    Qwen3.5's gated attention) or a Gated-DeltaNet layer's in/out projections, and the gated MLP (a
    mixture-of-experts layer counts the experts a token uses and the shared expert). Norms, the
    convolution and embedding lookups are not matmuls. Token mixing per layer: causal attention,
    QK^T and PV over the L(L+1)/2 visible pairs, ``2 * 2 * L(L+1)/2 * heads * head_dim``; a
    Gated-DeltaNet layer reads and updates its ``[k, v]`` state per token and value head,
    ``4 * k * v`` FLOPs for each, plus the same for its output.
    """
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = config.num_key_value_heads
    layer_types = list(getattr(config, "layer_types", None) or [])[:num_layers]
    gated = getattr(config, "model_type", "") in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    q_width = heads * head_dim * (2 if gated else 1)
    attention_params = hidden * (q_width + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    if getattr(config, "num_experts", None):
        ffn = config.num_experts_per_tok * config.moe_intermediate_size + getattr(
            config, "shared_expert_intermediate_size", 0
        )
    else:
        ffn = config.intermediate_size
    mlp_params = 3 * hidden * ffn
    num_linear = sum(t == "linear_attention" for t in layer_types)
    num_full = num_layers - num_linear
    linear_params = linear_mixing = 0.0
    if num_linear:
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        value_dim = config.linear_num_value_heads * config.linear_value_head_dim
        linear_params = hidden * (2 * key_dim + 2 * value_dim + 2 * config.linear_num_value_heads) + value_dim * hidden
        linear_mixing = 2 * 4.0 * config.linear_key_head_dim * value_dim * length
    params = (
        num_full * attention_params
        + num_linear * linear_params
        + num_layers * mlp_params
        + (hidden * config.vocab_size if with_lm_head else 0)
    )
    attention = num_full * 2 * length * (length + 1) * heads * head_dim
    return 2.0 * params * length + attention + num_linear * linear_mixing


__all__ = [
    "TINY_TARGET_CONFIG",
    "CapturedFeatures",
    "PackedAttention",
    "Target",
    "TargetConfig",
    "UnsupportedTarget",
    "build_target_config",
    "check_tensor_parallel",
    "document_causal_block_mask",
    "flops_per_document",
    "load_target_model",
    "resolve_attention_backend",
    "resolve_device",
    "whole_tensor",
]

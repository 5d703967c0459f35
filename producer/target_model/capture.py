"""Packed capture: the target's forward over a packed batch of documents, writing the features a drafter needs.

Layer numbering follows docs/dflash.md: the feature of layer ``k`` is the OUTPUT of decoder layer ``k``,
which is ``hidden_states[k + 1]`` of a Hugging Face forward with ``output_hidden_states=True``.
``last_hidden`` is the output of the last decoder layer BEFORE the final norm; note that HF's
``hidden_states[-1]`` is NOT that: transformers overwrites its last entry with the normed output.

The packed forward does not call the HF model's ``forward``. It runs the embedding, the rotary
embedding (from per-document positions) and the decoder layers itself, and stops after the deepest
layer it needs: no later layers, no final norm, no lm_head, never logits. Attention is causal inside
each document and never crosses a document boundary (producer/target_model/attention.py).

Supported: decoder-only HF models whose base model is ``embed_tokens -> rotary_emb -> layers -> norm``
(Llama, Mistral, Qwen2, Qwen3 and their kin) and whose every decoder layer mixes tokens through
``self_attn`` (the attention interface) or a Gated-DeltaNet ``linear_attn`` (the hybrid Qwen3.5 /
Qwen3.6 family, dense or mixture-of-experts; producer/target_model/linear_attention.py restarts its convolution and
recurrent state at each document). Sliding-window layers are honoured. Anything else is refused at
load with ``UnsupportedTarget``, naming the model type and what is missing.

Tensor parallel (``Target.load(cfg, layer_ids, group=group)`` on every rank): the output of every decoder layer is
whole and identical on every rank after the row-wise all-reduce, so the captured features are those of the
unsharded model; rank 0 tells its followers of every capture first (producer/target_model/operations.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from common.batch import PackedBatch, document_ids, position_ids
from common.config import TargetConfig
from common.hf import target_identity
from producer.target_model.attention import (
    PACKED_ATTENTION_NAME,
    PackedAttention,
    document_causal_block_mask,
    register_packed_attention,
    resolve_attention_backend,
)
from producer.target_model.linear_attention import install_packed_forward, is_gated_deltanet, resolve_linear_backend
from producer.target_model.load import UnsupportedTarget, is_sharded, load_target_model, whole_tensor
from producer.target_model.operations import ALONE, Followers, Op

if TYPE_CHECKING:
    from producer.target_model.tensor_parallel import TensorParallelGroup

log = logging.getLogger(__name__)


class CapturedFeatures(NamedTuple):
    """What one packed forward produced (views of the caller's buffers when it gave them)."""

    aux_hidden: torch.Tensor
    """``[T, n * H]``: concat over ``layer_ids`` of the outputs of those decoder layers."""
    last_hidden: torch.Tensor | None
    """``[T, H]``: output of the last decoder layer before the final norm, when requested."""


class Target:
    """A loaded target that captures the drafter's features from packed batches.

    ``followers``: a tensor-parallel leader's (rank 0 of its group), told of every capture first.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: list[int],
        *,
        capture_last_hidden: bool = False,
        attention: str = "auto",
        compile: bool | None = None,
        followers: Followers | None = None,
    ) -> None:
        register_packed_attention()
        model.config._attn_implementation = PACKED_ATTENTION_NAME
        self.model = model
        self.base = _base_of(model)
        num_layers = len(self.base.layers)
        self.hybrid = _prepare_token_mixers(model)
        self.layer_ids = _checked_layer_ids(layer_ids, num_layers)
        self.capture_last_hidden = capture_last_hidden
        # The forward stops after the deepest captured layer (runs all of them for last_hidden).
        self.num_layers_run = num_layers if capture_last_hidden else self.layer_ids[-1] + 1
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.hidden_size = int(model.config.hidden_size)
        self.aux_width = len(self.layer_ids) * self.hidden_size
        host_loop = self._resolve_backends(attention)
        self.compiled = self._compiles(compile, host_loop)
        layers = list(self.base.layers[: self.num_layers_run])
        # One compiled graph serves every layer (their parameters are graph inputs); dynamic token counts.
        self._run_layer = [torch.compile(layer, dynamic=True) for layer in layers] if self.compiled else layers
        self._sliding_windows = {
            getattr(layer.self_attn, "sliding_window", None) for layer in layers if hasattr(layer, "self_attn")
        }
        self._slot_of_layer = {layer_id: slot for slot, layer_id in enumerate(self.layer_ids)}
        self.followers = followers if followers is not None else ALONE
        self._identity: str | None = None
        if is_sharded(self.base.embed_tokens.weight):
            # Gathering the embedding is a collective: hash it now, while every rank is here, not on first use.
            self._identity = target_identity(self.model.config, whole_tensor(self.base.embed_tokens.weight))

    def _resolve_backends(self, attention: str) -> bool:
        """Pick the attention and Gated-DeltaNet backends; whether either loops over documents on the host."""
        self.attention = resolve_attention_backend(attention, self.device, self.dtype)
        self.linear = resolve_linear_backend(self.device, self.dtype) if self.hybrid else None
        if self.linear == "per_document" and self.device.type == "cuda":
            log.warning(
                "Gated-DeltaNet layers run one document at a time (exact, slow): install flash-linear-attention "
                "(pip install -e '.[gpu]') for its varlen kernels"
            )
        return self.attention == "sdpa" or self.linear == "per_document"

    def _compiles(self, compile: bool | None, host_loop: bool) -> bool:
        """Whether the layers are compiled: as asked, else by ``compiles_by_default``."""
        # The per-document loops use host lengths: a compiled graph would specialise on every batch.
        if compile and host_loop:
            raise ValueError(
                "compile: not supported with attention 'sdpa' or Gated-DeltaNet layers run per document "
                "(use varlen or flex attention, and flash-linear-attention on a GPU)"
            )
        sharded = any(is_sharded(param) for param in self.model.parameters())
        # transformers' tensor-parallel hooks swap parameters and all-reduce inside each projection;
        # compiling through them is unverified, so a sharded target compiles only when asked to; nor does a
        # mixture-of-experts target (``has_experts``).
        compiled = compiles_by_default(self.model, self.device, host_loop, sharded) if compile is None else compile
        if compiled and has_experts(self.model):
            log.warning(
                "target.compile = true with a mixture-of-experts target: compiling its decoder layer did not "
                "finish in minutes on an H200 (torch 2.11, transformers 5.24); leave target.compile unset if the "
                "first batch does not come"
            )
        return compiled

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
        # After the checks: once told, the followers run this forward whatever happens here.
        self.followers.send(Op.CAPTURE, (batch.input_ids, batch.cu_seqlens))
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


def _base_of(model: nn.Module) -> nn.Module:
    """The decoder of ``model``, checked to have what the packed forward runs."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for part in ("embed_tokens", "rotary_emb", "layers"):
        if not hasattr(base, part):
            raise UnsupportedTarget(
                f"target model type {getattr(model.config, 'model_type', '?')!r} "
                f"({type(model).__name__}): its base model has no '{part}'; packed capture "
                "needs embed_tokens -> rotary_emb -> layers"
            )
    return base


def _checked_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    if (
        not layer_ids
        or sorted(set(layer_ids)) != list(layer_ids)
        or not 0 <= layer_ids[0] <= layer_ids[-1] < num_layers
    ):
        raise ValueError(f"layer_ids must be strictly increasing within [0, {num_layers}), got {layer_ids}")
    return list(layer_ids)


def _prepare_token_mixers(model: nn.Module) -> bool:
    """Check that every decoder layer mixes tokens in a way packed capture keeps per document, and wrap
    the Gated-DeltaNet ones (producer/target_model/linear_attention.py). Whether the target is hybrid (has those)."""
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

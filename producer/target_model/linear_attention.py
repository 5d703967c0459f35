"""Packed capture through Gated-DeltaNet (linear-attention) layers, documents kept independent.

A Gated-DeltaNet layer (Qwen3.5 / Qwen3.6, Qwen3-Next) mixes tokens through a short causal
convolution and a recurrent state, not through an attention kernel, so the packed attention of
producer/target_model/attention.py never reaches it. Run over a packed row as is, the convolution would see the
last tokens of the previous document and the state would carry over from it. Here both restart at
every document boundary:

- ``fla``: flash-linear-attention's varlen kernels (the ones transformers itself dispatches to for
  these layers), given the batch's ``cu_seqlens``: one launch for all documents. CUDA only.
- ``per_document``: the layer's own forward once per document, from a zero state: exactly the HF
  forward of each document alone. Any device; the reference.

The layer is not replaced: its ``forward`` is wrapped, and without packing (an ordinary HF forward
with a cache, as the acceptance evaluation runs) the original forward runs unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LINEAR_BACKENDS = ("fla", "per_document")
# What the packed path reads of a Gated-DeltaNet module (transformers' Qwen3_5GatedDeltaNet and kin).
GATED_DELTANET_PARTS = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_a",
    "in_proj_b",
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
)


def is_gated_deltanet(module: nn.Module) -> bool:
    """Whether ``module`` is a Gated-DeltaNet token mixer this module knows how to pack."""
    return all(hasattr(module, part) for part in GATED_DELTANET_PARTS)


def fla_available() -> bool:
    try:
        import fla.modules.convolution  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_linear_backend(device: torch.device, dtype: torch.dtype) -> str:
    """fla on CUDA in bf16/fp16 when flash-linear-attention is installed, else per_document."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fla_available():
        return "fla"
    return "per_document"


def install_packed_forward(module: nn.Module) -> None:
    """Wrap ``module.forward`` so that a ``dflash_packed`` keyword runs the packed path (idempotent)."""
    if getattr(module, "_dflash_original_forward", None) is not None:
        return
    original = module.forward
    module._dflash_original_forward = original

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, *args: Any, dflash_packed: Any = None, **kwargs: Any) -> torch.Tensor:
        if dflash_packed is None:
            return original(hidden_states, *args, **kwargs)
        return packed_gated_deltanet(module, original, hidden_states, dflash_packed)

    module.forward = forward


def packed_gated_deltanet(module: nn.Module, original, hidden: torch.Tensor, packed: Any) -> torch.Tensor:
    """``[1, T, H]`` -> ``[1, T, H]`` with the convolution and recurrent state restarted per document."""
    if hidden.shape[0] != 1:
        raise ValueError("packed linear attention expects one packed row (batch dimension 1)")
    if packed.linear == "fla":
        return _fla_varlen(module, hidden, packed.cu_seqlens)
    # The layer's own forward per document: no cache, no mask, so each starts from a zero state.
    return torch.cat([original(hidden[:, start:end]) for start, end in packed.document_bounds], dim=1)


def _fla_varlen(module: nn.Module, hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The Gated-DeltaNet forward of transformers' Qwen3.5 layer, with fla's varlen convolution and
    chunked delta rule over ``cu_seqlens`` (one sequence per document)."""
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    total = hidden.shape[1]
    cu = cu_seqlens.to(torch.long)
    mixed, _ = causal_conv1d(
        x=module.in_proj_qkv(hidden),
        weight=module.conv1d.weight.squeeze(1),
        bias=module.conv1d.bias,
        activation=module.activation,
        cu_seqlens=cu,
    )
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(1, total, -1, module.head_k_dim)
    key = key.reshape(1, total, -1, module.head_k_dim)
    value = value.reshape(1, total, -1, module.head_v_dim)
    beta = module.in_proj_b(hidden).sigmoid()
    # As transformers: in fp32, else A may overflow in fp16.
    g = -module.A_log.float().exp() * F.softplus(module.in_proj_a(hidden).float() + module.dt_bias)
    core, _ = chunk_gated_delta_rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu,
    )
    z = module.in_proj_z(hidden).reshape(-1, module.head_v_dim)
    core = module.norm(core.reshape(-1, module.head_v_dim), z).reshape(1, total, -1)
    return module.out_proj(core)

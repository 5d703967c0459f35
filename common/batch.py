"""The packed batch: what a producer writes into a ring slot and a trainer consumes.

A batch is a concatenation of whole documents with no padding. Documents are delimited by
``cu_seqlens`` (cumulative lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``).
Positions restart at 0 in every document; attention never crosses a document boundary.

Tensor names and dtypes are fixed here so both sides agree:

=============  ==========  ============  ==============================================
name           dtype       shape         meaning
=============  ==========  ============  ==============================================
input_ids      int32       [T]           token ids
loss_mask      uint8       [T]           1 where the token is a training target (assistant)
cu_seqlens     int32       [D + 1]       document boundaries
sample_ids     int64       [D]           global id of each document in the data set
aux_hidden     bf16/fp16   [T, n * H]    concat of the outputs of decoder layers
                                         ``target_layer_ids`` (hidden_states[k + 1] in HF)
last_hidden    bf16/fp16   [T, H]        optional: last decoder layer output, before norm
=============  ==========  ============  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

TENSOR_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "cu_seqlens": torch.int32,
    "sample_ids": torch.int64,
}


@dataclass
class Document:
    """One document: token ids and the mask of tokens that are training targets."""

    sample_id: int
    input_ids: np.ndarray
    """int32 [L]"""
    loss_mask: np.ndarray
    """uint8 [L], 1 on target tokens (assistant turns)"""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class PackedBatch:
    """One token-budget batch of whole documents, packed without padding."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    cu_seqlens: torch.Tensor
    sample_ids: torch.Tensor
    aux_hidden: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    epoch: int = 0
    """Epoch of the data order these documents come from."""
    meta: dict = field(default_factory=dict)
    """Small msgpack-able extras (producer id, batch sequence number, cursor, ...)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_docs(self) -> int:
        return int(self.sample_ids.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors of this batch (the optional ones only when present)."""
        out = {
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "cu_seqlens": self.cu_seqlens,
            "sample_ids": self.sample_ids,
        }
        if self.aux_hidden is not None:
            out["aux_hidden"] = self.aux_hidden
        if self.last_hidden is not None:
            out["last_hidden"] = self.last_hidden
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], epoch: int = 0, meta: dict | None = None) -> PackedBatch:
        return cls(
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            cu_seqlens=tensors["cu_seqlens"],
            sample_ids=tensors["sample_ids"],
            aux_hidden=tensors.get("aux_hidden"),
            last_hidden=tensors.get("last_hidden"),
            epoch=epoch,
            meta=dict(meta or {}),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return PackedBatch.from_tensors(moved, self.epoch, self.meta)


def document_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document index of every token, ``[T]`` int32, from ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def position_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Position of every token inside its own document, ``[T]`` int64."""
    total = int(cu_seqlens[-1]) if total is None else total
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts

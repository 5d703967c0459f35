"""The packed batch: what a producer writes into a ring slot and a trainer consumes.

A batch is a concatenation of whole documents with no padding. Documents are delimited by
``cu_seqlens`` (cumulative lengths, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] == T``).
Positions restart at 0 in every document; attention never crosses a document boundary.

``SLOT_TENSORS`` below is the one description of a slot's tensors. The producer's slot sizes and
writes, the consumer's validation (common/batchcheck.py), the trainer's padding and PackedBatch
all derive from it: adding a tensor to the slot is one entry there (tests/test_slot_schema.py
adds one and follows it through a ring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from common.codec import TensorSpec, bytes_needed, plan_layout, read_tensors

Rows = Literal["tokens", "docs", "boundaries"]


@dataclass(frozen=True)
class SlotTensor:
    """One tensor of a ring slot."""

    name: str
    meaning: str
    rows: Rows
    """Its first dimension: one row per token, per document, or per document boundary (documents + 1)."""
    dtype: torch.dtype | None
    """Its dtype; None: the features' dtype, which the producer announces (``Features.dtype``)."""
    width: Literal["aux", "hidden"] | None = None
    """Its second dimension, for features: all captured layers side by side (``len(layer_ids) * hidden_size``),
    or one hidden state (``hidden_size``). None: the tensor is 1-d."""
    when_announced: str | None = None
    """The ``Features`` flag that must be true for the tensor to travel; None: every batch has it."""
    source: Literal["documents", "target"] = "documents"
    """Who writes it: the producer from the batch of documents, or the target's forward (``Target.capture``)."""
    derive: Callable[[dict[str, torch.Tensor]], torch.Tensor] | None = None
    """For a documents tensor the data loader does not make: how to compute it from the loader's tensors."""
    pad: int = 0
    """Value of the padding rows (``pad_packed``). A boundaries tensor is padded with the padded total instead."""

    def shape(self, dims: SlotDims) -> tuple[int, ...]:
        rows = {"tokens": dims.tokens, "docs": dims.docs, "boundaries": dims.docs + 1}[self.rows]
        if self.width is None:
            return (rows,)
        return (rows, dims.aux_width if self.width == "aux" else dims.hidden_size)

    def present(self, announced: dict[str, bool]) -> bool:
        """Whether batches carry this tensor, given the producer's flags (``Features`` fields)."""
        return self.when_announced is None or bool(announced.get(self.when_announced))


SLOT_TENSORS: tuple[SlotTensor, ...] = (
    SlotTensor("input_ids", "token ids", "tokens", torch.int32),
    SlotTensor("loss_mask", "1 where the token is a training target (assistant)", "tokens", torch.uint8),
    SlotTensor("cu_seqlens", "document boundaries", "boundaries", torch.int32),
    SlotTensor("sample_ids", "global id of each document in the data set", "docs", torch.int64, pad=-1),
    SlotTensor(
        "aux_hidden",
        "outputs of the decoder layers target_layer_ids, side by side (hidden_states[k + 1] in HF)",
        "tokens",
        None,
        width="aux",
        source="target",
    ),
    SlotTensor(
        "last_hidden",
        "last decoder layer's output, before the final norm (target-distribution labels)",
        "tokens",
        None,
        width="hidden",
        when_announced="last_hidden",
        source="target",
    ),
)
"""The slot's tensors, in slot order."""


@dataclass(frozen=True)
class SlotDims:
    """The sizes a slot's shapes are made of."""

    tokens: int
    docs: int
    aux_width: int
    hidden_size: int


def slot_tensors() -> tuple[SlotTensor, ...]:
    """``SLOT_TENSORS``, read at call time (so that a test may add one)."""
    return SLOT_TENSORS


def slot_shapes(
    dims: SlotDims, feature_dtype: torch.dtype, announced: dict[str, bool]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor a batch of ``dims`` carries, in slot order."""
    return {t.name: (t.shape(dims), t.dtype or feature_dtype) for t in slot_tensors() if t.present(announced)}


@dataclass(frozen=True)
class SlotFormat:
    """What a producer's slots hold besides the documents: the features' widths and dtype, and whether the
    last hidden state travels. With a batch's tokens and documents it gives every tensor's shape."""

    aux_width: int
    hidden_size: int
    feature_dtype: torch.dtype
    last_hidden: bool

    def shapes(self, tokens: int, docs: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every tensor a batch of ``tokens`` in ``docs`` documents carries, in slot order."""
        dims = SlotDims(tokens=tokens, docs=docs, aux_width=self.aux_width, hidden_size=self.hidden_size)
        return slot_shapes(dims, self.feature_dtype, {"last_hidden": self.last_hidden})

    def slot_bytes(self, tokens: int, docs: int) -> int:
        """Bytes of a slot that holds any batch of at most ``tokens`` in ``docs`` documents."""
        return bytes_needed(self.shapes(tokens, docs))

    def lay_out(
        self, slot: torch.Tensor, batch: PackedBatch, non_blocking: bool = False
    ) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
        """Lay ``batch`` out in the flat uint8 ``slot`` and copy its documents tensors in: the layout, and views
        of every tensor (the target's features are still to be written). SlotOverflow names the bytes needed."""
        shapes = self.shapes(batch.num_tokens, batch.num_docs)
        documents = document_tensors(batch.tensors())
        layout = plan_layout(shapes, slot.numel())
        views = read_tensors(slot, layout)
        for name, tensor in documents.items():
            views[name].copy_(tensor, non_blocking=non_blocking)
        return layout, views


def document_tensors(loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The documents tensors of a slot from the data loader's batch (``pack_documents``), derived ones made."""
    out = {}
    for t in slot_tensors():
        if t.source == "documents":
            out[t.name] = t.derive(loaded) if t.derive is not None else loaded[t.name]
    return out


def pad_packed(tensors: dict[str, torch.Tensor], total: int) -> dict[str, torch.Tensor]:
    """Pad a packed batch to ``total`` tokens with one extra document that no block can see.

    Fixed shapes let compiled kernels (and flex attention) be built once instead of once per
    batch length. The padding has no loss tokens, so it never holds an anchor, and attention
    never crosses documents, so no real block sees it.
    """
    extra = total - int(tensors["input_ids"].numel())
    if extra <= 0:
        return tensors
    out = dict(tensors)
    for t in slot_tensors():
        tensor = tensors.get(t.name)
        if tensor is None:
            continue
        rows = {"tokens": extra, "docs": 1, "boundaries": 1}[t.rows]
        value = total if t.rows == "boundaries" else t.pad
        out[t.name] = torch.cat([tensor, tensor.new_full((rows, *tensor.shape[1:]), value)])
    return out


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
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """The slot's other tensors (``SLOT_TENSORS`` entries the drafter does not read by attribute)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_docs(self) -> int:
        return int(self.sample_ids.numel())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors of this batch in slot order (the optional ones only when present)."""
        out = {}
        for t in slot_tensors():
            tensor = self.extra.get(t.name) if t.name not in _FIELDS else getattr(self, t.name)
            if tensor is not None:
                out[t.name] = tensor
        return {**out, **{name: t for name, t in self.extra.items() if name not in out}}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], epoch: int = 0, meta: dict | None = None) -> PackedBatch:
        fields = {name: tensors.get(name) for name in _FIELDS}
        extra = {name: t for name, t in tensors.items() if name not in _FIELDS}
        return cls(**fields, epoch=epoch, meta=dict(meta or {}), extra=extra)

    def pin_memory(self) -> PackedBatch:
        """This batch in page-locked host memory, for copies to a GPU that do not wait."""
        return PackedBatch.from_tensors({k: v.pin_memory() for k, v in self.tensors().items()}, self.epoch, self.meta)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return PackedBatch.from_tensors(moved, self.epoch, self.meta)


_FIELDS = ("input_ids", "loss_mask", "cu_seqlens", "sample_ids", "aux_hidden", "last_hidden")
"""The slot tensors PackedBatch holds as attributes."""


def document_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document index of every token, ``[T]`` int32, from ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def position_ids(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Position of every token inside its own document, ``[T]`` int64."""
    total = int(cu_seqlens[-1]) if total is None else total
    starts = torch.repeat_interleave(
        cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=total
    )
    return torch.arange(total, device=cu_seqlens.device) - starts

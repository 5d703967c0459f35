"""Named tensors in a ring slot: the layout a producer writes and a consumer reads back.

A slot is a flat byte buffer. ``write_tensors`` copies each tensor to an aligned offset and
returns its ``TensorSpec`` list; the list travels in the batch announcement and
``read_tensors`` turns it back into zero-copy views. Every spec is checked against the slot
bounds before any view is made, so a hostile announcement can never point outside the slot.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

ALIGN = 256
"""Byte alignment of each tensor in a slot (covers every dtype and 128-byte GPU transactions)."""

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The only dtypes a slot may hold, by name (names on the wire, never evaluated)."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
MAX_TENSORS = 16
MAX_DIMS = 8
MAX_SIZE = 1 << 40
MAX_OFFSET = 1 << 50


class SlotOverflow(ValueError):
    """The tensors do not fit into one slot."""


class LayoutError(ValueError):
    """A tensor layout is malformed or points outside its slot."""


class TensorSpec(NamedTuple):
    """Where one named tensor lies in a slot (a tuple: cheap to build for every announcement)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset]

    @classmethod
    def from_wire(cls, item: object) -> TensorSpec:
        if type(item) not in (list, tuple) or len(item) != 4:
            raise LayoutError(f"tensor spec must be [name, dtype, shape, offset], got {type(item).__name__}")
        name, dtype, shape, offset = item
        if type(name) is not str or not 0 < len(name) <= 64:
            raise LayoutError("tensor name must be a string of 1..64 characters")
        if type(dtype) is not str or dtype not in DTYPES:
            raise LayoutError(f"tensor {name!r}: unknown dtype {repr(dtype)[:32]}")
        if type(shape) not in (list, tuple) or len(shape) > MAX_DIMS:
            raise LayoutError(f"tensor {name!r}: shape must be a list of at most {MAX_DIMS} sizes")
        span = 1
        for size in shape:
            if type(size) is not int or not 0 <= size < MAX_SIZE:
                raise LayoutError(f"tensor {name!r}: sizes must be integers in [0, 2**40)")
            span *= max(size, 1)
        if span >= MAX_SIZE:
            # Even when another size is 0 (no elements): the strides must fit in 64 bits.
            raise LayoutError(f"tensor {name!r}: sizes multiply to {span}, more than 2**40 elements")
        if type(offset) is not int or not 0 <= offset < MAX_OFFSET or offset % ALIGN:
            raise LayoutError(f"tensor {name!r}: offset must be a multiple of {ALIGN} in [0, 2**50)")
        return cls(name, dtype, tuple(shape), offset)


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bytes_needed(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Slot bytes needed for tensors of these shapes and dtypes."""
    return sum(aligned(math.prod(shape) * dtype.itemsize) for shape, dtype in shapes.values())


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    step = 1
    for dim in range(len(shape) - 1, -1, -1):
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def _views(slot: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of ``specs`` in the flat uint8 ``slot``, each checked to lie inside it, apart from the others.

    One ``as_strided`` per tensor on a typed view of the slot (one per dtype) instead of a slice and
    two views: this runs for every batch on the latency path.
    """
    if slot.dtype != torch.uint8 or slot.dim() != 1:
        raise TypeError("slot must be a flat uint8 tensor")
    if len(specs) > MAX_TENSORS:
        raise LayoutError(f"at most {MAX_TENSORS} tensors per slot, got {len(specs)}")
    size = slot.numel()
    typed: dict[torch.dtype, torch.Tensor] = {}
    taken: list[tuple[int, int]] = []
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        itemsize = dtype.itemsize
        end = spec.offset + math.prod(spec.shape) * itemsize
        if end > size:
            raise LayoutError(f"tensor {spec.name!r} ends at byte {end}, past the slot's {size}")
        if spec.name in out:
            raise LayoutError(f"tensor {spec.name!r} appears twice")
        if end > spec.offset and any(spec.offset < e and s < end for s, e in taken):
            raise LayoutError(f"tensor {spec.name!r} overlaps another tensor")
        taken.append((spec.offset, end))
        base = typed.get(dtype)
        if base is None:
            if size % itemsize or slot.storage_offset() % itemsize:
                raise LayoutError(
                    f"a slot of {size} bytes at byte {slot.storage_offset()} cannot hold {spec.dtype} tensors"
                )
            base = typed[dtype] = slot.view(dtype)
        out[spec.name] = base.as_strided(
            spec.shape, _contiguous_strides(spec.shape), base.storage_offset() + spec.offset // itemsize
        )
    return out


def plan_layout(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], slot_bytes: int) -> list[TensorSpec]:
    """Offsets for tensors of these shapes in a slot of ``slot_bytes``; SlotOverflow names the bytes needed."""
    if len(shapes) > MAX_TENSORS:
        raise SlotOverflow(f"at most {MAX_TENSORS} tensors per slot, got {len(shapes)}")
    specs: list[TensorSpec] = []
    offset = 0
    for name, (shape, dtype) in shapes.items():
        if dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {dtype} cannot travel through a slot")
        spec = TensorSpec(name, DTYPE_NAMES[dtype], tuple(shape), offset)
        offset = aligned(offset + spec.nbytes)
        specs.append(spec)
    needed = specs[-1].offset + specs[-1].nbytes if specs else 0
    if needed > slot_bytes:
        raise SlotOverflow(f"batch needs {needed} bytes but a slot holds {slot_bytes}")
    return specs


def write_tensors(slot: torch.Tensor, tensors: dict[str, torch.Tensor], non_blocking: bool = False) -> list[TensorSpec]:
    """Copy ``tensors`` into the flat uint8 ``slot``; return their layout.

    Non-contiguous tensors are fine (``copy_`` gathers them). Raises SlotOverflow, naming the
    bytes needed, when they do not fit.
    """
    specs = plan_layout({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, slot.numel())
    for view, tensor in zip(_views(slot, specs).values(), tensors.values()):
        if view.numel():
            view.copy_(tensor, non_blocking=non_blocking)
    return specs


def read_tensors(slot: torch.Tensor, specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Zero-copy views of the tensors described by ``specs``; every spec is bounds-checked first."""
    return _views(slot, specs)

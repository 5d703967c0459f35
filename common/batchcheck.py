"""A consumer's check that a delivered batch keeps the packed-batch contract (common/batch.py).

The wire protocol already guarantees that a batch's tensors lie inside its slot. This checks what
the trainer relies on beyond that, against the producer's WELCOME description: the tensor names,
dtypes and shapes agree with each other, document boundaries are sane, token ids index the
vocabulary, and the metadata the exactly-once bookkeeping reads is there with the right types.
A batch that fails is dropped by the RingClient (acked, its credit returned), never trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from common.batch import SlotTensor, slot_tensors
from common.codec import DTYPES
from common.contract import BatchMeta, ContractError

if TYPE_CHECKING:
    from common.transport import Delivery


class BatchContractError(ValueError):
    """A delivered batch does not keep the packed-batch contract; the message names what."""


def check_batch(meta: dict, tensors: dict[str, torch.Tensor], describe: dict) -> None:
    """Raise BatchContractError unless ``meta`` and ``tensors`` make a trainable packed batch.

    ``describe`` is the producer's WELCOME description; its ``dtype``, ``last_hidden``,
    ``layer_ids`` x ``hidden_size``, ``vocab_size`` and ``token_budget`` are checked when present.
    Reads only ``cu_seqlens`` and ``input_ids`` (a few KiB), never the features.
    """
    try:
        announced = BatchMeta.from_wire(meta)
    except ContractError as exc:
        raise BatchContractError(str(exc)) from None

    tokens, docs = announced.tokens, announced.docs
    budget = describe.get("token_budget")
    if type(budget) is int and tokens > budget:
        raise BatchContractError(f"{tokens} tokens exceed the producer's token budget {budget}")
    hidden = describe.get("hidden_size") if type(describe.get("hidden_size")) is int else None
    layers = describe.get("layer_ids") if type(describe.get("layer_ids")) is list else None
    feature_dtype = DTYPES.get(describe.get("dtype")) if type(describe.get("dtype")) is str else None
    widths = {"aux": len(layers) * hidden if layers is not None and hidden is not None else None, "hidden": hidden}
    announced_flags = {key: value is True for key, value in describe.items()}
    for entry in slot_tensors():
        tensor = tensors.get(entry.name)
        if not entry.present(announced_flags):
            if tensor is not None:
                raise BatchContractError(
                    f"tensor {entry.name!r} was not announced (describe.{entry.when_announced} is not true)"
                )
            continue
        _check_tensor(entry, tensor, tokens, docs, widths, feature_dtype)
    unknown = tensors.keys() - {entry.name for entry in slot_tensors()}
    if unknown:
        raise BatchContractError(f"unexpected tensors {sorted(unknown)}")

    cu = tensors["cu_seqlens"].tolist()
    if cu[0] != 0 or cu[-1] != tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise BatchContractError(f"cu_seqlens must rise from 0 to {tokens}")
    vocab = describe.get("vocab_size")
    if tokens and type(vocab) is int:
        ids = tensors["input_ids"]
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise BatchContractError(f"token ids span [{low}, {high}], outside the vocabulary of {vocab}")


def check_delivery(delivery: Delivery, describe: dict) -> None:
    """``check_batch`` for a ``common.transport.Delivery``: the RingClient's ``accept`` hook."""
    check_batch(delivery.meta, delivery.tensors, describe)


def _check_tensor(
    entry: SlotTensor,
    tensor: torch.Tensor | None,
    tokens: int,
    docs: int,
    widths: dict[str, int | None],
    feature_dtype: torch.dtype | None,
) -> None:
    """Raise unless ``tensor`` has the shape and dtype ``entry`` gives a batch of ``tokens`` in ``docs``."""
    rows = {"tokens": tokens, "docs": docs, "boundaries": docs + 1}[entry.rows]
    dims = 1 if entry.width is None else 2
    if tensor is None:
        raise BatchContractError(f"tensor {entry.name!r} is missing")
    if tensor.dim() != dims or tensor.shape[0] != rows:
        wanted = f"[{rows}]" if dims == 1 else f"[{rows}, width]"
        raise BatchContractError(
            f"tensor {entry.name!r} has shape {list(tensor.shape)}; meta announces {tokens} tokens "
            f"in {docs} documents, so it must be {wanted}"
        )
    columns = widths.get(entry.width) if entry.width is not None else None
    if columns is not None and tensor.shape[1] != columns:
        raise BatchContractError(
            f"tensor {entry.name!r} has {tensor.shape[1]} columns, the producer announced {columns}"
        )
    dtype = entry.dtype or feature_dtype
    if dtype is not None and tensor.dtype != dtype:
        raise BatchContractError(f"tensor {entry.name!r} is {tensor.dtype}, it must be {dtype}")

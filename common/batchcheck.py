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

from common.batch import TENSOR_DTYPES
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

    for name, dtype in TENSOR_DTYPES.items():
        tensor = tensors.get(name)
        if tensor is None or tensor.dtype != dtype or tensor.dim() != 1:
            raise BatchContractError(f"tensor {name!r} must be a 1-d {dtype} tensor")
    tokens = tensors["input_ids"].numel()
    docs = tensors["sample_ids"].numel()
    if tensors["loss_mask"].numel() != tokens:
        raise BatchContractError(f"loss_mask has {tensors['loss_mask'].numel()} entries for {tokens} tokens")
    if tensors["cu_seqlens"].numel() != docs + 1:
        raise BatchContractError(f"cu_seqlens has {tensors['cu_seqlens'].numel()} entries for {docs} documents")
    if (announced.tokens, announced.docs) != (tokens, docs):
        raise BatchContractError(f"meta announces {announced.tokens} tokens in {announced.docs} documents, "
                                 f"the tensors hold {tokens} in {docs}")
    budget = describe.get("token_budget")
    if type(budget) is int and tokens > budget:
        raise BatchContractError(f"{tokens} tokens exceed the producer's token budget {budget}")

    feature_dtype = DTYPES.get(describe.get("dtype")) if type(describe.get("dtype")) is str else None
    width = None
    if type(describe.get("layer_ids")) is list and type(describe.get("hidden_size")) is int:
        width = len(describe["layer_ids"]) * describe["hidden_size"]
    expected = {"aux_hidden": width}
    if describe.get("last_hidden") is True:
        expected["last_hidden"] = describe.get("hidden_size")
    elif "last_hidden" in tensors:
        raise BatchContractError("tensor 'last_hidden' was not announced (describe.last_hidden is false)")
    for name, columns in expected.items():
        tensor = tensors.get(name)
        if tensor is None or tensor.dim() != 2 or tensor.shape[0] != tokens:
            raise BatchContractError(f"tensor {name!r} must be [{tokens}, width]")
        if columns is not None and tensor.shape[1] != columns:
            raise BatchContractError(f"tensor {name!r} has {tensor.shape[1]} columns, the producer announced {columns}")
        if feature_dtype is not None and tensor.dtype != feature_dtype:
            raise BatchContractError(f"tensor {name!r} is {tensor.dtype}, the producer announced {feature_dtype}")
    unknown = tensors.keys() - TENSOR_DTYPES.keys() - expected.keys()
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

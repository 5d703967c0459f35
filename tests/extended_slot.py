"""Runs a module with one more tensor in the slot schema: ``python -m tests.extended_slot MODULE ARGS...``.

The tensor (``token_positions``, each token's position in its document) is added the way a developer
would add one: a single ``SlotTensor`` entry in ``common.batch.SLOT_TENSORS``. Nothing else changes.
"""

from __future__ import annotations

import runpy
import sys

import torch

from common import batch

TOKEN_POSITIONS = batch.SlotTensor(
    "token_positions",
    "position of each token in its document",
    "tokens",
    torch.int32,
    derive=lambda loaded: batch.position_ids(loaded["cu_seqlens"]).to(torch.int32),
)


def extend() -> None:
    """Add ``token_positions`` to the slot schema of this process."""
    if TOKEN_POSITIONS not in batch.SLOT_TENSORS:
        batch.SLOT_TENSORS = (*batch.SLOT_TENSORS, TOKEN_POSITIONS)


if __name__ == "__main__":
    extend()
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

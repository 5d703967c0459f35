"""The target's operations that a tensor-parallel follower mirrors: one table, shared by the leader's engines and the
followers' loop.

A sharded target all-reduces inside its projections, so every rank must run each of its forwards, in the same order,
on its own shards, and keep its own KV cache in step. The engines (``Target``'s packed capture,
producer/target_model/capture.py; ``GreedyTarget``'s cached forwards, producer/target_model/greedy.py) tell their ``followers``
each operation and its arguments before they run it; a follower (producer/target_model/follower.py) looks the operation up
here and makes the same call on its own engine. Generation (producer/target_model/generator.py) has no row: it never runs
sharded (its static cache refuses tensor-parallel shards, and synthesis loads one device's target).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Op(enum.IntEnum):
    """What the leader tells its followers: wait on, stop, or run one operation of ``OPERATIONS``."""

    IDLE = 0
    STOP = 1
    CAPTURE = 2
    RESET = 3
    FORWARD = 4
    FORWARD_ROWS = 5
    CROP = 6
    SAVE_STATE = 7
    RESTORE_STATE = 8
    DETACH = 9


CAPTURE_ENGINE = "capture"
"""A rank's ``Target``: the packed forward over a batch's documents."""
GREEDY_ENGINE = "greedy"
"""A rank's ``GreedyTarget`` over the same model: forwards through a KV cache (producer 0's evaluations)."""


@dataclass(frozen=True)
class Operation:
    """One row of the table: which engine of a rank runs it, and which of its methods."""

    engine: str
    method: str
    on_host: bool = False
    """Tensor arguments stay on the host (the engine uploads them itself); else they go to the engine's device."""


OPERATIONS: dict[Op, Operation] = {
    Op.CAPTURE: Operation(CAPTURE_ENGINE, "capture_tokens", on_host=True),
    Op.RESET: Operation(GREEDY_ENGINE, "reset"),
    Op.FORWARD: Operation(GREEDY_ENGINE, "forward"),
    Op.FORWARD_ROWS: Operation(GREEDY_ENGINE, "forward_rows"),
    Op.CROP: Operation(GREEDY_ENGINE, "crop"),
    Op.SAVE_STATE: Operation(GREEDY_ENGINE, "save_state"),
    Op.RESTORE_STATE: Operation(GREEDY_ENGINE, "restore_state"),
    Op.DETACH: Operation(GREEDY_ENGINE, "detach"),
}
"""Every operation a follower mirrors. Arguments are ints, bools and int64 or bool tensors (what travels)."""


class Followers(Protocol):
    """Where an engine tells its operations: a leader's followers (``TensorParallelGroup``), or ``ALONE``."""

    def send(self, op: Op, args: tuple) -> None:
        """Have every follower run ``op`` with ``args`` on its engine; returns once it is sent."""
        ...


class _Alone:
    """No followers: an unsharded target, or a follower's own engines (they tell no one)."""

    def send(self, op: Op, args: tuple) -> None:
        pass


ALONE: Followers = _Alone()

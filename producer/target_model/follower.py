"""A follower of a tensor-parallel producer (a rank > 0): it runs every operation rank 0 tells it
(producer/target_model/operations.py) on its own shards, until STOP.

Rank 0 runs the data, the ring and producer 0's evaluations (decoding and the drafter); the sharded target's forwards
need every rank, so each operation reaches the followers first, and every follower makes the same call on the same
engine of its own (its ``Target``, or a ``GreedyTarget`` over the same model with its own cache). Only rank 0 reads
the results.

Failures: torchrun ends the whole group when any rank exits. A follower whose rank 0 died gets an
error from its pending broadcast at once and exits; one told to stop (SIGTERM from torchrun, or from
the kernel when torchrun dies) waits ``FOLLOWER_STOP_GRACE_S`` for rank 0's STOP, since leaving in
the middle of a forward would hang rank 0's next all-reduce, and then leaves anyway.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from producer.target_model.capture import Target
from producer.target_model.greedy import GreedyTarget
from producer.target_model.operations import CAPTURE_ENGINE, GREEDY_ENGINE, OPERATIONS, Op
from producer.target_model.tensor_parallel import TensorParallelGroup

log = logging.getLogger(__name__)

# Below torchrun's shutdown timeout (the launcher sets it), so torchrun need not SIGKILL a follower.
FOLLOWER_STOP_GRACE_S = 20.0


class FollowerEngines:
    """A follower's engines by the table's names: its ``Target``, and the greedy target over the same model, made
    when rank 0 first evaluates."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._greedy: GreedyTarget | None = None

    def engine(self, name: str) -> Any:
        if name == CAPTURE_ENGINE:
            return self.target
        if name == GREEDY_ENGINE:
            if self._greedy is None:
                target = self.target
                self._greedy = GreedyTarget(target.model, target.layer_ids, target.capture_last_hidden)
            return self._greedy
        raise ValueError(f"no engine {name!r} on a follower")

    def run(self, op: Op, args: list) -> None:
        """Make the call ``op`` names on its engine (``OPERATIONS``), with rank 0's arguments."""
        operation = OPERATIONS[op]
        engine = self.engine(operation.engine)
        if not operation.on_host:
            args = [arg.to(engine.device) if isinstance(arg, torch.Tensor) else arg for arg in args]
        getattr(engine, operation.method)(*args)


def follow(group: TensorParallelGroup, target: Target) -> int:
    """Run every operation rank 0 asks for until it says STOP; the process's exit code.

    The loop runs in a thread: a Python signal handler runs only in the main thread and only between
    calls into C, never while that thread waits inside a collective, so the main thread stays free to
    notice SIGTERM and to leave if rank 0 does not send STOP within ``FOLLOWER_STOP_GRACE_S``.
    """
    outcome: list[int] = []
    signalled_at: list[float] = []

    def on_signal(signum: int, _frame: object) -> None:
        if not signalled_at:
            log.info(
                "rank %d: signal %d, waiting up to %.0f s for rank 0's STOP", group.rank, signum, FOLLOWER_STOP_GRACE_S
            )
            signalled_at.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker = threading.Thread(target=_follow_loop, args=(group, target, outcome), name="follower", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        if signalled_at and time.monotonic() - signalled_at[0] > FOLLOWER_STOP_GRACE_S and worker.is_alive():
            log.warning("rank %d: no STOP from rank 0 in %.0f s: leaving", group.rank, FOLLOWER_STOP_GRACE_S)
            logging.shutdown()
            os._exit(1)  # the loop thread is stuck in a collective: a normal exit would wait for it
    return outcome[0] if outcome else 1


def _follow_loop(group: TensorParallelGroup, target: Target, outcome: list[int]) -> None:
    """Rank 0's operations, one by one, until STOP (0 in ``outcome``) or a broken group (1)."""
    try:
        if target.device.type == "cuda":
            torch.cuda.set_device(target.device)  # the current device is per thread
        engines = FollowerEngines(target)
        captures = 0
        while True:
            op, args = group.receive()
            if op is Op.STOP:
                log.info("rank %d: STOP from rank 0 after %d forwards", group.rank, captures)
                outcome.append(0)
                return
            if op in OPERATIONS:
                engines.run(op, args)
                captures += op is Op.CAPTURE
    except Exception:  # rank 0 is gone (its end of the group closed) or the group broke
        log.exception("rank %d: lost rank 0", group.rank)
        outcome.append(1)

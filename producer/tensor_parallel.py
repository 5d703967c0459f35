"""One producer whose target is sharded over several devices (tensor parallelism), under torchrun.

    python -m launch.torchrun --standalone --nproc-per-node 2 -m producer.server --run-dir DIR --producer-id 0 --device cuda:2,cuda:3

(the launcher runs this for an entry of ``launch.producer_devices`` that names several devices;
``launch.torchrun`` is torchrun that passes a rank's configuration error on as exit 2).

Every rank loads its shards with transformers' tensor-parallel plan (producer/target.py). Rank 0 is
the producer: data, batching, ring, sockets, status, exactly as with one device. Ranks > 0 are
followers: they run the same forward on the same batch, whose all-reduces need them, and keep
nothing: each decoder layer's output is whole on every rank, and only rank 0 writes it to its ring.

Control: before each forward rank 0 broadcasts a header (op, token count, document count), then the
token ids and document bounds. These travel in a gloo group of their own, on the CPU: a follower
waiting for work holds no GPU kernel and no NCCL watchdog, and the TP all-reduces keep their group.
While it runs no forward (full ring, no trainer, possibly for hours) rank 0 sends IDLE at least
every ``keepalive_interval_s``, so no follower's wait comes near the collective timeout. STOP ends them.

Evaluation: producer 0 evaluates the trainer's drafters between batches (producer/server.py). Rank 0 runs
the decoding and the drafter; the sharded target's forwards need every rank, so each call of the greedy
target that runs the model or changes its KV cache (``MirroredTarget``) is sent as EVAL first, and every
follower makes the same call on its shards and its own cache. Only rank 0 reads the results.

Failures: torchrun ends the whole group when any rank exits. A follower whose rank 0 died gets an
error from its pending broadcast at once and exits; one told to stop (SIGTERM from torchrun, or from
the kernel when torchrun dies) waits ``FOLLOWER_STOP_GRACE_S`` for rank 0's STOP, since leaving in
the middle of a forward would hang rank 0's next all-reduce, and then leaves anyway.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from common.config import ConfigError
from producer.acceptance.verifier import GreedyTarget

log = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = 5.0
# Long, as transformers' own for sharded loading (rank skew); keepalives keep idle waits far below it.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
# Below torchrun's shutdown timeout (the launcher sets it), so torchrun need not SIGKILL a follower.
FOLLOWER_STOP_GRACE_S = 20.0


class Op(enum.IntEnum):
    """What rank 0 tells its followers."""

    CAPTURE = 1
    IDLE = 2
    STOP = 3
    EVAL = 4


EVAL_METHODS = ("reset", "forward", "forward_rows", "crop", "save_state", "restore_state", "detach")
"""The calls of ``GreedyTarget`` that run the model or change its cache: what EVAL carries."""

_INT, _LONG_TENSOR, _BOOL_TENSOR = 0, 1, 2


def split_devices(entry: str) -> list[str]:
    """``"cuda:0,cuda:1"`` -> ``["cuda:0", "cuda:1"]``: the devices of one producer."""
    return [part.strip() for part in entry.split(",")]


def _restrict_visible_gpus(devices: list[str], key: str) -> list[str]:
    """Make the group's GPUs this process's only visible ones, in order, and return each rank's device
    in that numbering. transformers puts rank r on accelerator r, and shards on whichever accelerator
    it finds: a group on the CPU must see none. Must run before anything initialises CUDA."""
    if all(device == "cpu" for device in devices):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return list(devices)
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised before the tensor-parallel group restricted the visible GPUs")
    indices = []
    for device in devices:
        kind, _, index = device.partition(":")
        if kind != "cuda" or not index.isdigit():
            raise ConfigError(
                f"{key}: a tensor-parallel group runs on GPUs named cuda:N (or on cpu only), got {device!r}"
            )
        indices.append(int(index))
    if len(set(indices)) != len(indices):
        raise ConfigError(f"{key}: names a GPU twice; each rank of a tensor-parallel group needs its own")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [name.strip() for name in visible.split(",")] if visible else None
    if names is not None and max(indices) >= len(names):
        raise ConfigError(
            f"{key}: names cuda:{max(indices)}, but CUDA_VISIBLE_DEVICES={visible} shows {len(names)} GPUs"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] if names is not None else str(i) for i in indices)
    if torch.cuda.device_count() != len(indices):
        raise ConfigError(f"{key}: names {len(indices)} GPUs, but only {torch.cuda.device_count()} of them exist here")
    return [f"cuda:{rank}" for rank in range(len(indices))]


class TensorParallelGroup:
    """This process's place in a tensor-parallel producer, and rank 0's channel to its followers."""

    def __init__(
        self,
        rank: int,
        devices: list[str],
        device: str,
        control: dist.ProcessGroup,
        pids: list[int],
        keepalive_interval_s: float = KEEPALIVE_INTERVAL_S,
    ) -> None:
        self.rank = rank
        self.size = len(devices)
        self.devices = devices  # as named in the config (the launcher's GPU numbering)
        self.device = device  # this rank's, in this process's numbering (the group's GPUs are the visible ones)
        self.pids = pids  # of every rank, by rank
        self.torchrun_pid = os.getppid()  # torchrun starts its ranks as its own children
        self.keepalive_interval_s = keepalive_interval_s
        # True once the followers wait for rank 0's messages (after loading; before, all ranks load in step).
        self.following = False
        self._control = control
        self._last_sent = time.monotonic()
        self._stopped = False

    @classmethod
    def join(
        cls, devices: list[str], key: str, keepalive_interval_s: float = KEEPALIVE_INTERVAL_S
    ) -> TensorParallelGroup:
        """Join the group torchrun started this process in (one rank per device of ``devices``).

        ``key`` names the setting in error messages. Restricts the visible GPUs first, so it must run
        before anything initialises CUDA.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != len(devices) or int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
            raise ConfigError(
                f"{key}: {len(devices)} device(s) for {world} rank(s): a producer runs one rank per device, under torchrun "
                f"--nproc-per-node {len(devices)} on one host (the launcher does this)"
            )
        rank = int(os.environ["RANK"])
        device = _restrict_visible_gpus(devices, key)[rank]
        if device.startswith("cuda"):
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", rank), timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
        pids = torch.zeros(world, dtype=torch.int64)
        pids[rank] = os.getpid()
        dist.all_reduce(pids, group=control)
        return cls(rank, devices, device, control, [int(pid) for pid in pids], keepalive_interval_s)

    # -- rank 0 --------------------------------------------------------------------------------------

    def send_capture(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Tell the followers to run the forward of this batch (host tensors)."""
        payload = torch.cat([input_ids.to(torch.int32).cpu(), cu_seqlens.to(torch.int32).cpu()])
        self._send_header(Op.CAPTURE, int(input_ids.numel()), int(cu_seqlens.numel()))
        dist.broadcast(payload, src=0, group=self._control)

    def send_eval(self, method: str, args: tuple) -> None:
        """Tell the followers to make the call ``method(*args)`` of their greedy target (ints, bools, tensors)."""
        payload = _pack_args(args)
        self._send_header(Op.EVAL, EVAL_METHODS.index(method), int(payload.numel()))
        dist.broadcast(payload, src=0, group=self._control)

    def keepalive(self) -> None:
        """Send IDLE if nothing was sent for ``keepalive_interval_s``; rank 0 calls this while it waits."""
        if self.following and time.monotonic() - self._last_sent >= self.keepalive_interval_s:
            self._send_header(Op.IDLE, 0, 0)

    def stop_followers(self) -> None:
        """Send STOP, once, if the followers listen; a group already broken (a follower died) is logged."""
        if self.rank != 0 or not self.following or self._stopped:
            return
        self._stopped = True
        try:
            self._send_header(Op.STOP, 0, 0)
        except RuntimeError as exc:
            log.warning("could not tell the followers to stop (%s); torchrun ends them", exc)

    def _send_header(self, op: Op, tokens: int, bounds: int) -> None:
        dist.broadcast(torch.tensor([int(op), tokens, bounds], dtype=torch.int64), src=0, group=self._control)
        self._last_sent = time.monotonic()

    # -- followers -----------------------------------------------------------------------------------

    def receive(self) -> tuple[Op, Any, Any]:
        """The next message of rank 0: (op, token ids, document bounds) for CAPTURE, (EVAL, method, its
        arguments) for EVAL, (op, None, None) otherwise."""
        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._control)
        op, tokens, bounds = (int(value) for value in header)
        if op == Op.EVAL:
            payload = torch.empty(bounds, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self._control)
            return Op.EVAL, EVAL_METHODS[tokens], _unpack_args(payload)
        if op != Op.CAPTURE:
            return Op(op), None, None
        payload = torch.empty(tokens + bounds, dtype=torch.int32)
        dist.broadcast(payload, src=0, group=self._control)
        return Op.CAPTURE, payload[:tokens], payload[tokens:]

    def close(self) -> None:
        """Leave torch.distributed."""
        if dist.is_initialized():
            dist.destroy_process_group()


class FollowerTarget(Protocol):
    """What a follower runs rank 0's forwards on: this rank's shards of the target (``producer.target.Target``)."""

    model: nn.Module
    layer_ids: list[int]
    capture_last_hidden: bool
    device: torch.device

    def capture_tokens(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> object:
        """The capture forward on bare token ids and document bounds, its features unused."""
        ...


def follow(group: TensorParallelGroup, target: FollowerTarget) -> int:
    """Run every forward rank 0 asks for until it says STOP; the process's exit code.

    The loop runs in a thread: a Python signal handler runs only in the main thread and only between
    calls into C, never while that thread waits inside a collective, so the main thread stays free to
    notice SIGTERM and to leave if rank 0 does not send STOP within ``FOLLOWER_STOP_GRACE_S``.
    """
    outcome: list[int] = []

    def loop() -> None:
        try:
            if target.device.type == "cuda":
                torch.cuda.set_device(target.device)  # the current device is per thread
            captures = 0
            greedy: GreedyTarget | None = None  # this rank's side of producer 0's evaluations
            while True:
                op, input_ids, cu_seqlens = group.receive()
                if op is Op.STOP:
                    log.info("rank %d: STOP from rank 0 after %d forwards", group.rank, captures)
                    outcome.append(0)
                    return
                if op is Op.CAPTURE:
                    target.capture_tokens(input_ids, cu_seqlens)
                    captures += 1
                elif op is Op.EVAL:
                    if greedy is None:
                        greedy = GreedyTarget(target.model, target.layer_ids, target.capture_last_hidden)
                    method, args = input_ids, cu_seqlens
                    getattr(greedy, method)(*(a.to(greedy.device) if isinstance(a, torch.Tensor) else a for a in args))
        except Exception:  # rank 0 is gone (its end of the group closed) or the group broke
            log.exception("rank %d: lost rank 0", group.rank)
            outcome.append(1)

    signalled_at: list[float] = []

    def on_signal(signum: int, _frame: object) -> None:
        if not signalled_at:
            log.info(
                "rank %d: signal %d, waiting up to %.0f s for rank 0's STOP", group.rank, signum, FOLLOWER_STOP_GRACE_S
            )
            signalled_at.append(time.monotonic())

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker = threading.Thread(target=loop, name="follower", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        if signalled_at and time.monotonic() - signalled_at[0] > FOLLOWER_STOP_GRACE_S and worker.is_alive():
            log.warning("rank %d: no STOP from rank 0 in %.0f s: leaving", group.rank, FOLLOWER_STOP_GRACE_S)
            logging.shutdown()
            os._exit(1)  # the loop thread is stuck in a collective: a normal exit would wait for it
    return outcome[0] if outcome else 1


def _pack_args(args: tuple) -> torch.Tensor:
    """``args`` (ints, bools, int64 or bool tensors) as one int64 tensor: per argument its kind, then an int's
    value, or a tensor's rank, shape and values."""
    parts: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            kind = _BOOL_TENSOR if arg.dtype == torch.bool else _LONG_TENSOR
            parts += [
                torch.tensor([kind, arg.dim(), *arg.shape], dtype=torch.int64),
                arg.reshape(-1).to("cpu", torch.int64),
            ]
        else:
            parts.append(torch.tensor([_INT, int(arg)], dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _unpack_args(payload: torch.Tensor) -> list:
    args: list = []
    values, at = payload.tolist(), 0
    while at < len(values):
        kind = values[at]
        if kind == _INT:
            args.append(values[at + 1])
            at += 2
            continue
        rank = values[at + 1]
        shape = values[at + 2 : at + 2 + rank]
        at += 2 + rank
        count = math.prod(shape)
        tensor = payload[at : at + count].reshape(shape)
        args.append(tensor.bool() if kind == _BOOL_TENSOR else tensor.clone())
        at += count
    return args


class MirroredTarget(GreedyTarget):
    """Rank 0's greedy target over a sharded model: every call that runs the model or changes its cache goes
    to the followers first (EVAL), who make it on their shards, so that each of its all-reduces has every rank."""

    def __init__(
        self, group: TensorParallelGroup, model: Any, layer_ids: list[int], capture_last: bool = False
    ) -> None:
        super().__init__(model, layer_ids, capture_last)
        self.group = group

    def reset(self) -> None:
        self.group.send_eval("reset", ())
        super().reset()

    def forward(self, token_ids: torch.Tensor, start: int, logits: bool = True):
        self.group.send_eval("forward", (token_ids, start, logits))
        return super().forward(token_ids, start, logits)

    def forward_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv_valid: torch.Tensor, last_logits_only: bool = False
    ):
        self.group.send_eval("forward_rows", (token_ids, positions, kv_valid, last_logits_only))
        return super().forward_rows(token_ids, positions, kv_valid, last_logits_only)

    def crop(self, length: int) -> None:
        self.group.send_eval("crop", (length,))
        super().crop(length)

    def save_state(self) -> None:
        self.group.send_eval("save_state", ())
        super().save_state()

    def restore_state(self) -> None:
        self.group.send_eval("restore_state", ())
        super().restore_state()

    def detach(self) -> None:
        self.group.send_eval("detach", ())
        super().detach()

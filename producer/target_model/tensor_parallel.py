"""One producer whose target is sharded over several devices (tensor parallelism), under torchrun: the group and
its control channel.

    python -m launch.torchrun --standalone --nproc-per-node 2 -m producer.server --run-dir DIR --producer-id 0 --device cuda:2,cuda:3

(the launcher runs this for an entry of ``launch.producer_devices`` that names several devices;
``launch.torchrun`` is torchrun that passes a rank's configuration error on as exit 2).

Every rank loads its shards with transformers' tensor-parallel plan (producer/target_model/load.py). Rank 0 is
the producer: data, batching, ring, sockets, status, exactly as with one device. Ranks > 0 are
followers (producer/target_model/follower.py): they run the same forward on the same batch, whose all-reduces need
them, and keep nothing: each decoder layer's output is whole on every rank, and only rank 0 writes it to its ring.

Control: before each operation of a target engine (producer/target_model/operations.py: a capture forward, and producer
0's evaluations, every call of the greedy target that runs the model or changes its KV cache) rank 0 broadcasts a
header (op, payload length), then the operation's arguments. These travel in a gloo group of their own, on the CPU:
a follower waiting for work holds no GPU kernel and no NCCL watchdog, and the TP all-reduces keep their group.
While it runs no forward (full ring, no trainer, possibly for hours) rank 0 sends IDLE at least
every ``keepalive_interval_s``, so no follower's wait comes near the collective timeout. STOP ends them.
"""

from __future__ import annotations

import logging
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.config import ConfigError
from producer.target_model.operations import OPERATIONS, Op

log = logging.getLogger(__name__)

KEEPALIVE_INTERVAL_S = 5.0
# Long, as transformers' own for sharded loading (rank skew); keepalives keep idle waits far below it.
COLLECTIVE_TIMEOUT = timedelta(hours=2)

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

    def send(self, op: Op, args: tuple) -> None:
        """Tell the followers to run ``op`` of ``OPERATIONS`` with ``args`` (ints, bools, tensors) on their engine."""
        payload = _pack_args(args)
        self._send_header(op, int(payload.numel()))
        dist.broadcast(payload, src=0, group=self._control)

    def keepalive(self) -> None:
        """Send IDLE if nothing was sent for ``keepalive_interval_s``; rank 0 calls this while it waits."""
        if self.following and time.monotonic() - self._last_sent >= self.keepalive_interval_s:
            self._send_header(Op.IDLE, 0)

    def stop_followers(self) -> None:
        """Send STOP, once, if the followers listen; a group already broken (a follower died) is logged."""
        if self.rank != 0 or not self.following or self._stopped:
            return
        self._stopped = True
        try:
            self._send_header(Op.STOP, 0)
        except RuntimeError as exc:
            log.warning("could not tell the followers to stop (%s); torchrun ends them", exc)

    def _send_header(self, op: Op, length: int) -> None:
        dist.broadcast(torch.tensor([int(op), length], dtype=torch.int64), src=0, group=self._control)
        self._last_sent = time.monotonic()

    # -- followers -----------------------------------------------------------------------------------

    def receive(self) -> tuple[Op, list]:
        """The next message of rank 0: (op, its arguments); IDLE and STOP have none."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._control)
        op, length = Op(int(header[0])), int(header[1])
        if op not in OPERATIONS:
            return op, []
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=self._control)
        return op, _unpack_args(payload)

    def close(self) -> None:
        """Leave torch.distributed."""
        if dist.is_initialized():
            dist.destroy_process_group()


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
    """The arguments ``_pack_args`` packed (a tensor's values read as a slice, not element by element)."""
    args: list = []
    at = 0
    while at < payload.numel():
        kind = int(payload[at])
        if kind == _INT:
            args.append(int(payload[at + 1]))
            at += 2
            continue
        rank = int(payload[at + 1])
        shape = [int(size) for size in payload[at + 2 : at + 2 + rank]]
        at += 2 + rank
        count = math.prod(shape)
        tensor = payload[at : at + count].reshape(shape)
        args.append(tensor.bool() if kind == _BOOL_TENSOR else tensor.clone())
        at += count
    return args

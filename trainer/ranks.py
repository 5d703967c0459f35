"""Which rank of the trainer this process is, its device, and the collectives the loop's bookkeeping uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.config import RunConfig


def resolve_device(cfg: RunConfig, local_rank: int) -> torch.device:
    listed = [d for d in os.environ.get("DFLASH_TRAINER_DEVICES", "").split(",") if d]
    if listed:
        return torch.device(listed[local_rank])
    if cfg.training.device != "auto":
        return torch.device(cfg.training.device)
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Ranks:
    """This process among the trainer's ranks (torchrun's RANK, WORLD_SIZE, LOCAL_RANK; one rank without them)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    sharded: bool
    """FSDP over several ranks: each holds 1/world_size of the drafter."""
    cpu_group: Any = None
    """Per-step bookkeeping (which batches each rank trained) goes through a CPU group: an object collective on
    NCCL would wait for the GPU to finish the step (a host sync)."""

    @classmethod
    def join(cls, cfg: RunConfig) -> Ranks:
        """This process's rank, on its device, in the process group when there are several."""
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = resolve_device(cfg, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cpu_group = None
        if world_size > 1:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD
        sharded = cfg.training.parallelism == "fsdp" and world_size > 1
        return cls(rank, world_size, local_rank, device, sharded, cpu_group)

    @property
    def parallelism(self) -> str:
        """How the ranks share the drafter: fsdp or ddp; single with one rank."""
        if self.world_size == 1:
            return "single"
        return "fsdp" if self.sharded else "ddp"

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank, through the CPU group: the time budget's clock is agreed every step, and an
        object collective on NCCL would wait for the GPU to finish the step."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, by rank (on every rank)."""
        if self.world_size == 1:
            return [value]
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self.cpu_group)
        return everyone

    def barrier(self) -> None:
        """Wait for every rank (a checkpoint's end: no rank trains on while rank 0 still takes it)."""
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group (the trainer's end)."""
        if self.world_size > 1:
            dist.destroy_process_group()

    def autocast(self) -> torch.autocast:
        """The steps' autocast: bf16 on a GPU (fp32 parameters and optimizer), none on the CPU."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

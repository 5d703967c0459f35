"""FSDP2 for the drafter (``training.parallelism = "fsdp"``): shard it over the trainer ranks, and
gather it whole again for evaluation (checkpoints gather it tensor by tensor: trainer/checkpoint.py).

Checkpoints keep the format of an unsharded drafter: the z-lab export of the full weights, and the
optimizer state as ``torch.optim.Optimizer.state_dict()`` writes it (parameters numbered in the
drafter's parameter order). So a run resumes with either parallelism and any number of ranks.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from common.drafter.base import Drafter

# FSDP, DTensor and distributed checkpointing are imported where a sharded trainer uses them: together
# they take about 1 s to import, which every trainer start (and restart) would otherwise pay.


def is_sharded(value: Any) -> bool:
    """Whether ``value`` is a DTensor (FSDP's shards); without torch.distributed.tensor loaded there is none."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(value, dtensor.DTensor)


class TrainStep(nn.Module):
    """Routes DDP's forward to ``forward_train`` so gradients are all-reduced (FSDP's hooks are on
    the drafter and its layers themselves)."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, num_anchors: int, generator: torch.Generator, step_fraction: float, prepared=None):
        return self.drafter.forward_train(batch, num_anchors, generator, step_fraction, prepared=prepared)


def parallelize(drafter: Drafter, device: torch.device, world_size: int, sharded: bool) -> nn.Module:
    """The module a training step calls: the drafter alone (one rank), under DDP, or sharded in place
    by FSDP (``sharded``; pass the drafter still on the host, see ``shard_drafter``)."""
    step = TrainStep(drafter)
    if sharded:
        shard_drafter(drafter, device, world_size)
    elif world_size > 1:
        step = nn.parallel.DistributedDataParallel(step, device_ids=[device.index] if device.type == "cuda" else None)
    return step


def shard_drafter(drafter: Drafter, device: torch.device, world_size: int) -> None:
    """Shard each draft layer, then the rest (fc, hidden_norm, norm) at the drafter, over all ranks.

    Pass the drafter still on the host: each ``fully_shard`` moves only its own module's weights to
    ``device`` and keeps this rank's shard, so no rank ever holds the whole drafter on the device.
    The target's embedding, final norm and lm_head are buffers, which FSDP does not shard: every
    rank keeps them whole, as with DDP, and they stay out of the optimizer. On CUDA the weights are
    gathered in bf16 for compute and gradients reduced in fp32 into the fp32 shards the optimizer
    updates, as bf16 autocast over fp32 weights does under DDP.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()  # CPU trains in fp32, as the unsharded trainer does there
    for layer in drafter.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The drafter's own weights (fc, norms) are needed again as soon as backward starts: keep them
    # gathered after forward instead of gathering them twice.
    fully_shard(drafter, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def local_parameter_count(drafter: Drafter) -> int:
    """Trainable parameters whose values this rank holds (its shards under FSDP, all under DDP)."""
    return sum((p.to_local() if is_sharded(p) else p).numel() for p in drafter.parameters() if p.requires_grad)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the whole value (a collective for a sharded DTensor; a replicated one is local)."""
    return value.full_tensor() if is_sharded(value) else value


def _trainable_names(drafter: Drafter) -> list[str]:
    """Parameter names in the order the trainer's optimizer numbers its parameters."""
    return [name for name, p in drafter.named_parameters() if p.requires_grad]


def full_model_state(drafter: Drafter) -> dict[str, torch.Tensor]:
    """The drafter's whole fp32 weights on rank 0's host, named as in its export; {} on other ranks.

    A collective: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Whole tensors on rank 0's host (the other ranks get empty dicts), without a full copy on any GPU.
    return get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_optimizer_state(drafter: Drafter, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an ``Optimizer.state_dict()`` of the whole drafter (every rank passes it) into the
    optimizer of the sharded drafter: each rank keeps the slices of its own shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _trainable_names(drafter)
    by_name = {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]} for group in state["param_groups"]
        ],
    }
    set_optimizer_state_dict(drafter, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

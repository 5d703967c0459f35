"""FSDP for the drafter (training.parallelism = "fsdp"): real processes over gloo (CPU) or NCCL.

- Unit level, 2 processes: FSDP steps on the same per-rank batches give the same weights,
  gradient norms and optimizer state as DDP, each rank holds about half of the drafter, and the
  gathered checkpoint state (DDP's format) resumes a sharded drafter exactly.
- Pipeline, launch/run_all.sh with a 2-rank FSDP trainer: kill -9 of the trainer, the restart
  resumes from the FSDP checkpoint, the ledger stays exactly once, the export loads with the loader;
  and a single-rank run that restart-trainer switches to 2-rank FSDP resumes where it stopped.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from drafter_fixtures import random_batch, random_head, tiny_config
from peers import wait_for
from test_pipeline import (
    assert_exactly_once,
    finish,
    held_at_batch,
    lineage,
    run_all,
    start,
    trainer_step,
    wait_held,
)
from torch import nn
from torch.distributed.tensor import DTensor

from common.drafter.export import load_drafter
from common.drafter.loss import LossConfig
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import load_target_head
from common.lifecycle import end_now
from common.rundir import RunDir, read_json
from trainer.checkpoint import HostStaging, read_train_state
from trainer.sharding import (
    TrainStep,
    full_tensor,
    load_full_optimizer_state,
    local_parameter_count,
    shard_drafter,
)

WORLD_SIZE = 2
STEPS = 3
# Weights of DDP and FSDP agree within 1% of one step's update (lr 1e-2): the two reduce in another order, and
# AdamW turns a rounding difference in a gradient near zero into one of up to 1.2e-5 in its weight (seen on a
# Xeon host with 1e-6 here). A wrong reduction or a lost step differs by whole updates.
WEIGHT_ATOL = 1e-4
NUM_ANCHORS = 16
# Each trainer start would also start wandb's service: seconds of CPU on a small machine.
NO_WANDB = "logging.wandb_mode=disabled"


def _optimizer(drafter: DFlashDrafter) -> torch.optim.Optimizer:
    # The trainer's optimizer settings; a large rate so that any difference would show.
    return torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95)
    )


def _step(
    model: nn.Module, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, step: int, rank: int
) -> torch.Tensor:
    """One trainer step (forward, backward, clip, AdamW) on this rank's batch of ``step``; the grad norm."""
    batch = random_batch([40, 25, 31], drafter.config, seed=100 * step + rank)
    loss, _ = model(batch, NUM_ANCHORS, torch.Generator().manual_seed(step), 0.0)
    loss.backward()
    # A small limit, so that clipping is active and its norm over the shards must be right.
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.05))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _assert_same_optimizer_state(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, state in want["state"].items():
        assert got["state"][index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=1e-5, atol=1e-7, msg=f"{index} {key}")


def _fsdp_matches_ddp(rank: int, store: str, checkpoint: str) -> None:
    """Each process: the same drafter under DDP and under FSDP, trained on the same batches."""
    torch.set_num_threads(1)
    # A file store, not a port picked in advance: another process could bind that port before rank 0 does.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    try:
        config = tiny_config(num_hidden_layers=3)
        torch.manual_seed(0)
        replicated = DFlashDrafter(config, random_head(config), LossConfig(chunk_rows=64))
        sharded = copy.deepcopy(replicated)
        initial = copy.deepcopy(replicated.state_dict())
        ddp = nn.parallel.DistributedDataParallel(TrainStep(replicated))
        shard_drafter(sharded, torch.device("cpu"), WORLD_SIZE)

        total = replicated.num_trainable_parameters()
        held = [0] * WORLD_SIZE
        dist.all_gather_object(held, local_parameter_count(sharded))
        assert sum(held) == total and all(abs(n - total / WORLD_SIZE) <= 0.05 * total for n in held), (held, total)
        assert not any(isinstance(b, DTensor) for b in sharded.target_head.buffers()), (
            "the frozen target head stays whole"
        )

        ddp_optimizer, fsdp_optimizer = _optimizer(replicated), _optimizer(sharded)
        for step in range(STEPS):
            ddp_norm = _step(ddp, replicated, ddp_optimizer, step, rank)
            fsdp_norm = _step(TrainStep(sharded), sharded, fsdp_optimizer, step, rank)
            torch.testing.assert_close(fsdp_norm, ddp_norm, rtol=1e-5, atol=1e-6)

        # As the trainer checkpoints: every rank joins the gathers into rank 0's reused host buffers.
        staging = HostStaging()
        weights = staging.copy(sharded.state_dict(), "drafter", keep=rank == 0)
        optimizer_state = staging.copy(fsdp_optimizer.state_dict(), "optimizer", keep=rank == 0)
        again = staging.copy(sharded.state_dict(), "drafter", keep=rank == 0)
        if rank == 0:
            assert all(again[name] is weights[name] for name in weights), "the second checkpoint reuses the buffers"
            assert not any(isinstance(v, DTensor) for v in weights.values()), "whole tensors, not shards"
            assert weights.keys() == replicated.state_dict().keys()
            assert not torch.allclose(weights["fc.weight"], initial["fc.weight"]), "the steps moved the weights"
            for name, value in replicated.state_dict().items():
                torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=WEIGHT_ATOL, msg=name)
            # What a DDP trainer writes into its train state, so either parallelism resumes either's checkpoint.
            _assert_same_optimizer_state(optimizer_state, ddp_optimizer.state_dict())
            torch.save({"weights": weights, "optimizer": optimizer_state}, checkpoint)
        else:
            assert weights is None and optimizer_state is None, "only rank 0 keeps the whole state"
        dist.barrier()

        # Resume as the trainer does: every rank loads the file into a fresh drafter, then shards it.
        saved = torch.load(checkpoint, weights_only=True)
        torch.manual_seed(1)
        resumed = DFlashDrafter(config, random_head(config), LossConfig(chunk_rows=64))
        resumed.load_state_dict(saved["weights"])
        shard_drafter(resumed, torch.device("cpu"), WORLD_SIZE)
        resumed_optimizer = _optimizer(resumed)
        load_full_optimizer_state(resumed, resumed_optimizer, saved["optimizer"])
        ddp_norm = _step(ddp, replicated, ddp_optimizer, STEPS, rank)
        resumed_norm = _step(TrainStep(resumed), resumed, resumed_optimizer, STEPS, rank)
        torch.testing.assert_close(resumed_norm, ddp_norm, rtol=1e-5, atol=1e-6)
        for (name, shard), value in zip(resumed.named_parameters(), replicated.parameters()):
            torch.testing.assert_close(shard.full_tensor(), value, rtol=1e-5, atol=WEIGHT_ATOL, msg=name)
    finally:
        dist.destroy_process_group()
    end_now(0)  # as exit_process ends our ranks: a plain exit can race gloo's threads into SIGABRT


def test_fsdp_steps_match_ddp_and_each_rank_holds_half(tmp_path):
    mp.spawn(_fsdp_matches_ddp, args=(str(tmp_path / "store"), str(tmp_path / "state.pt")), nprocs=WORLD_SIZE)


# -- the pipeline -------------------------------------------------------------------------------


@pytest.fixture
def run_dir(short_tmp) -> Path:
    return short_tmp / "run"


def _assert_sharded_status(run: RunDir) -> None:
    status = read_json(run.trainer_status)
    total, per_rank = status["drafter_params_total"], status["drafter_params_per_rank"]
    assert status["parallelism"] == "fsdp" and len(per_rank) == WORLD_SIZE and sum(per_rank) == total
    assert all(abs(n - total / WORLD_SIZE) <= 0.05 * total for n in per_rank), (per_rank, total)


def _run_fsdp_pipeline(run_dir: Path, placement: list[str], timeout_s: float) -> None:
    """A 2-rank FSDP trainer: kill -9 after its first checkpoint; the restart resumes from it."""
    launcher = start(
        run_dir,
        NO_WANDB,
        "training.max_steps=0",
        "training.epochs=3",
        "training.checkpoint_every=4",
        'training.parallelism="fsdp"',
        "eval.every_steps=8",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        *placement,
    )
    run = RunDir(run_dir)
    wait_for(lambda: run.latest_checkpoint() is not None and trainer_step(run) >= 6, "an FSDP checkpoint", timeout_s)
    _assert_sharded_status(run)
    victim = read_json(run.trainer_status)["pid"]
    os.kill(victim, signal.SIGKILL)  # rank 0; torchrun takes rank 1 down, the supervisor restarts both
    wait_for(lambda: (read_json(run.trainer_status) or {}).get("pid") not in (None, victim), "a new trainer", timeout_s)
    finish(launcher, run_dir, timeout=timeout_s)

    assert read_json(run.trainer_status)["state"] == "finished"
    _assert_sharded_status(run)
    incarnations = assert_exactly_once(run)
    assert len(incarnations) == 2
    restarted = max(incarnations)
    first_resumed_step = min(line["step"] for line in lineage(run) if line["incarnation"] == restarted)
    assert first_resumed_step > 1 and (first_resumed_step - 1) % 4 == 0, "resumed from a checkpoint, not from scratch"
    assert all(len({tuple(b) for b in line["batches"]}) == WORLD_SIZE for line in lineage(run))

    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any("eval/tau" in m for m in metrics), "rank 0 evaluated a whole copy of the sharded drafter"
    checkpoint = run.latest_checkpoint()
    drafter = load_drafter(checkpoint / "drafter", load_target_head(run.target_head))
    assert drafter.num_trainable_parameters() == read_json(run.trainer_status)["drafter_params_total"]
    optimizer = read_train_state(checkpoint)["optimizer"]
    assert sorted(optimizer["state"]) == list(range(len(list(drafter.parameters())))), "DDP's optimizer format"


def test_fsdp_pipeline_kill9_resumes_from_sharded_checkpoint_exactly_once(run_dir):
    _run_fsdp_pipeline(run_dir, ['launch.trainer_devices=["cpu", "cpu"]'], timeout_s=240)


def test_restart_trainer_switches_one_rank_to_two_fsdp_ranks(run_dir):
    """The checkpoint of a single-rank trainer resumes under FSDP on two ranks (same format)."""
    # The single rank holds its sixth batch, so restart-trainer stops it there whatever the machine's speed; the
    # FSDP trainer trains on without a hold.
    fault_log = run_dir.parent / "faults.jsonl"
    launcher = start(run_dir, NO_WANDB, "training.max_steps=0", "training.epochs=3", env=held_at_batch(fault_log, 6))
    run = RunDir(run_dir)
    wait_held(fault_log)
    answer = run_all(
        "restart-trainer",
        "--run-dir",
        str(run_dir),
        'training.parallelism="fsdp"',
        'launch.trainer_devices=["cpu", "cpu"]',
    )
    assert answer.returncode == 0, answer.stdout + answer.stderr
    finish(launcher, run_dir)

    assert read_json(run.trainer_status)["state"] == "finished"
    _assert_sharded_status(run)
    incarnations = assert_exactly_once(run)
    single, sharded = sorted(incarnations)
    lines = lineage(run)
    assert [line["step"] for line in lines if line["incarnation"] == single] == list(range(1, 7))
    assert min(line["step"] for line in lines if line["incarnation"] == sharded) == 7, (
        "the FSDP trainer resumed from the checkpoint the single rank wrote when it stopped"
    )
    assert {len(line["batches"]) for line in lines} == {1, WORLD_SIZE}


@pytest.mark.gpu
@pytest.mark.multigpu
def test_fsdp_pipeline_on_two_gpus(run_dir):
    """NCCL, bf16 mixed precision and compiled layers. The producers share the trainer's GPUs: the
    evaluation's target is then drawn on the same device type as theirs (the same random weights)."""
    _run_fsdp_pipeline(
        run_dir,
        [
            'launch.producer_devices=["cuda:0", "cuda:1"]',
            'launch.trainer_devices=["cuda:0", "cuda:1"]',
            'target.dtype="bfloat16"',
        ],
        timeout_s=300,
    )


def test_an_unsharded_trainer_does_not_import_fsdp():
    """FSDP, DTensor and distributed checkpointing take about 1 s to import, paid by every trainer start and
    restart: only a sharded trainer loads them (trainer/sharding.py)."""
    import subprocess
    import sys

    code = (
        "import sys, trainer.train; "
        "print(sorted(m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor', 'torch.distributed.checkpoint') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout

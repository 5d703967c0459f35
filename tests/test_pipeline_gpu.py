"""The pipeline on a GPU: producers and trainer on cuda:0, CUDA IPC rings, exactly-once ledger."""

from __future__ import annotations

import json

import pytest
from test_pipeline import assert_exactly_once, finish, start

from common.rundir import RunDir, read_json
from common.status import ProducerStatus
from trainer.profile import SYNC_CAUSES


@pytest.mark.gpu
def test_gpu_pipeline_with_cuda_rings(short_tmp):
    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=3",
        "target.dtype=\"bfloat16\"",
        "ring.backend=\"cuda\"",
        "launch.producer_devices=[\"cuda:0\", \"cuda:0\"]",
        "launch.trainer_devices=[\"cuda:0\"]",
        "logging.profile_steps=3",
        "logging.profile_after=12",  # steps 13-15: no log line (every 4) and no checkpoint (every 8) among them
    )
    finish(launcher, run_dir, timeout=600)
    run = RunDir(run_dir)
    # The trainer's own steps on the card: kernels, the device busy, and no host read of a device value among them.
    summary = json.loads((run.logs / "trainer-profile.txt").read_text().split("\n\n")[0])
    assert summary["name"] == "steps 13-15" and summary["kernels_per_step"] > 0
    assert 0 < summary["device_busy_ms_per_step"] <= summary["wall_ms_per_step"]
    assert not set(summary["syncs_per_step"]) & set(SYNC_CAUSES), summary["syncs_per_step"]
    assert all(s.ring["backend"] == "cuda" and s.device == "cuda:0" for s in ProducerStatus.read_all(run))
    assert read_json(run.trainer_status)["state"] == "finished"
    assert_exactly_once(run)
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert all(m["loss"] == m["loss"] for m in metrics), "no NaN"
    assert all(isinstance(m["alloc_retries"], int) for m in metrics), "the allocator's retries are logged on a GPU"


@pytest.mark.gpu
def test_gpu_pipeline_with_a_hybrid_qwen35_target(short_tmp):
    """A saved multimodal Qwen3.5 on the GPU: the producer runs flash-linear-attention's varlen kernels and
    compiled layers, the trainer trains the preset drafter, and producer 0 evaluates it at step 40."""
    from hybrid_fixtures import tiny_qwen35

    path = tiny_qwen35(short_tmp / "qwen35", "multimodal")
    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        f"target.path={path}",
        "target.config_overrides={}",
        "target.dtype=\"bfloat16\"",
        "ring.backend=\"cuda\"",
        "launch.producer_devices=[\"cuda:0\"]",
        "launch.trainer_devices=[\"cuda:0\"]",
        "training.max_steps=40",
        "eval.every_steps=40",
        "eval.num_prompts=2",
        "eval.max_new_tokens=16",
    )
    finish(launcher, run_dir, timeout=600)
    run = RunDir(run_dir)
    kernels = [s.kernels for s in ProducerStatus.read_all(run)]
    assert kernels and all(k == {"attention": "varlen", "linear_attention": "fla", "compiled": True} for k in kernels)
    assert_exactly_once(run)
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert all(m["loss"] == m["loss"] for m in metrics if "loss" in m), "no NaN"
    assert any("eval/tau" in m for m in metrics)

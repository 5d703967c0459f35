"""logging.profile_steps: the trainer's StepProfiler traces the steps it is asked for, from the step it is asked to
start at, and writes their summary (a real run's is in test_pipeline.py's end-to-end test, a card's in
test_pipeline_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import ConfigError, load_config
from trainer.profile import StepProfiler


def run_steps(profiler: StepProfiler, steps: int, stop_at: int | None = None) -> list[dict]:
    """``steps`` iterations of a small step through ``profiler``'s hooks (``stop_at``: the run's last); the
    summaries it returned."""
    weights = torch.randn(32, 32, requires_grad=True)
    summaries = []
    for done in range(steps):
        profiler.step_starts(done)
        (weights @ weights).square().sum().backward()
        summary = profiler.step_ended(done + 1, last=done + 1 == stop_at)
        summaries += [summary] if summary else []
        if done + 1 == stop_at:
            break
    return summaries


def test_it_traces_the_steps_asked_from_the_step_asked(tmp_path):
    path = tmp_path / "logs" / "trainer-profile.txt"
    summaries = run_steps(StepProfiler(3, 4, path, torch.device("cpu"), enabled=True), 12)
    assert [s["name"] for s in summaries] == ["steps 5-7"] and summaries[0]["steps"] == 3
    written = path.read_text()
    assert json.loads(written.split("\n\n")[0])["aten_ops_per_step"] == summaries[0]["aten_ops_per_step"]
    assert "aten::mm" in written and "By calls:" in written
    assert summaries[0]["aten_ops_per_step"] > 3 and summaries[0]["wall_ms_per_step"] > 0


def test_a_run_that_ends_inside_the_profile_writes_the_steps_it_had(tmp_path):
    path = tmp_path / "profile.txt"
    summaries = run_steps(StepProfiler(10, 2, path, torch.device("cpu"), enabled=True), 12, stop_at=5)
    assert [(s["name"], s["steps"]) for s in summaries] == [("steps 3-5", 3)] and path.is_file()


@pytest.mark.parametrize("steps, enabled", [(0, True), (3, False)])
def test_no_profile_when_none_is_asked_or_on_another_rank(tmp_path, steps, enabled):
    path = tmp_path / "profile.txt"
    assert run_steps(StepProfiler(steps, 0, path, torch.device("cpu"), enabled=enabled), 6) == []
    assert not path.exists()


@pytest.mark.parametrize("key", ["profile_steps", "profile_after"])
def test_a_negative_profile_setting_names_its_key(key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"logging.{key}=-1"])


def test_a_profiler_that_cannot_start_leaves_the_run_training(tmp_path, monkeypatch, caplog):
    """A profile is a diagnosis: when torch's profiler cannot start (CUPTI missing or taken), the trainer says so and
    trains on."""
    from trainer import profile

    def refuse(device):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(profile, "start_profiler", refuse)
    path = tmp_path / "profile.txt"
    assert run_steps(StepProfiler(2, 1, path, torch.device("cpu"), enabled=True), 4) == []
    assert not path.exists() and "the profiler did not start (CUPTI_ERROR_NOT_INITIALIZED)" in caplog.text

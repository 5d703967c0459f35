"""training.max_minutes: the run ends when its time budget is spent, the schedule follows the clock, and a trainer
killed with kill -9 spends only what the checkpoint says is left."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from common.config import ConfigError, load_config
from common.rundir import RunDir, read_json
from launch.progress import eta_s
from tests.test_pipeline import ONE_PRODUCER, finish, start, trainer_step, wait_for
from trainer.budget import TimeBudget
from trainer.optim import lr_lambda


def test_the_schedule_is_as_far_along_as_the_larger_of_steps_and_clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    cfg = load_config(None, ["training.warmup_ratio=0.1", "training.min_lr_ratio=0.1", "training.max_minutes=1"])
    budget = TimeBudget(cfg.training.max_minutes)
    factor = lr_lambda(cfg, 1000, budget)
    assert factor(5) == pytest.approx(6 / 100)  # before the first tick: steps alone (warmup is 100 steps)
    budget.tick()  # the clock starts at the end of the first step
    now[0] += 30  # half the budget at step 20: the schedule is at step 500 of 1,000
    budget.tick()
    assert budget.fraction == pytest.approx(0.5) and not budget.spent
    assert factor(20) == pytest.approx(lr_lambda(cfg, 1000)(500))
    assert factor(900) == pytest.approx(lr_lambda(cfg, 1000)(900))  # the steps further along than the clock
    now[0] += 30
    budget.tick()
    assert budget.spent and factor(40) == pytest.approx(0.1)  # decayed to the floor when the clock ends the run


def test_a_restarted_trainer_carries_the_seconds_trained(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    budget = TimeBudget(2.0, trained_s=90.0)
    budget.tick()
    now[0] += 29
    budget.tick()
    assert budget.seconds == pytest.approx(119.0) and not budget.spent
    now[0] += 1
    budget.tick()
    assert budget.spent


def test_a_negative_budget_names_the_key():
    with pytest.raises(ConfigError, match="max_minutes"):
        load_config(None, ["training.max_minutes=-1"])


def test_a_time_bound_run_stops_on_its_budget_through_kill9(short_tmp):
    """Real processes: a budget of 6 s and 100,000 steps; the trainer is killed with kill -9 after 3 s of
    training; its successor resumes the seconds of the last checkpoint (so it trains about 3 s, not 6), and the
    run ends on the clock with the learning rate at its floor."""
    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        "training.max_steps=100000",
        "training.max_minutes=0.1",
        "training.min_lr_ratio=0.1",
        "training.lr=1e-3",
        "training.checkpoint_every=4",
        "eval.every_steps=0",
        *ONE_PRODUCER,
    )
    run = RunDir(run_dir)
    wait_for(lambda: ((read_json(run.trainer_status) or {}).get("trained_s") or 0) >= 3, "3 s of training", 120)
    victim = read_json(run.trainer_status)["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: (read_json(run.trainer_status) or {}).get("pid") not in (None, victim), "a new trainer", 120)
    finish(launcher, run_dir)

    status = read_json(run.trainer_status)
    assert status["state"] == "finished" and status["step"] < 100000
    assert 6.0 <= status["trained_s"] < 12.0  # the budget, and at most a few steps beyond it
    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    assert json.loads((last / "trainer_state.json").read_text())["trained_s"] == pytest.approx(status["trained_s"])
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The floor: the clock ended the schedule (the last lr was set one tick before the end, a hair above it).
    assert trained[-1]["lr"] == pytest.approx(1e-4, rel=0.05)
    assert trainer_step(run) == status["step"]
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    successor = [entry["time"] for entry in ledger if entry["incarnation"] == status["incarnation"]]
    assert len({entry["incarnation"] for entry in ledger}) == 2
    assert successor[-1] - successor[0] < 5.0, "the successor trained a whole budget"


def test_the_eta_is_the_budget_rest_when_the_clock_ends_the_run_first():
    by_steps = {"step": 100, "max_steps": 1100, "steps_per_s": 10.0}
    assert eta_s(by_steps) == pytest.approx(100.0)
    assert eta_s({**by_steps, "max_minutes": 1.0, "trained_s": 30.0}) == pytest.approx(30.0)
    assert eta_s({**by_steps, "max_minutes": 10.0, "trained_s": 30.0}) == pytest.approx(100.0)
    assert eta_s({"step": 1}) is None

"""A trainer step out of memory, with the real launcher, producers and trainer on the CPU.

The out-of-memory error is injected (``DFLASH_FAULT=trainer.step:N=oom``, common/faults.py): the trainer raises
torch.OutOfMemoryError in its N-th step, as a step that does not fit the GPU would. The trainer records what it saw in
logs/out-of-memory.jsonl and exits with EXIT_OUT_OF_MEMORY; the launcher restarts it once, and stops the run with
exit 2 when the same step runs out of memory again, naming the memory seen and the keys that lower it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_pipeline import ONE_PRODUCER, finish, start

from common.faults import LOG_ENV, PLAN_ENV, Fault, format_plan, parse_plan, read_log
from common.lifecycle import EXIT_CONFIG_ERROR, EXIT_OUT_OF_MEMORY, OutOfMemory
from common.rundir import RunDir, read_json

MEMORY_KEYS = ("batching.token_budget", "drafter.num_anchors", "launch.num_producers", "launch.trainer_devices")


def _injected(fault_log: Path, plan: str) -> dict[str, str]:
    return {**os.environ, PLAN_ENV: plan, LOG_ENV: str(fault_log)}


def _trainer_starts(run_dir: Path) -> int:
    return (run_dir / "logs" / "trainer.log").read_text().count("==== trainer start")


def test_out_of_memory_again_at_the_same_step_stops_the_run_with_exit_2(short_tmp):
    run_dir, fault_log = short_tmp / "run", short_tmp / "faults.jsonl"
    # Three entries: a launcher that kept restarting would meet the third (and a fourth trainer would train on).
    plan = "trainer.step:5=oom,trainer.step:5=oom,trainer.step:5=oom"
    launcher = start(run_dir, *ONE_PRODUCER, "training.max_steps=40", env=_injected(fault_log, plan))
    code = launcher.wait(timeout=300)
    output = (short_tmp / "launcher.out").read_text()

    assert code == EXIT_CONFIG_ERROR, output[-3000:]
    assert "trainer: out of memory at step 5 (peak" in output, "the first one is restarted"
    assert "trainer: out of memory at step 5 again, after a restart" in output
    stop_line = next(line for line in output.splitlines() if "at step 5 again, after a restart" in line)
    assert all(key in stop_line for key in MEMORY_KEYS), stop_line
    assert "resident on cpu, of the host's" in stop_line and "peak ? " not in stop_line, "names the memory seen"
    assert len(read_log(fault_log)) == 2 and _trainer_starts(run_dir) == 2, "no third trainer"
    assert "exit 3" in output, "the trainer exits with EXIT_OUT_OF_MEMORY"
    records = OutOfMemory.since(RunDir(run_dir), 0.0)
    assert [(r.step, r.rank, r.device) for r in records] == [(5, 0, "cpu"), (5, 0, "cpu")]
    assert all(r.peak_allocated and r.total and r.peak_allocated < r.total for r in records)
    assert "injected by DFLASH_FAULT" in records[0].error
    launcher_record = read_json(RunDir(run_dir).launcher)
    assert (launcher_record["state"], launcher_record["exit_code"]) == ("failed", EXIT_CONFIG_ERROR)
    assert EXIT_OUT_OF_MEMORY == 3


def test_out_of_memory_at_different_steps_is_restarted_and_the_run_finishes(short_tmp):
    """Not the same step twice (memory that grew, fragmentation): each is restarted as a crash, as before."""
    run_dir, fault_log = short_tmp / "run", short_tmp / "faults.jsonl"
    launcher = start(
        run_dir,
        *ONE_PRODUCER,
        "training.max_steps=8",
        env=_injected(fault_log, "trainer.step:3=oom,trainer.step:5=oom"),
    )
    finish(launcher, run_dir, timeout=300)
    output = (short_tmp / "launcher.out").read_text()

    assert "trainer: out of memory at step 3 (peak" in output and "trainer: out of memory at step 5 (peak" in output
    assert "again, after a restart" not in output
    assert len(read_log(fault_log)) == 2 and _trainer_starts(run_dir) == 3
    assert (read_json(RunDir(run_dir).trainer_status) or {}).get("step") == 8


def test_an_injected_out_of_memory_is_a_plan_entry_of_the_step_only():
    plan = parse_plan("trainer.step:5=oom, trainer.batch:2=30")
    assert plan == [Fault("trainer.step", 5, oom=True), Fault("trainer.batch", 2, hold_s=30.0)]
    assert parse_plan(format_plan(plan)) == plan
    with pytest.raises(ValueError, match="'producer.fill:2=oom': =oom only at trainer.step"):
        parse_plan("producer.fill:2=oom")

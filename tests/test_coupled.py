"""The coupled baseline (launch/bench/coupled.py) on the CPU: the trainer's own loop with the target in its process,
evaluating in the loop through the same evaluation interface as the decoupled trainer."""

from __future__ import annotations

import json
import subprocess
import sys

from common.config import load_config, save_config
from common.rundir import RunDir, read_json
from tests.test_producer import ROOT


def test_the_coupled_baseline_trains_and_evaluates_in_its_loop(short_tmp):
    run = RunDir(short_tmp / "run")
    run.root.mkdir()
    # Two evaluations of 2 prompts, 8 tokens each: the loop's evaluation path, not tiny.toml's 64-token decodes.
    overrides = ["training.max_steps=20", "logging.log_every=10", "eval.every_steps=10", "eval.num_prompts=2",
                 "eval.max_new_tokens=8"]  # fmt: skip
    save_config(load_config(ROOT / "launch" / "tiny.toml", overrides), run.config)
    done = subprocess.run(
        [sys.executable, "-m", "launch.bench.coupled", "--run-dir", str(run.root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/tau" in m] == [10, 20]
    status = read_json(run.trainer_status)
    assert status["state"] == "finished" and status["eval"]["step"] == 20 and status["evals_in_flight"] == []

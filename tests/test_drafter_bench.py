"""The benchmark program stays runnable (CPU, tiny shapes) and prints its table and JSON line."""

import json
import subprocess
import sys


def test_bench_step_tiny_runs():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.bench.step",
            "--tiny",
            "--variants",
            "eager",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--matmul-size",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    row = result["results"][0]
    assert row["variant"] == "eager" and row["samples_per_s"] > 0 and 0 < row["mfu"]
    assert row["loss"] == row["loss"]  # not NaN

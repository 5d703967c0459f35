"""The benchmark programs stay runnable (CPU, tiny shapes) and print their table and JSON line: the step, the optimizer
step alone, and sampled decoding together against one prompt at a time."""

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


def bench_json(*args: str) -> dict | list:
    """A benchmark program's last line, its JSON, after a run on the CPU."""
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_bench_step_tiny_runs_the_trainers_muon():
    result = bench_json(
        "launch.bench.step", "--tiny", "--variants", "eager", "--optimizer", "muon", "--warmup", "1", "--steps", "2"
    )
    assert result["optimizer"] == "muon" and result["results"][0]["samples_per_s"] > 0


def test_bench_optimizer_counts_the_muon_steps_products_by_shape():
    """The tiny drafter with 8 layers: 57 matrices of 4 shapes, five Newton-Schulz iterations of three products each."""
    result = bench_json("launch.bench.optimizer", "--tiny", "--steps", "2", "--repeats", "1", "--warmup", "1")
    muon, adamw = result["results"]
    assert (muon["optimizer"], muon["muon_matrices"], muon["products"]) == ("muon", 57, 60)
    assert adamw["optimizer"] == "adamw" and adamw["products"] == 0 and adamw["step_ms"] > 0


def test_bench_optimizer_host_only_issues_the_same_operators_on_the_meta_device():
    """--host-only: the step's host cost, every operator dispatched as on the CPU, none computing."""
    args = ("--tiny", "--optimizers", "muon", "--steps", "2", "--repeats", "1", "--warmup", "1")
    (on_cpu,) = bench_json("launch.bench.optimizer", *args)["results"]
    result = bench_json("launch.bench.optimizer", *args, "--host-only")
    assert result["device"] == "meta"
    assert (result["results"][0]["operators"], result["results"][0]["products"]) == (on_cpu["operators"], 60)


def test_bench_acceptance_sampled_decodes_the_prompts_together_as_alone():
    rows = bench_json("launch.bench.acceptance", "--tiny", "--sampled", "--prompts", "4", "--new-tokens", "16")
    alone, together = rows
    assert (alone["prompts_together"], together["prompts_together"]) == (1, 4)
    assert together["same_texts"] == 4 and together["blocks"] == alone["blocks"]

"""Benchmark (issue 18): can a producer's short kernels keep their speed beside a trainer on one GPU?

    python -m launch.bench.mps                 # needs a CUDA GPU and nvidia-cuda-mps-control
    python -m launch.bench.mps --seconds 6 --hog-percents 90,80

A producer evaluating beside a trainer on one GPU runs thousands of short kernels (an evaluation's decoding
rounds) while the trainer keeps every SM busy with long matmuls; an evaluation of 3.4 s alone took 20-40 s
beside a trainer (BENCHMARKS.md). This program measures the effect with two stand-ins, and whether capping
the trainer's SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, ``launch.mps_trainer_sm_percent``) gives them back:

  hog    the trainer: back-to-back 8192^3 bf16 matmuls (reports TFLOP/s)
  probe  the evaluation: rounds of 36 small decode-shaped layers (256 x 4096 @ 4096 x 12288, norms,
         activations), a host sync per round (reports ms per round)

Runs: the probe alone; the hog alone, uncapped and at each ``--hog-percents``; the probe beside the hog
under the run's own MPS daemon (``launch/mps.py``), uncapped and at each cap. (MPS client priority,
``CUDA_MPS_CLIENT_PRIORITY``, was measured here before and changed nothing: BENCHMARKS.md.)
Prints a table and JSON.

The daemon quits however the benchmark ends (its end, an error, Ctrl-C, a TERM to its process group); its pipe
directory is the same for every run of the benchmark, so that a run killed with -9 leaves a daemon the next run finds
and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.bench.harness import add_json_argument, emit

ROOT = Path(__file__).resolve().parents[2]
SM_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # an MPS client's cap on the SMs it may use


def hog(seconds: float) -> dict:
    """Matmuls until ``seconds`` have passed: TFLOP/s achieved."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
        count += 8
    return {"tflops": 2 * 8192**3 * count / (time.perf_counter() - start) / 1e12}


def probe(seconds: float) -> dict:
    """Decode-shaped rounds until ``seconds`` have passed: milliseconds per round."""
    import torch

    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(4096, 12288, device="cuda", dtype=torch.bfloat16) / 64
    down = torch.randn(12288, 4096, device="cuda", dtype=torch.bfloat16) / 110

    def one_round() -> None:
        h = x
        for _ in range(36):
            normed = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
            h = h + torch.nn.functional.silu(normed @ up) @ down
        h.sum().item()  # the decoding's host sync (accepted tokens) at the end of every round

    for _ in range(3):
        one_round()
    start, rounds = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        one_round()
        rounds += 1
    return {"ms_per_round": 1000 * (time.perf_counter() - start) / rounds, "rounds": rounds}


def run_role(role: str, seconds: float, env: dict[str, str], delay_s: float = 0.0) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "launch.bench.mps",
        "--role",
        role,
        "--seconds",
        str(seconds),
        "--delay-s",
        str(delay_s),
    ]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"a launch.bench.mps role exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0, help="probe time per run (the hog runs 4 s longer)")
    parser.add_argument("--role", choices=["hog", "probe"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--hog-percents", default="90,80", help="SM caps of the hog to measure (comma list)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.role:
        time.sleep(args.delay_s)
        print(json.dumps(hog(args.seconds) if args.role == "hog" else probe(args.seconds)), flush=True)
        return 0

    from launch.mps import MpsDaemon

    home = Path(tempfile.gettempdir()) / "dflash-bench-mps"  # one pipe directory for every run (see above)
    with MpsDaemon(home, home / "logs") as daemon:
        rows = [{"run": "probe alone", **result_of(run_role("probe", args.seconds, daemon.env))}]
        # The hog starts first and outlasts the probe, which starts once the hog's matmuls run.
        for percent in [100, *(int(p) for p in args.hog_percents.split(","))]:
            hog_env = {**daemon.env, **({SM_PERCENT_ENV: str(percent)} if percent < 100 else {})}
            rows.append(
                {"run": f"hog alone, {percent}% of the SMs", **result_of(run_role("hog", args.seconds, hog_env))}
            )
            hog_proc = run_role("hog", args.seconds + 4, hog_env)
            probe_proc = run_role("probe", args.seconds, daemon.env, delay_s=2.0)
            rows.append({"run": f"probe beside a hog of {percent}%", **result_of(probe_proc), **result_of(hog_proc)})
    print(f"{'run':<42} {'probe ms/round':>15} {'hog TFLOP/s':>12}")
    for row in rows:
        ms, tf = row.get("ms_per_round"), row.get("tflops")
        print(f"{row['run']:<42} {'' if ms is None else f'{ms:.1f}':>15} {'' if tf is None else f'{tf:.0f}':>12}")
    record = {"bench": "mps_sm_cap", "seconds": args.seconds, "runs": rows}
    emit(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

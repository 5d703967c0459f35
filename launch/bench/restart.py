"""Benchmark: time from restart-trainer to the first new optimizer step, against stopping and
starting the whole pipeline (targets reloaded), on the same run.

    python -m launch.bench.restart             # Qwen3-8B-shaped target and draft, one GPU
    python -m launch.bench.restart --tiny      # the tiny CPU default (smoke run)
    python -m launch.bench.restart --during-write   # the restart comes right after a checkpoint write began

Sequence: start the pipeline and wait for training to run, for its first checkpoint and for the launcher's
standby trainer (as in a run that has trained a while); ``restart-trainer`` with a changed
learning rate and time until the new trainer's first step; ``stop`` and a fresh ``run_all.sh`` on
the same run directory (it resumes) and time until its first step. Times are the ledger's: from the
command to the wall-clock time of the first step the new trainer trained (restart-trainer's command
itself returns later, once the old trainer has exited). The standby is given the time to build its
warm start first (trainer/warm.py), as in a run that has trained a while.

With ``--during-write`` the restart comes right after a periodic checkpoint write began (at the Qwen3-8B shapes
it takes 15-22 s): the old trainer hands its state over in new segments instead of waiting for the write. On
``--tiny`` every write is then held open for ``TINY_WRITE_S`` (DFLASH_FAULT_DELAY), a stand-in for the large
write the tiny draft does not have.
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

from common.faults import DELAY_ENV
from common.rundir import RunDir, read_json
from common.status import LauncherRecord, ProducerStatus
from launch.bench.harness import ROOT, add_run_arguments, emit, qwen3_8b_target, wait_for

# One checkpoint before the restart, as in any run that trained a while (the restart turns them off). At the
# Qwen3-8B shapes a write takes 15-22 s on an H200 host: 100 steps apart, so that none is in flight when the
# restart comes (one would be waited for).
CHECKPOINT_EVERY = {True: 8, False: 100}
TINY_WRITE_S = 5.0
WARM_LINE = "warm start: head, drafter"  # the standby's log line once its warm start is built


def overrides_for(tiny: bool, run_dir: Path) -> list[str]:
    common = [
        "training.max_steps=1000000",
        f"training.checkpoint_every={CHECKPOINT_EVERY[tiny]}",
        "logging.log_every=1",
        "logging.progress=false",
        "launch.restart_backoff_s=0.5",
        "launch.standby_trainer_after_s=0",
    ]
    if tiny:
        return common
    return common + [
        *qwen3_8b_target(run_dir.parent),
        "data.num_samples=100000",
        "data.mean_len=1000",
        "data.min_len=32",
        "data.max_seq_len=3072",
        "data.max_step=63",
        "batching.token_budget=3072",
        "batching.window_docs=256",
        "drafter.num_layers=5",
        "drafter.block_size=16",
        "drafter.num_anchors=512",
        'ring.backend="cuda"',
        "ring.num_slots=4",
        "ring.heartbeat_interval_s=1.0",
        "ring.heartbeat_timeout_s=30.0",
        'launch.producer_devices=["cuda:0"]',
        'launch.trainer_devices=["cuda:0"]',
        "training.lr=6e-4",
    ]


def trainer(run: RunDir) -> dict:
    return read_json(run.trainer_status) or {}


def launch(run_dir: Path, overrides: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run_dir), *overrides],
        cwd=ROOT,
        stdout=open(log_path, "a"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def first_step_after(run: RunDir, known: set[int], timeout: float) -> tuple[float, int]:
    """(wall-clock time, incarnation) of the first step that a trainer not in ``known`` trained:
    its ledger line's time, not when this poll saw it, nor when the restart command returned (which waits
    for the old trainer's exit)."""

    def ready():
        if not run.ledger.is_file():
            return None
        for line in run.ledger.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "time" in row and row.get("incarnation") is not None and row["incarnation"] not in known:
                return row["time"], row["incarnation"]
        return None

    return wait_for(ready, timeout, "the first step of a new trainer")


class _Results(dict):
    """Prints each figure as soon as it is measured (a run cut short still reports what it got)."""

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        print(f"{key:40s} {value:9.1f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="df-restart-", dir="/tmp"))
    run = RunDir(tmp / "run")
    log_path = tmp / "launcher.log"
    results = _Results()
    started = time.time()
    env = {**os.environ, DELAY_ENV: f"trainer.checkpoint={TINY_WRITE_S}"} if args.during_write and args.tiny else None
    launchers = [launch(run.root, overrides_for(args.tiny, run.root), log_path, env)]
    try:
        incarnation = train_a_while(run, args, results, started)
        # 1. restart-trainer: producers and their rings stay; only the trainer is replaced.
        new_incarnation = time_restart_trainer(run, args, results, incarnation)
        # 2. the whole pipeline: stop everything, start again on the same run directory (resume).
        time_full_restart(run, args, results, launchers, log_path, {incarnation, new_incarnation})
    finally:
        stop_and_keep_logs(run, log_path, launchers)
    speedup = results["full_restart_to_first_step_s"] / results["restart_trainer_to_first_step_s"]
    print(f"{'full restart / restart-trainer':40s} {speedup:9.1f}x")
    emit(
        {
            "bench": "restart",
            "tiny": args.tiny,
            "during_write": args.during_write,
            **results,
            "speedup": speedup,
            "log": str(log_path),
        }
    )
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, timeout=600.0, warm_steps=5)
    parser.add_argument(
        "--standby-s",
        type=float,
        default=8.0,
        help="seconds given to the standby trainer's imports before the restart (a run that trained a while)",
    )
    parser.add_argument("--during-write", action="store_true", help="restart right after a checkpoint write began")
    return parser.parse_args(argv)


def train_a_while(run: RunDir, args: argparse.Namespace, results: _Results, started: float) -> int:
    """Wait until the run is as one that trained a while: warm steps, a checkpoint, the standby trainer warm (and
    with ``--during-write``, a checkpoint write just begun); the training trainer's incarnation."""
    wait_for(lambda: len([s for s in ProducerStatus.read_all(run) if s.ready]) >= 1, args.timeout, "producers ready")
    results["cold_producers_ready_s"] = time.time() - started
    t, incarnation = first_step_after(run, set(), args.timeout)
    results["cold_first_step_s"] = t - started
    wait_for(lambda: trainer(run).get("step", 0) >= args.warm_steps, args.timeout, "warm steps")
    # Steady state: the launcher keeps a standby trainer (imported, waiting) once a trainer trains. Give
    # it its imports' time, as a run that has trained a while has (a single-process trainer only).
    standby = wait_for(
        lambda: (LauncherRecord.read(run.launcher) or LauncherRecord()).standby_trainer,
        args.timeout,
        "the standby trainer",
    )
    standby_seen = time.monotonic()
    results["standby_trainer"] = bool(standby)
    # A run that trained a while has checkpointed: its staging buffers (in /dev/shm) exist. Restart soon
    # after that write, before the next checkpoint starts one.
    wait_for(lambda: run.latest_checkpoint() is not None, args.timeout, "the first checkpoint")
    # The standby builds its warm start (head, drafter, a step's kernels; trainer/warm.py) meanwhile.
    trainer_log = run.root / "logs" / "trainer.log"
    wait_for(lambda: WARM_LINE in trainer_log.read_text(), args.timeout, "the standby's warm start")
    results["standby_warm_after_s"] = time.monotonic() - standby_seen
    time.sleep(max(0.0, args.standby_s - (time.monotonic() - standby_seen)))
    if args.during_write:
        before = trainer(run).get("checkpoint_writing")
        in_flight = wait_for(
            lambda: trainer(run).get("checkpoint_writing") not in (None, before) and trainer(run)["checkpoint_writing"],
            args.timeout,
            "a checkpoint write to begin",
        )
        results["write_before_restart_s"] = float((trainer(run).get("last_checkpoint") or {}).get("write_s") or 0.0)
        print(f"restarting while {in_flight} is being written", flush=True)
    return incarnation


def time_restart_trainer(run: RunDir, args: argparse.Namespace, results: _Results, incarnation: int) -> int:
    """restart-trainer with a changed learning rate, timed to the new trainer's first step; its incarnation. The
    producers must be the same processes after it."""
    producer_pids = {s.id: s.pid for s in ProducerStatus.read_all(run)}
    t0 = time.time()
    answer = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "restart-trainer",
            "--run-dir",
            str(run.root),
            "training.lr=3e-4",
            "training.checkpoint_every=1000000",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    if answer.returncode != 0:
        raise RuntimeError(answer.stdout + answer.stderr)
    t1, new_incarnation = first_step_after(run, {incarnation}, args.timeout)
    results["restart_trainer_to_first_step_s"] = t1 - t0
    trainer_log = (run.root / "logs" / "trainer.log").read_text().splitlines()
    handed = [line for line in trainer_log if "handed over in shared memory" in line]
    print("handover:", handed[-1].split(" INFO ", 1)[-1] if handed else "none")
    took_over = [line for line in trainer_log if "took over the state handed over" in line]
    print("takeover:", took_over[-1].split("; ", 1)[-1] if took_over else "no handover (resumed from the checkpoint)")
    assert {s.id: s.pid for s in ProducerStatus.read_all(run)} == producer_pids, "producers were not touched"
    return new_incarnation


def time_full_restart(
    run: RunDir, args: argparse.Namespace, results: _Results, launchers: list, log_path: Path, known: set[int]
) -> None:
    """``stop``, then a fresh launcher on the same run directory (it resumes), timed to its first step."""
    t2 = time.time()
    stopped = subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), "stop", "--run-dir", str(run.root)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    launchers[-1].wait(timeout=args.timeout)
    results["full_stop_s"] = time.time() - t2
    if stopped.returncode != 0:
        raise RuntimeError(stopped.stdout + stopped.stderr)
    t3 = time.time()
    launchers.append(launch(run.root, [], log_path))
    t4, _ = first_step_after(run, known, args.timeout)
    results["full_start_to_first_step_s"] = t4 - t3
    results["full_restart_to_first_step_s"] = t4 - t2


def stop_and_keep_logs(run: RunDir, log_path: Path, launchers: list) -> None:
    """Stop the run; under $OUT, keep its logs (the run directory dies with a GPU machine that starts bare)."""
    subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), "stop", "--run-dir", str(run.root)],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
    )
    if os.environ.get("OUT"):
        for path in [log_path, *sorted((run.root / "logs").glob("*.log"))][:5]:
            Path(os.environ["OUT"], f"restart_{path.name}").write_text(path.read_text()[-200_000:])
    if launchers[-1].poll() is None:
        launchers[-1].kill()


if __name__ == "__main__":
    sys.exit(main())

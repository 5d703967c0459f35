"""Cheap stand-ins for the producer and the trainer, keeping their process contract, for launcher tests.

    python -m tests.launcher_roles producer --run-dir DIR --producer-id I [--device DEV]
    python -m tests.launcher_roles trainer --run-dir DIR

The launcher runs them through its testing hook (DFLASH_PRODUCER_CMD / DFLASH_TRAINER_CMD). They
load no model and import nothing heavy, so a whole pipeline starts in well under a second.

Producer: after STANDIN_READY_DELAY_S (0.2) writes producers/p{I}.json with ready true (and the thread
limits it was given), then refreshes it every 0.2 s; keeps a file named like a socket in DIR/sockets
while it runs; exits 0 on SIGTERM/SIGINT. STANDIN_PRODUCER_EXIT=N: exit N at once instead.

Trainer: one step per STANDIN_STEP_S (0.02) into trainer.json (plus lr, the device list and the thread limits
it was given) and a metrics.jsonl line per step; resumes from checkpoints/standin.json; finishes
(state "finished", exit 0) at training.max_steps (0: never); on SIGTERM checkpoints and exits 0
with state "stopped". STANDIN_TRAINER_EXIT=N: exit N at once instead. STANDIN_TRAINER_CHECKPOINT_THEN_CRASH=K:
incarnations 1..K each move checkpoints/latest.json one step on and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import tomllib
from pathlib import Path

from common.naming import owner_identity, process_alive
from common.rundir import atomic_write_json, read_json

stop_requested = False


def _request_stop(_signum: int, _frame: object) -> None:
    global stop_requested
    stop_requested = True


def _config(run_dir: Path) -> dict:
    return tomllib.loads((run_dir / "config.toml").read_text())


def _threads() -> dict[str, str | None]:
    """The thread limits this process was given (torch reads them at its import)."""
    return {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def run_producer(run_dir: Path, producer_id: int, device: str) -> int:
    if "STANDIN_PRODUCER_EXIT" in os.environ:
        print(f"stand-in producer {producer_id}: exiting with {os.environ['STANDIN_PRODUCER_EXIT']} as told")
        return int(os.environ["STANDIN_PRODUCER_EXIT"])
    slots = _config(run_dir)["ring"]["num_slots"]
    socket_file = run_dir / "sockets" / f"p{producer_id}.{owner_identity()}.ipc"
    socket_file.touch()
    status_path = run_dir / "producers" / f"p{producer_id}.json"
    started = time.time()
    ready_at = started + float(os.environ.get("STANDIN_READY_DELAY_S", "0.2"))
    print(f"stand-in producer {producer_id} on {device}")
    try:
        while not stop_requested:
            now = time.time()
            atomic_write_json(
                status_path,
                {
                    "id": producer_id,
                    "pid": os.getpid(),
                    "ready": now >= ready_at,
                    "endpoint": f"ipc://{socket_file}",
                    "updated": now,
                    "device": device,
                    "ring": {"slots": slots, "free": 1, "filling": 0, "ready": slots - 1, "leased": 0},
                    "tokens_per_s": 1000.0,
                    "blocked_fraction": 0.5,
                    "threads": _threads(),
                },
            )
            time.sleep(0.2 if now >= ready_at else 0.02)
    finally:
        socket_file.unlink(missing_ok=True)
    return 0


def _producers_ready(run_dir: Path) -> bool:
    statuses = [read_json(path) or {} for path in (run_dir / "producers").glob("p*.json")]
    return bool(statuses) and all(s.get("ready") and process_alive(s.get("pid")) for s in statuses)


def run_trainer(run_dir: Path) -> int:
    if "STANDIN_TRAINER_EXIT" in os.environ:
        print(f"stand-in trainer: exiting with {os.environ['STANDIN_TRAINER_EXIT']} as told")
        return int(os.environ["STANDIN_TRAINER_EXIT"])
    training = _config(run_dir)["training"]
    checkpoint = run_dir / "checkpoints" / "standin.json"
    saved = read_json(checkpoint) or {"step": 0, "incarnation": 0}
    step, incarnation = saved["step"], saved["incarnation"] + 1
    atomic_write_json(checkpoint, {"step": step, "incarnation": incarnation})
    if incarnation <= int(os.environ.get("STANDIN_TRAINER_CHECKPOINT_THEN_CRASH", "0")):
        # A new checkpoint (latest.json further on), then a crash: progress between crashes.
        atomic_write_json(
            run_dir / "checkpoints" / "latest.json", {"name": f"step-{incarnation:08d}", "step": incarnation}
        )
        print(f"stand-in trainer incarnation {incarnation}: checkpointed step {incarnation}, crashing as told")
        return 1
    step_s = float(os.environ.get("STANDIN_STEP_S", "0.02"))
    common = {
        "pid": os.getpid(),
        "incarnation": incarnation,
        "max_steps": training["max_steps"],
        "lr": training["lr"],
        "devices": os.environ.get("DFLASH_TRAINER_DEVICES"),
        "producers_ready_at_start": _producers_ready(run_dir),
        "threads": _threads(),
    }

    def report(state: str) -> None:
        atomic_write_json(run_dir / "trainer.json", {**common, "step": step, "state": state, "updated": time.time()})

    report("starting")
    print(f"stand-in trainer incarnation {incarnation} from step {step}")
    while not stop_requested and not (training["max_steps"] and step >= training["max_steps"]):
        time.sleep(step_s)
        step += 1
        with (run_dir / "metrics.jsonl").open("a") as metrics:
            metrics.write(json.dumps({"step": step, "loss": 1.0 / step, "incarnation": incarnation}) + "\n")
        report("training")
    atomic_write_json(checkpoint, {"step": step, "incarnation": incarnation})
    report("stopped" if stop_requested else "finished")
    return 0


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["producer", "trainer"])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--producer-id", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.role == "producer":
        return run_producer(args.run_dir, args.producer_id, args.device)
    return run_trainer(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())

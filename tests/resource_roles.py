"""Programs the resource tests run inside a small file system (a tmpfs in a private mount namespace).

    python -m tests.resource_roles checkpoint --run-dir DIR --limit tmpfs|rlimit

``checkpoint``: a real Trainer (tiny config, the target head exported as a producer would) writes
checkpoint step 0, then step 7 onto a full disk (``tmpfs``: DIR/checkpoints is a small tmpfs that
this program fills; ``rlimit``: RLIMIT_FSIZE where no mount namespace is available), then step 7
again once there is room. Prints one JSON line with what it saw after each.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint_state(run) -> dict:
    """What a restart would find: the latest checkpoint, whether it loads, and stray partial folders."""
    from common.rundir import read_json
    from trainer.checkpoint import read_train_state

    latest = run.latest_checkpoint()
    state = {
        "latest": latest.name if latest else None,
        "pointer": read_json(run.checkpoints / "latest.json"),
        "partial": sorted(p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")),
    }
    if latest is not None:
        state["step"] = read_json(latest / "trainer_state.json")["step"]
        state["loads"] = bool(read_train_state(latest)["optimizer"])
        state["drafter_files"] = sorted(p.name for p in (latest / "drafter").iterdir())
    return state


def checkpoint(args: argparse.Namespace) -> int:
    from common.config import load_config, save_config
    from common.rundir import CheckpointError, RunDir
    from producer.build import load_target
    from trainer.train import Trainer

    run = RunDir(args.run_dir)
    cfg = load_config(ROOT / "launch" / "tiny.toml", ['logging.wandb_mode="disabled"'])
    save_config(cfg, run.config)
    load_target(cfg, run, producer_id=0, device=None, group=None)  # exports the target's head, as a producer does
    trainer = Trainer(cfg, run)
    report: dict = {}
    trainer.save_checkpoint()
    trainer.checkpoints.wait()
    report["first"] = _checkpoint_state(run)

    filler = run.checkpoints / "filler"
    if args.limit == "tmpfs":
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
    else:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    trainer.step = 7
    try:
        trainer.save_checkpoint()  # written in the background: the failure comes with the wait
        trainer.checkpoints.wait()
        report["error"] = None
    except CheckpointError as exc:
        report["error"] = str(exc)
    report["after_failure"] = _checkpoint_state(run)

    filler.unlink(missing_ok=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    trainer.save_checkpoint(blocking=True)
    report["after_room"] = _checkpoint_state(run)
    trainer.close()  # as the trainer process ends: its staging segments in /dev/shm go with it
    print(json.dumps(report), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=["checkpoint"])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--limit", choices=["tmpfs", "rlimit"], default="tmpfs")
    return checkpoint(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

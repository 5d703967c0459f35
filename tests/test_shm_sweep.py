"""What the sweep of dead owners' /dev/shm segments may take: a dead producer's ring, never a trainer's
state handed over (its owner has exited by design before its successor maps it), and only this run's.
Real processes and the real /dev/shm, as tests/test_ring_host.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from common import naming
from common.ring import HostRing
from trainer import handover

# A process that makes a producer's ring and stages a trainer's state in shared memory, as restart-trainer's
# old trainer does, and exits without removing either (a killed producer; a trainer that handed over).
DEAD_OWNER = """
import json, os, sys, torch
from common.ring import HostRing
from trainer.handover import SharedStaging
ring = HostRing.create(sys.argv[1], "p0", num_slots=2, slot_bytes=4096)
staging = SharedStaging(sys.argv[1])
weights = staging.copy({"w": torch.arange(1000, dtype=torch.float32)}, "drafter")
extras = staging.copy({"step": torch.tensor(7)}, "extras")
print(json.dumps({"ring": str(ring.path), "weights": staging.describe(weights), "train_state": staging.describe(extras),
                  "segments": [s["path"] for s in staging.segments.values()]}), flush=True)
os._exit(0)
"""


def dead_owner(tag: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", DEAD_OWNER, tag], capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_ring_creation_sweeps_a_dead_producers_ring_but_not_a_state_handed_over():
    left = dead_owner("sweeptest-handover")
    segments = [Path(p) for p in left["segments"]]
    ring = None
    try:
        assert Path(left["ring"]).exists() and all(p.exists() for p in segments)
        assert all(".trainer-" in p.name for p in segments), segments
        ring = HostRing.create("sweeptest-other", "p0", num_slots=1, slot_bytes=4096)  # a producer starts on the host
        assert not Path(left["ring"]).exists(), "a dead producer's ring is swept"
        assert all(p.exists() for p in segments), "a state handed over is not swept by a producer's start"
        # The successor still takes it over (and removes the names).
        taken = handover.take(
            {
                "trees": {"weights": left["weights"], "train_state": left["train_state"]},
                "meta": {"step": 7},
                "drafter_config": {},
            }
        )
        assert taken is not None and torch.equal(taken.weights["w"], torch.arange(1000, dtype=torch.float32))
        assert int(taken.train_state["step"]) == 7 and not any(p.exists() for p in segments)
    finally:
        if ring is not None:
            ring.close()
        for p in [Path(left["ring"]), *segments]:
            p.unlink(missing_ok=True)


def test_a_trainer_sweeps_its_own_runs_dead_staging_and_not_another_runs_of_the_same_folder_name(tmp_path):
    ours, theirs = tmp_path / "a" / "run", tmp_path / "b" / "run"
    left = {tag: dead_owner(tag) for tag in (naming.run_tag(ours), naming.run_tag(theirs))}
    try:
        removed = naming.sweep_stale_trainer_staging(naming.run_tag(ours))  # our trainer starts (trainer/train.py)
        assert sorted(map(str, removed)) == sorted(left[naming.run_tag(ours)]["segments"]), "our dead trainer's staging"
        assert all(Path(p).exists() for p in left[naming.run_tag(theirs)]["segments"]), "the other run's is left alone"
    finally:
        for paths in left.values():
            for p in [paths["ring"], *paths["segments"]]:
                Path(p).unlink(missing_ok=True)


def test_the_run_tag_is_unique_per_run_directory(tmp_path, monkeypatch):
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert naming.run_tag(a) != naming.run_tag(b)
    assert naming.run_tag(a).startswith("run") and naming.run_tag(a) == naming.run_tag(a)
    monkeypatch.chdir(tmp_path)
    assert naming.run_tag(Path("a/run")) == naming.run_tag(a), "the resolved path counts, not how it is written"
    # A long folder name: the names of the segments still differ (the tag is cut in segment_name).
    long_a, long_b = tmp_path / "a" / ("x" * 100), tmp_path / "b" / ("x" * 100)
    assert naming.segment_name(naming.run_tag(long_a), "p0") != naming.segment_name(naming.run_tag(long_b), "p0")


def test_the_launcher_removes_the_staging_of_a_trainer_killed_as_the_runs_last(short_tmp):
    """A trainer killed with -9 keeps its checkpoint staging (its weights and optimizer state) in /dev/shm; the
    next trainer of the run sweeps it. When the run stops before one comes, the launcher sweeps it at its exit."""
    from peers import wait_for
    from test_pipeline import ONE_PRODUCER, start, stop_and_finish, trainer_step

    from common.rundir import RunDir, read_json

    run_dir = short_tmp / "run"
    run_dir.mkdir()
    prefix = naming.trainer_staging_prefix(naming.run_tag(run_dir))
    staging = lambda: sorted(p for p in naming.SHM_DIR.iterdir() if p.name.startswith(prefix))  # noqa: E731
    # No restart within the test: the killed trainer is the run's last.
    launcher = start(
        run_dir, "training.max_steps=0", "training.epochs=50", "launch.restart_backoff_s=60", *ONE_PRODUCER
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 9 and staging(), "the first checkpoint, staged in /dev/shm", 120)
    victim = read_json(run.trainer_status)["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not naming.process_alive(victim), "the trainer's death", 30)
    left = staging()
    assert left, "the killed trainer's staging is still there before the launcher stops"
    stop_and_finish(launcher, run_dir)
    assert not staging(), f"left in /dev/shm after the run: {staging()}"
    said = (run_dir / "logs" / "launcher.log").read_text() + (short_tmp / "launcher.out").read_text()
    assert "the staging of a trainer that did not exit cleanly" in said

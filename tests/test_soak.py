"""The soak program (launch/tools/soak.py) run briefly: trainer replaced by restart-trainer and by kill -9,
producer 1 killed once; nothing may leak. ``python -m launch.tools.soak --minutes 30`` is the real soak.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_a_short_soak_leaks_no_segments_sockets_processes_or_descriptors(short_tmp):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.tools.soak",
            "--run-dir",
            str(short_tmp / "run"),
            "--minutes",
            "3",
            "--sample-s",
            "2",
            "--trainer-restart-s",
            "60",
            "training.checkpoint_every=20",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    events = [e["event"] for e in report["events"]]
    assert {"restart-trainer", "trainer kill -9", "producer-1 kill -9"} <= set(events), events
    # Two producers: two segments and two sockets at any time (a dead one's are swept by its successor).
    for gauge in ("segments", "sockets"):
        assert report[gauge]["max"] == 2 and report[gauge]["end"] == 2 and report[gauge]["after_stop"] == 0, report[
            gauge
        ]
    # The trainer stages its checkpoints in /dev/shm (2 segments): at most an old trainer's and its successor's
    # during a handover; a killed trainer's are swept by the next, so restarts and kills never add up.
    staging = report["staging_segments"]
    assert staging["max"] <= 4 and staging["end"] <= 2 and staging["after_stop"] == 0, staging
    assert report["tagged_processes"]["after_stop"] == 0, "a process of the run outlived it"
    processes = {p["pid"]: p for p in report["processes"]}
    lived_through = [p for p in processes.values() if p["role"] in ("launcher", "producer-0")]
    assert len(lived_through) == 2
    for p in lived_through:
        assert p["fds"]["end"] <= p["fds"]["warm"], f"{p['role']} holds more descriptors after the restarts: {p['fds']}"
    for p in processes.values():
        if p["role"].startswith("producer"):
            # The record of handed-out batches is pruned by each checkpoint (every 20 steps here); it
            # may also hold the ring, the trainer's staged batches and a second's worth of new ones.
            assert p["stream_history"]["max"] <= 50, p

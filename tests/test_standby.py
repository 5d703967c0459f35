"""A standby trainer stopped before it was needed leaves at once with exit 0 (not killed by the signal,
which the launcher would report as a crash at the end of every run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from common.config import load_config, save_config
from common.rundir import RunDir
from tests.test_producer import ROOT


def test_a_waiting_standby_stops_cleanly_on_sigterm(short_tmp):
    run = RunDir(short_tmp / "run")
    run.root.mkdir()
    save_config(load_config(ROOT / "launch" / "tiny.toml"), run.config)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.train", "--run-dir", str(run.root), "--standby"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("waiting to take over" in line for line in lines):  # past its imports
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    reader.join(timeout=10)
    output = "".join(lines)
    assert proc.returncode == 0, output[-2000:]
    assert "standby trainer stopped before it was needed" in output
    # It writes into trainer.log beside the running trainer: each of its log lines says it is the standby.
    logged = [line for line in lines if " INFO " in line]
    assert logged and all(" standby-trainer-r0 INFO " in line for line in logged), logged

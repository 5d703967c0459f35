"""Start demo producer/consumer processes for the transport tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(role: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "common.demo", role, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_event(proc: subprocess.Popen, event: str) -> dict:
    """Next JSON line with this event from the process's stdout."""
    for line in proc.stdout:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            return record
    raise AssertionError(f"process ended without {event!r}: {proc.stderr.read()[-2000:]}")

"""Start demo producer/consumer processes for the transport tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(role: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launch.tools.demo", role, *args],
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


def wait_for(predicate: Callable[[], object], what: str, timeout_s: float = 20.0) -> object:
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def parent_pid(pid: int) -> int:
    """``pid``'s parent, from /proc."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def child_pids(parent: int) -> list[int]:
    """The processes whose parent is ``parent``, from /proc (one that ends while it is read is left out)."""
    children = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if parent_pid(int(proc.name)) == parent:
                children.append(int(proc.name))
        except (OSError, IndexError):
            continue
    return children

"""Whoever starts the MPS control daemon stops it on every way out, and a start clears one left behind.

No GPU here: ``FAKE`` stands in for nvidia-cuda-mps-control, first on PATH. Like the real one, its ``-d`` starts a
daemon that leaves the starter's process group (so a TERM or a kill of that group does not reach it) and records
its pid in the pipe directory, and its client fails when no daemon listens on ``$CUDA_MPS_PIPE_DIRECTORY``. It
logs every start and every command the daemon took (``FAKE_MPS_LOG``); ``FAKE_MPS_START_HOLD_S`` holds ``-d`` that
long after the daemon started, so that a test signals the starter while it is up.

The starters are real: ``python -m launch.bench.mps`` (its GPU roles fail here, after the daemon started) and
``python -m launch.bench.kinds`` (its rows, runs of the launcher on ``cuda:0``, fail here the same way).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from peers import wait_for

from launch.mps import MPS_CONTROL

ROOT = Path(__file__).resolve().parents[1]
FAKE = """#!/bin/bash
pipe="$CUDA_MPS_PIPE_DIRECTORY"
pidfile="$pipe/nvidia-cuda-mps-control.pid"
if [ "$1" = "-d" ]; then
  if [ -e "$pipe/control" ] && kill -0 "$(cat "$pidfile" 2>/dev/null)" 2>/dev/null; then
    echo "An instance of this daemon is already running" >&2
    exit 1
  fi
  rm -f "$pidfile"
  setsid bash -c 'echo $$ > "$0"; exec sleep 3600' "$pidfile" </dev/null >/dev/null 2>&1 &
  for _ in $(seq 200); do [ -s "$pidfile" ] && break; sleep 0.05; done
  touch "$pipe/control"
  echo "start pid=$(cat "$pidfile") pipe=$pipe" >> "$FAKE_MPS_LOG"
  sleep "${FAKE_MPS_START_HOLD_S:-0}"
  exit 0
fi
read -r command
pid=$(cat "$pidfile" 2>/dev/null)
if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
  echo "Cannot find MPS control daemon process"
  exit 1
fi
echo "$command pid=$pid pipe=$pipe" >> "$FAKE_MPS_LOG"
if [ "$command" = quit ]; then
  kill "$pid"
  rm -f "$pipe/control" "$pidfile"
fi
"""


@dataclass
class FakeMps:
    """The stand-in on PATH and what it logged."""

    env: dict[str, str]
    log: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def started(self) -> list[int]:
        """The pids of the daemons started, in order."""
        return [int(m.group(1)) for line in self.lines() if (m := re.match(r"start pid=(\d+)", line))]

    def quit_pids(self) -> list[int]:
        return [int(m.group(1)) for line in self.lines() if (m := re.match(r"quit pid=(\d+)", line))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon killed by the stand-in's quit is reaped by init at once; a zombie would still answer kill -0.
    return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()


@pytest.fixture
def fake_mps(short_tmp):
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / MPS_CONTROL).write_text(FAKE)
    (bin_dir / MPS_CONTROL).chmod(0o755)
    fake = FakeMps(
        {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_MPS_LOG": str(short_tmp / "mps.log"),
            "TMPDIR": str(short_tmp),  # the pipe directories, under tempfile.gettempdir()
        },
        short_tmp / "mps.log",
    )
    yield fake
    for pid in fake.started():  # a daemon a failed test left running (it is in a session of its own)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def _interruptible() -> None:
    # A shell's foreground command takes Ctrl-C; a test run started in the background inherits SIGINT ignored
    # (POSIX, for asynchronous commands without job control), and Python keeps an ignored SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bench_mps(fake: FakeMps, **env: str) -> subprocess.Popen:
    """``python -m launch.bench.mps`` in a process group of its own, as a shell runs a command in the foreground."""
    return subprocess.Popen(
        [sys.executable, "-m", "launch.bench.mps", "--seconds", "1", "--hog-percents", "90"],
        cwd=ROOT,
        env={**fake.env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
        preexec_fn=_interruptible,
    )


def started_and_held(fake: FakeMps, proc: subprocess.Popen, count: int = 1) -> int:
    """Wait until the ``count``-th daemon runs (the starter then waits in ``-d``); its pid."""
    wait_for(lambda: len(fake.started()) >= count or proc.poll() is not None, "the daemon's start", 60)
    assert len(fake.started()) >= count, proc.communicate()[0]
    return fake.started()[count - 1]


def test_a_benchmark_that_fails_quits_its_daemon(fake_mps):
    """The exception path: no GPU for the benchmark's roles, an error, and the daemon still gets its quit."""
    proc = bench_mps(fake_mps)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, output
    assert "a launch.bench.mps role exited with" in output
    (daemon,) = fake_mps.started()
    assert fake_mps.quit_pids() == [daemon], fake_mps.lines()
    assert not alive(daemon)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_to_the_benchmarks_process_group_quits_its_daemon(fake_mps, signum, code):
    """TERM (a kill of the group) and INT (Ctrl-C) to the whole process group: the daemon is in a session of its own
    and would outlive the benchmark; the benchmark tells it to quit on its way out."""
    proc = bench_mps(fake_mps, FAKE_MPS_START_HOLD_S="60")
    daemon = started_and_held(fake_mps, proc)
    os.killpg(proc.pid, signum)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == code, output
    assert fake_mps.quit_pids() == [daemon], fake_mps.lines()
    wait_for(lambda: not alive(daemon), "the daemon's exit", 10)


def test_a_daemon_left_by_a_benchmark_killed_with_9_is_cleared_by_the_next_start(fake_mps):
    first = bench_mps(fake_mps, FAKE_MPS_START_HOLD_S="60")
    stale = started_and_held(fake_mps, first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    time.sleep(0.5)
    assert alive(stale), "kill -9 leaves the daemon running"

    second = bench_mps(fake_mps)
    output, _ = second.communicate(timeout=120)
    assert re.search(
        rf"an MPS control daemon of pipe \S+ \(pid {stale}\) is still running, left by an earlier run that could not "
        "stop it: telling it to quit before starting this one",
        output,
    ), output
    assert not alive(stale)
    stale_quit, new = fake_mps.started()[0], fake_mps.started()[1]
    assert stale_quit == stale and fake_mps.quit_pids() == [stale, new], fake_mps.lines()
    assert not alive(new)


def test_a_term_to_the_kinds_benchmarks_group_while_its_rows_run_quits_its_daemon(fake_mps, short_tmp):
    """The case that left MPS behind: launch.bench.kinds, its rows running under its daemon, killed with a TERM to
    its process group."""
    from launch.bench.served.prompts import smollm2_gguf

    out = short_tmp / "out"
    out.mkdir()
    (out / "quality-data.json").write_text("{}")  # the data of an earlier call: the rows start at once
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.bench.kinds", "--gguf", str(smollm2_gguf()), "--out", str(out)]
        + ["--card-gib", "139.8", "dflash", "dflash2"],
        cwd=ROOT,
        env=fake_mps.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        process_group=0,
    )
    wait_for(lambda: (out / "kinds-dflash2-s0.log").exists() or proc.poll() is not None, "the rows' start", 120)
    (daemon,) = fake_mps.started()
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert fake_mps.quit_pids() == [daemon], fake_mps.lines()
    wait_for(lambda: not alive(daemon), "the daemon's exit", 10)

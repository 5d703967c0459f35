"""Soak: run the pipeline for a long time with trainer restarts and a producer kill; watch for leaks.

    python -m launch.tools.soak [--minutes 30] [--run-dir DIR] [--sample-s 5] [--trainer-restart-s 150] [key=value ...]

Starts ``launch/run_all.sh`` on the tiny default (or DIR's config, with the overrides), trained
without end, and every ``--trainer-restart-s`` replaces the trainer, alternately by
``restart-trainer`` and by kill -9; half-way it kills producer 1 with kill -9 (the launcher
restarts it). Every ``--sample-s`` it records, for every process of the run (each carries the
soak's tag in its environment, so helpers such as wandb-core and anything orphaned by a kill -9 are
seen), its resident memory (VmRSS) and its open file descriptors, and for the run: the number of
such processes, its /dev/shm segments and its socket files (every sample also goes to
``DIR.soak.jsonl``, next to the run directory). At the end it stops the run and checks that nothing
is left. It prints a table and one JSON line:

- per process (role, pid, seconds sampled): RSS at start, after warm-up (``WARM_UP_S`` or a quarter
  of its sampled life), at the end and the maximum, its growth rate after warm-up (MiB/h, least
  squares), and fds the same way;
- producers: the length of their record of uncommitted batches (``stream.history``) at start/end/max;
- ring segments, the trainers' staging segments, sockets and tagged processes: at start, at the end, the
  maximum, and after the stop.

Exit 0 when the run stopped cleanly and left nothing behind, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from common.naming import SHM_DIR, parse_owner, process_alive, process_start_ticks, run_tag, segment_name
from common.rundir import RunDir, read_json
from common.status import LauncherRecord, ProducerStatus
from launch.runs import REPO_ROOT

TAG_ENV = "DFLASH_SOAK_TAG"
ENDLESS = ["training.max_steps=100000000"]
WARM_UP_S = 60.0
"""A process's memory is judged after a quarter of its sampled life, and at least this long (it loads
torch and its model first); its growth rate only when it was then sampled at least this long."""


@dataclass
class Series:
    """Samples of one process: (seconds since the soak started, RSS bytes, open fds)."""

    role: str
    pid: int
    samples: list[tuple[float, int, int]] = field(default_factory=list)
    history: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        times = [t for t, _, _ in self.samples]
        rss = [r for _, r, _ in self.samples]
        fds = [f for _, _, f in self.samples]
        life = times[-1] - times[0]
        warm = next(i for i, t in enumerate(times) if t >= times[0] + min(life, max(WARM_UP_S, life / 4)))
        measured = times[-1] - times[warm] >= WARM_UP_S
        out = {
            "role": self.role,
            "pid": self.pid,
            "seconds": round(life, 1),
            "samples": len(rss),
            "rss_mib": {"start": _mib(rss[0]), "warm": _mib(rss[warm]), "end": _mib(rss[-1]), "max": _mib(max(rss))},
            "rss_growth_mib_per_h": _mib(_slope(times[warm:], rss[warm:]) * 3600) if measured else None,
            "fds": {"start": fds[0], "warm": fds[warm], "end": fds[-1], "max": max(fds)},
        }
        if self.history:
            out["stream_history"] = {"start": self.history[0], "end": self.history[-1], "max": max(self.history)}
        return out


@dataclass
class Gauge:
    """A count of the whole run over time (segments, sockets, tagged processes)."""

    values: list[int] = field(default_factory=list)
    after_stop: int | None = None

    def summary(self) -> dict:
        return {"start": self.values[0], "end": self.values[-1], "max": max(self.values), "after_stop": self.after_stop}


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


def _slope(xs: list[float], ys: list[int]) -> float:
    """Least-squares slope of ys over xs (units of y per unit of x)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``TAG_ENV=tag``."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and process_alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def program_name(pid: int) -> str:
    """The file name of ``pid``'s program (a helper such as wandb-core), or "?"."""
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()).name or "?"
    except OSError:
        return "?"


def run_segments(run: RunDir, owners: set[tuple[int, int]], trainer: bool = False) -> list[str]:
    """This run's segments in /dev/shm: ``dflash.<run tag>.<role>.<pid>-<start>`` (common.naming) made by
    one of ``owners`` (the tag tells runs with folders of the same name apart). The producers' rings, or with
    ``trainer`` the trainers' checkpoint staging (trainer/handover.py), whose role starts with ``trainer``."""
    prefix = segment_name(run_tag(run.root), "role").rsplit(".", 2)[0] + "."
    return sorted(
        p.name
        for p in SHM_DIR.iterdir()
        if p.name.startswith(prefix)
        and parse_owner(p.name) in owners
        and p.name[len(prefix) :].startswith("trainer") == trainer
    )


def run_sockets(run: RunDir) -> list[str]:
    return sorted(p.name for p in run.sockets.iterdir()) if run.sockets.is_dir() else []


class Soak:
    """One soak: the run, its schedule of restarts, and what was sampled."""

    def __init__(
        self, run: RunDir, overrides: list[str], minutes: float, sample_s: float, trainer_restart_s: float
    ) -> None:
        self.run = run
        self.overrides = overrides
        self.duration_s = minutes * 60
        self.sample_s = sample_s
        self.trainer_restart_s = trainer_restart_s
        self.tag = uuid.uuid4().hex
        self.series: dict[int, Series] = {}
        self.segments, self.staging, self.sockets, self.processes = Gauge(), Gauge(), Gauge(), Gauge()
        self.events: list[dict] = []
        self.started = 0.0
        self.samples_path = run.root.with_name(run.root.name + ".soak.jsonl")
        self.owners: set[tuple[int, int]] = set()
        """(pid, start ticks) of every process of the run seen, to tell its segments from others'."""

    def command(self, *args: str) -> subprocess.CompletedProcess:
        """``launch/run_all.sh ARGS --run-dir DIR`` (restart-trainer, stop)."""
        return subprocess.run(
            [str(REPO_ROOT / "launch" / "run_all.sh"), *args, "--run-dir", str(self.run.root)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def run_soak(self) -> int:
        """Run it, print the report; 0 when the run stopped cleanly and left nothing behind."""
        env = {**os.environ, TAG_ENV: self.tag}
        launcher = subprocess.Popen(
            [str(REPO_ROOT / "launch" / "run_all.sh"), "--run-dir", str(self.run.root), *ENDLESS, *self.overrides],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._wait_training(launcher)
            self.started = time.monotonic()
            next_restart = self.trainer_restart_s
            producer_killed = False
            restarts = 0
            while (now := time.monotonic() - self.started) < self.duration_s and launcher.poll() is None:
                self.sample(now)
                if now >= next_restart:
                    restarts += 1
                    self.restart_trainer(kill=restarts % 2 == 0)
                    next_restart = now + self.trainer_restart_s
                if not producer_killed and now >= self.duration_s / 2:
                    producer_killed = True
                    self.kill_producer(1)
                time.sleep(max(0.0, self.sample_s - (time.monotonic() - self.started - now)))
            self.sample(time.monotonic() - self.started)
            stopped = self.command("stop").returncode == 0 and launcher.wait(timeout=300) == 0
        finally:
            if launcher.poll() is None:
                launcher.send_signal(signal.SIGTERM)
                launcher.wait(timeout=300)
        time.sleep(1.0)  # let killed helpers be reaped before counting leftovers
        self.segments.after_stop = len(run_segments(self.run, self.owners))
        self.staging.after_stop = len(run_segments(self.run, self.owners, trainer=True))
        self.sockets.after_stop = len(run_sockets(self.run))
        self.processes.after_stop = len(tagged_processes(self.tag))
        clean = stopped and not (
            self.segments.after_stop or self.staging.after_stop or self.sockets.after_stop or self.processes.after_stop
        )
        self.report(stopped, clean)
        return 0 if clean else 1

    def _wait_training(self, launcher: subprocess.Popen) -> None:
        deadline = time.monotonic() + 600
        while (read_json(self.run.trainer_status) or {}).get("step", 0) < 1:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the pipeline did not start training; see {self.run.logs}")
            time.sleep(0.5)

    def pids(self) -> dict[str, int]:
        """Role -> pid of the run's processes now (from launcher.json)."""
        record = LauncherRecord.read(self.run.launcher) or LauncherRecord()
        found = {"launcher": record.pid}
        for producer in record.producers:
            found[f"producer-{producer.id}"] = producer.pid
        found["trainer"] = record.trainer.pid
        return {role: pid for role, pid in found.items() if pid}

    def sample(self, now: float) -> None:
        statuses = {s.pid: s for s in ProducerStatus.read_all(self.run)}
        roles = {pid: role for role, pid in self.pids().items()}
        tagged = tagged_processes(self.tag)
        self.owners |= {(pid, process_start_ticks(pid)) for pid in tagged}
        for pid in tagged:
            rss, fds = rss_bytes(pid), open_fds(pid)
            if rss is None or fds is None:
                continue
            series = self.series.setdefault(pid, Series(program_name(pid), pid))
            series.role = roles.get(pid, series.role)  # a new process may be sampled before launcher.json names it
            series.samples.append((now, rss, fds))
            history = statuses[pid].stream.get("history") if pid in statuses else None
            if history is not None:
                series.history.append(history)
        self.segments.values.append(len(run_segments(self.run, self.owners)))
        self.staging.values.append(len(run_segments(self.run, self.owners, trainer=True)))
        self.sockets.values.append(len(run_sockets(self.run)))
        self.processes.values.append(len(tagged))
        with self.samples_path.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "t": round(now, 1),
                        "segments": self.segments.values[-1],
                        "staging_segments": self.staging.values[-1],
                        "sockets": self.sockets.values[-1],
                        "processes": {
                            pid: [s.role, *s.samples[-1][1:]]
                            for pid, s in self.series.items()
                            if s.samples[-1][0] == now
                        },
                    }
                )
                + "\n"
            )

    def restart_trainer(self, kill: bool) -> None:
        pid = self.pids().get("trainer")
        if kill and pid:
            os.kill(pid, signal.SIGKILL)
        elif not kill:
            answer = self.command("restart-trainer")
            if answer.returncode != 0:
                raise RuntimeError(f"restart-trainer failed: {answer.stdout}{answer.stderr}")
        self.events.append(
            {
                "t": round(time.monotonic() - self.started, 1),
                "event": "trainer kill -9" if kill else "restart-trainer",
                "pid": pid,
            }
        )

    def kill_producer(self, producer_id: int) -> None:
        pid = self.pids().get(f"producer-{producer_id}")
        if pid:
            os.kill(pid, signal.SIGKILL)
        self.events.append(
            {"t": round(time.monotonic() - self.started, 1), "event": f"producer-{producer_id} kill -9", "pid": pid}
        )

    def report(self, stopped: bool, clean: bool) -> None:
        processes = [s.summary() for s in self.series.values() if len(s.samples) >= 2]
        print(f"soak of {self.run.root}: {self.duration_s / 60:.1f} min, a sample every {self.sample_s:g} s")
        for event in self.events:
            print(f"  at {event['t']:7.1f} s  {event['event']} (pid {event['pid']})")
        header = f"{'process':<11} {'pid':>7} {'s':>6}  {'RSS MiB start':>13} {'warm':>6} {'end':>6} {'max':>6} {'MiB/h':>6}  {'fds start':>9} {'end':>4} {'max':>4}  {'history end/max':>15}"
        print(header)
        for p in processes:
            history = p.get("stream_history")
            growth = p["rss_growth_mib_per_h"]
            print(
                f"{p['role']:<11} {p['pid']:>7} {p['seconds']:>6.0f}  {p['rss_mib']['start']:>13.1f} {p['rss_mib']['warm']:>6.1f} "
                f"{p['rss_mib']['end']:>6.1f} {p['rss_mib']['max']:>6.1f} {growth if growth is not None else '-':>6}  "
                f"{p['fds']['start']:>9} {p['fds']['end']:>4} {p['fds']['max']:>4}  "
                f"{(str(history['end']) + '/' + str(history['max'])) if history else '-':>15}"
            )
        for name, gauge in (
            ("segments", self.segments),
            ("staging", self.staging),
            ("sockets", self.sockets),
            ("processes", self.processes),
        ):
            s = gauge.summary()
            print(f"{name:<10} start {s['start']}  end {s['end']}  max {s['max']}  after stop {s['after_stop']}")
        print("stopped cleanly, nothing left behind" if clean else "NOT CLEAN: see the figures above")
        print(
            json.dumps(
                {
                    "run_dir": str(self.run.root),
                    "minutes": round(self.duration_s / 60, 2),
                    "sample_s": self.sample_s,
                    "stopped": stopped,
                    "clean": clean,
                    "events": self.events,
                    "processes": processes,
                    "segments": self.segments.summary(),
                    "staging_segments": self.staging.summary(),
                    "sockets": self.sockets.summary(),
                    "tagged_processes": self.processes.summary(),
                }
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Soak the pipeline: long run, trainer restarts, a producer kill; watch for leaks."
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--run-dir", type=Path, help="default: runs/soak-<timestamp>")
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples")
    parser.add_argument(
        "--trainer-restart-s",
        type=float,
        default=150.0,
        help="seconds between trainer replacements (restart-trainer and kill -9 alternately)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the run")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or Path("runs") / datetime.now().strftime("soak-%Y%m%d-%H%M%S")
    soak = Soak(RunDir(run_dir.resolve()), args.overrides, args.minutes, args.sample_s, args.trainer_restart_s)
    return soak.run_soak()


if __name__ == "__main__":
    sys.exit(main())

"""``launch/run_all.sh synthesize``: the producers' targets write on-policy training data, then exit.

    launch/run_all.sh synthesize [--run-dir DIR] [--config FILE] [key=value ...]

One producer.synthesize process per entry of launch.producer_devices (or launch.num_producers), each answering
its share of the prompts (producer/synthesize.py). A producer that crashes or is killed is started again with
backoff and continues where the shards say it was; one that fails the same way on every try (exit 2: a broken
prompt line, data without a record to write, a template without a user turn, an unloadable target) stops the command
at once with exit 2. A record the target cannot write (turns out of order, a tool result without its call) is skipped
and counted instead; at the end the command says how many were, and how many conversations were cut short and where
(docs/conversations.md).
Running the command again on the same DIR continues it; Ctrl-C or SIGTERM stops it cleanly (what is done is
written). At the end it prints the shards' folder and how to train on them.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, RunConfig, save_config
from common.lifecycle import EXIT_CONFIG_ERROR
from common.rundir import RunDir
from common.status import SynthesisStatus
from launch.processes import (
    ManagedProcess,
    child_environment,
    cpu_processes,
    cpu_threads,
    detect_cuda,
    log_tail,
    producer_devices,
    thread_environment,
    threads_message,
)
from launch.progress import format_duration, significant
from launch.runs import UsageError, resolve_run

log = logging.getLogger("launch.synthesize")

POLL_S = 0.2
STOP_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 30.0
"""How often the command prints how far the producers are."""


def progress(folder: Path, started_wall: list[float]) -> str:
    """One line from the producers' status files: prompts answered of all (earlier starts' included), the turns the
    target wrote of those planned, each producer's new tokens/s (three significant digits: a slow CPU's 0.27 is not 0)
    and the time left, the slowest producer's own estimate (``SynthesisStatus.eta_s``) less the seconds since it
    wrote it.

    ``started_wall[i]``: when producer i's current process started. A status file older than that is the previous
    start's (or there is none yet): that producer is shown as starting and its figures are not taken."""
    done = total = turns = planned = 0
    rates: list[str] = []
    etas: list[float | None] = []
    for i, since in enumerate(started_wall):
        path = SynthesisStatus.path(folder, i)
        status = SynthesisStatus.read(path)
        try:
            written_at = path.stat().st_mtime
        except OSError:
            written_at = None
        if status is None or written_at is None or written_at < since:
            rates.append("starting")
            etas.append(None)
            continue
        answered = max(status.answered, status.written)  # a status of before answers were counted has written only
        done += status.total - status.pending_at_start + answered
        total += status.total
        turns, planned = turns + status.turns, planned + max(status.turns_planned, status.turns)
        rates.append(significant(status.tokens_per_s) if status.tokens_per_s or status.finished else "no token yet")
        eta = status.eta_s
        if answered >= status.pending_at_start:
            eta = 0.0
        etas.append(None if eta is None else max(0.0, eta - max(0.0, time.time() - written_at)))
    complete = "starting" not in rates  # every producer's share is known
    share_done = f" ({done / total:.0%})" if complete and total else ""
    turns_done = f", {turns}/{planned} turns written" if complete and planned else ""
    eta = max(etas) if complete and etas and None not in etas else None
    return (
        f"{done}/{total if complete else '?'} prompts done{share_done}{turns_done}; new tokens/s per producer: "
        f"{', '.join(rates)}; eta {format_duration(eta)}"
    )


def training_command(folder: Path) -> str:
    """The command that trains on the shards in ``folder``, quoted for a shell (the data.paths value holds
    brackets, quotes and a glob, and the folder may hold spaces)."""
    return shlex.join(
        [
            "launch/run_all.sh",
            "--config",
            "...",
            "data.format=chat",
            f"data.paths={json.dumps([str(folder / '*.jsonl')])}",
        ]
    )


@dataclass
class ShardSummary:
    """What the shards of a folder hold."""

    records: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Prompts recorded as skipped, per reason."""
    cut: Counter = field(default_factory=Counter)
    """Conversations that end before their script did, per reason (``generation.cut`` of their records)."""
    cut_after_turn: Counter = field(default_factory=Counter)
    """The same, per the assistant turn they end after."""

    def describe_cuts(self) -> str:
        """One line: how many conversations were cut, why and where; "" when none was."""
        if not self.cut:
            return ""
        reasons = ", ".join(f"{reason} {n}" for reason, n in self.cut.most_common())
        turns = ", ".join(f"{turn}: {n}" for turn, n in sorted(self.cut_after_turn.items()))
        return (
            f"{sum(self.cut.values())} conversations end early ({reasons}; after assistant turn {turns}); each "
            "record's generation.cut says why (docs/conversations.md)"
        )


def shard_summary(folder: Path) -> ShardSummary:
    """Count the records, skipped prompts and cut conversations in the shards of ``folder``."""
    summary = ShardSummary()
    for path in folder.glob("*.jsonl"):
        for line in open(path):
            summary.records += 1
            cut = json.loads(line).get("generation", {}).get("cut")
            if cut is not None:
                summary.cut[cut["reason"]] += 1
                summary.cut_after_turn[cut["after_turn"]] += 1
    for path in folder.glob("*.skipped"):
        for line in open(path):
            summary.skipped[str(json.loads(line)["skipped"]).split(":")[0]] += 1
    return summary


def synthesize(run_dir: Path | None, config_file: Path | None, overrides: list[str]) -> int:
    """Run (or continue) a synthesis in the foreground; the exit code."""
    try:
        run, cfg, resumed = resolve_run(run_dir, config_file, overrides)
    except (ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    run.create()
    save_config(cfg, run.config)
    logging.basicConfig(level=logging.INFO, format="[synthesize %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    folder = cfg.synthesize.folder(run.root)
    devices = producer_devices(cfg, detect_cuda)
    on_cpu = cpu_processes(devices)
    threads = cpu_threads(on_cpu)
    workers = _workers(run, devices, threads)
    stop_requested = _stop_on_signals()
    log.info(
        "%s synthesis in %s: %d producer(s) on %s, shards in %s",
        "continuing" if resumed else "starting",
        run.root,
        len(workers),
        ", ".join(devices),
        folder,
    )
    if threads is not None:
        log.info("%s", threads_message(on_cpu, threads))
    started = time.monotonic()
    for worker in workers:
        worker.start()
    code = _supervise(workers, cfg, folder, stop_requested)
    if code == 0:
        _report_done(folder, len(workers), started)
    return code


def _workers(run: RunDir, devices: list[str], threads: int | None) -> list[ManagedProcess]:
    """One producer.synthesize process per device (not started); one on the CPU gets ``threads`` threads."""
    return [
        ManagedProcess(
            f"synth{i}",
            [
                sys.executable,
                "-m",
                "producer.synthesize",
                "--run-dir",
                str(run.root),
                "--producer-id",
                str(i),
                "--device",
                device,
            ],
            child_environment(thread_environment(threads) if "cpu" in device.split(",") else {}),
            run.log(f"synth{i}"),
            [device],
        )
        for i, device in enumerate(devices)
    ]


def _stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set: the command stops at its next poll, cleanly."""
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop_requested.set())
    signal.signal(signal.SIGINT, lambda _signum, _frame: stop_requested.set())
    return stop_requested


def _supervise(workers: list[ManagedProcess], cfg: RunConfig, folder: Path, stop_requested: threading.Event) -> int:
    """Poll the workers until every one has finished (0), one fails for good (its code, the others stopped) or a
    stop is requested (130), printing the progress every ``PROGRESS_EVERY_S``."""
    finished: set[int] = set()
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while len(finished) < len(workers):
        if stop_requested.is_set():
            return _stop(workers)
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            log.info("%s", progress(folder, [worker.started_wall for worker in workers]))
        for index, worker in enumerate(workers):
            if index in finished:
                continue
            code = _poll_worker(worker, cfg)
            if code == 0:
                finished.add(index)
            elif code is not None:
                _stop(workers, resumable=False)
                return code
        time.sleep(POLL_S)
    return 0


def _poll_worker(worker: ManagedProcess, cfg: RunConfig) -> int | None:
    """One look at a worker: None while it runs or waits to be started again, 0 once it has finished, else the
    command's exit code for a failure that will not pass (the same on every try, or out of restarts)."""
    if worker.proc is None:
        worker.restart_if_due()
        return None
    code = worker.poll()
    if code is None:
        return None
    worker.clear()
    if code == 0:
        return 0
    if code == EXIT_CONFIG_ERROR:
        tail = log_tail(worker.log_path)
        log.error("%s stopped with a configuration or data error: the same on every try%s", worker.name, tail)
        return EXIT_CONFIG_ERROR
    if worker.after_crash(
        code, cfg.launch.restart_backoff_s, cfg.launch.max_restarts, resumes="it continues from its shards"
    ):
        return None
    return 1


def _report_done(folder: Path, num_workers: int, started: float) -> None:
    """Print what the shards hold, each producer's speed and how to train on them."""
    summary = shard_summary(folder)
    rates = [SynthesisStatus.read(SynthesisStatus.path(folder, i)) or SynthesisStatus() for i in range(num_workers)]
    reasons = ", ".join(f"{reason} {n}" for reason, n in summary.skipped.most_common())
    log.info(
        "done in %.0f s: %d records in %s (%d prompts skipped%s, see *.skipped); new tokens/s this start: %s",
        time.monotonic() - started,
        summary.records,
        folder,
        sum(summary.skipped.values()),
        f": {reasons}" if reasons else "",
        ", ".join(significant(r.tokens_per_s) for r in rates),
    )
    if summary.cut:
        log.info("%s", summary.describe_cuts())
    log.info("train on them: %s", training_command(folder))


def _stop(workers: list[ManagedProcess], resumable: bool = True) -> int:
    """SIGTERM every running worker (each writes what it has done) and wait for them. ``resumable``: a stop the
    same command continues (not an error that would come again)."""
    for worker in workers:
        if worker.proc is not None:
            worker.send(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for worker in workers:
        if worker.proc is not None and worker.wait(max(0.0, deadline - time.monotonic())) is None:
            worker.kill()
    log.info("stopped; run the same command again to continue" if resumable else "stopped")
    return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/run_all.sh synthesize", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir", type=Path, help="run directory (default: a fresh runs/<timestamp>); an existing one continues"
    )
    parser.add_argument("--config", type=Path, help="TOML config of a new run (default: launch/tiny.toml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. synthesize.prompts=magpie")
    args = parser.parse_intermixed_args(argv)
    return synthesize(args.run_dir, args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())

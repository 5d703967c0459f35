"""``launch/run_all.sh synthesize``: the producers' targets write on-policy training data, then exit.

    launch/run_all.sh synthesize [--run-dir DIR] [--config FILE] [key=value ...]

One producer.synthesize process per entry of launch.producer_devices (or launch.num_producers), each answering
its share of the prompts (producer/synthesize.py). A producer that crashes or is killed is started again with
backoff and continues where the shards say it was; one that fails the same way on every try (exit 2: a broken
prompt line, a template without a user turn, an unloadable target) stops the command at once with exit 2.
Running the command again on the same DIR continues it; Ctrl-C or SIGTERM stops it cleanly (what is done is
written). At the end it prints the shards' folder and how to train on them.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from common.config import ConfigError, save_config
from common.rundir import read_json
from launch.supervisor import (
    ManagedProcess, UsageError, child_environment, describe_exit, detect_cuda, log_tail, producer_devices, resolve_run,
)

log = logging.getLogger("launch.synthesize")

POLL_S = 0.2
STOP_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 30.0
"""How often the command prints how far the producers are."""


def progress(folder: Path, num_producers: int) -> str:
    """One line from the producers' status files: records on disk and the generation rate of each."""
    statuses = [read_json(folder / f"status-p{i}.json") or {} for i in range(num_producers)]
    written = sum(s.get("written", 0) for s in statuses)
    pending = sum(s.get("pending_at_start", 0) for s in statuses)
    rates = ", ".join(f"{s.get('tokens_per_s', 0):.0f}" for s in statuses)
    return f"{written} of the {pending} prompts left at this start written; new tokens/s per producer: {rates}"


def count_records(folder: Path) -> tuple[int, int]:
    """(answered records, skipped prompts) in the shards of ``folder``."""
    def lines(pattern: str) -> int:
        return sum(sum(1 for _ in open(path)) for path in folder.glob(pattern))

    return lines("*.jsonl"), lines("*.skipped")


def synthesize(run_dir: Path | None, config_file: Path | None, overrides: list[str]) -> int:
    """Run (or continue) a synthesis in the foreground; the exit code."""
    try:
        run, cfg, resumed = resolve_run(run_dir, config_file, overrides)
    except (ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run.create()
    save_config(cfg, run.config)
    logging.basicConfig(level=logging.INFO, format="[synthesize %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    folder = cfg.synthesize.folder(run.root)
    devices = producer_devices(cfg, detect_cuda)
    workers = [ManagedProcess(f"synth{i}", [sys.executable, "-m", "producer.synthesize", "--run-dir", str(run.root),
                                            "--producer-id", str(i), "--device", device],
                              child_environment(), run.log(f"synth{i}"), [device]) for i, device in enumerate(devices)]
    stopping = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    log.info("%s synthesis in %s: %d producer(s) on %s, shards in %s", "continuing" if resumed else "starting",
             run.root, len(workers), ", ".join(devices), folder)
    started = time.monotonic()
    for worker in workers:
        worker.start()
    finished: set[int] = set()
    next_progress = time.monotonic() + PROGRESS_EVERY_S
    while len(finished) < len(workers):
        if stopping:
            return _stop(workers)
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            log.info("%s", progress(folder, len(workers)))
        for index, worker in enumerate(workers):
            if index in finished:
                continue
            if worker.proc is None:
                if worker.restart_at is not None and time.monotonic() >= worker.restart_at:
                    worker.start()
                continue
            code = worker.poll()
            if code is None:
                continue
            worker.clear()
            if code == 0:
                finished.add(index)
                continue
            if code == 2:
                log.error("%s stopped with a configuration or data error: the same on every try%s", worker.name,
                          log_tail(worker.log_path))
                _stop(workers, resumable=False)
                return 2
            delay = worker.schedule_restart(cfg.launch.restart_backoff_s, cfg.launch.max_restarts)
            if delay is None:
                log.error("%s crashed (%s) more than launch.max_restarts=%d times in a row; stopping%s", worker.name,
                          describe_exit(code), cfg.launch.max_restarts, log_tail(worker.log_path))
                _stop(workers, resumable=False)
                return 1
            log.warning("%s %s; it continues from its shards in %.1f s", worker.name, describe_exit(code), delay)
        time.sleep(POLL_S)
    answered, skipped = count_records(folder)
    rates = [read_json(folder / f"status-p{i}.json") or {} for i in range(len(workers))]
    log.info("done in %.0f s: %d records in %s (%d prompts skipped, see *.skipped); new tokens/s this start: %s",
             time.monotonic() - started, answered, folder, skipped,
             ", ".join(f"{r.get('tokens_per_s', 0):.0f}" for r in rates))
    log.info("train on them: launch/run_all.sh --config ... data.format=chat data.paths=%s",
             json.dumps([str(folder / "*.jsonl")]))
    return 0


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
    parser.add_argument("--run-dir", type=Path, help="run directory (default: a fresh runs/<timestamp>); an existing "
                        "one continues")
    parser.add_argument("--config", type=Path, help="TOML config of a new run (default: launch/tiny.toml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. synthesize.prompts=magpie")
    args = parser.parse_intermixed_args(argv)
    return synthesize(args.run_dir, args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())

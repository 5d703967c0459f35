"""Benchmark (issue 6): the decoupled pipeline against its stages alone and the coupled baseline.

    python -m launch.bench.pipeline                             # every run this machine's GPUs allow
    python -m launch.bench.pipeline --runs trainer,split-2,coupled-2 --seconds 40
    python -m launch.bench.pipeline --runs shared-1,shared-2 --set launch.mps=true   # shared GPUs under MPS
    python -m launch.bench.pipeline --tiny                      # CPU smoke run of every run kind
    python -m launch.bench.pipeline plot RESULTS.json --png docs/ring_occupancy.png

Qwen3-8B-shaped target and draft (docs/dflash.md), random bf16 weights, samples of --length tokens (one
sample per ring slot and per step), 512 anchors, block 16, fp32 master weights under bf16 autocast.
Every run starts the real processes (``launch/run_all.sh``, or ``launch.bench.coupled``) and
measures a steady window after warm-up, from the ledger's timestamps (samples trained) and the
producers' status files (slots published, ring occupancy), sampled every 0.25 s.

Runs (placement as producers -> trainer ranks):
  producer       producer alone (``launch.bench.producer``): samples/s one target GPU delivers
  trainer        trainer step alone on data already on its GPU (``launch.bench.step``)
  shared-1       producer and trainer on GPU 0
  coupled-1      target forward then drafter step in one process on GPU 0 (``launch/bench/coupled.py``)
  split-2        producer on GPU 0, trainer on GPU 1
  balanced-2     producer on GPU 0, trainer ranks on GPUs 0 and 1
  shared-2       producers on GPUs 0 and 1, trainer ranks on GPUs 0 and 1
  coupled-2      the coupled loop on GPUs 0 and 1 (DDP, each rank its own shard)
  stall          split-2 with a lighter draft step (--stall-anchors, so the trainer outruns the
                 producer and the ring has room); once the ring is drained the trainer process is
                 frozen (SIGSTOP) for --stall-s, then let go
  *-stalls       shared-2 / coupled-2 with the stalls of real training: a checkpoint and a
                 --pause-s evaluation stand-in every --stall-every steps; shared-2 keeps
                 ring.headroom_slots free for them
  *-evals        shared-1 / coupled-1 (issue 18) with a checkpoint and a real acceptance evaluation of
                 --eval-prompts prompts every --eval-every steps: the decoupled trainer asks producer 0,
                 which decodes between two of its batches while its ring (--eval-slots deep) feeds the
                 trainer; the coupled baseline evaluates in its loop on its own target. Besides the whole
                 cycles' rate: the trainer's own step rate during the evaluations and between them, step
                 by step from the ledger (the steps that held a checkpoint or waited for data left out),
                 and in each phase of producer 0's evaluations
  coupled-1-pauses  coupled-1 with a checkpoint and a --pause-s stand-in for the evaluation every
                 --eval-every steps: the coupled baseline as issue 18 measured it when it set its goal
                 (before this project's evaluator took 16 prompts from 9 s to about 2 s)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.config import load_config, save_config
from common.faults import DELAY_ENV
from common.naming import run_tag, sweep_stale_segments, sweep_stale_trainer_staging
from common.rundir import RunDir, read_json
from common.status import LauncherRecord, ProducerStatus
from launch.bench.harness import ROOT, add_run_arguments, qwen3_8b_target, wait_for

JSON_ONLY = ("timeline", "ledger", "windows", "evaluation_spans")  # a run's series: in --json, not printed
AFTER_EVAL_S = 3.0  # seconds after an evaluation's result reported as a phase of their own
EVAL_LOG_EVERY = 5  # steps per metrics window of the *-evals runs: fine enough to tell windows during an evaluation
PLACEMENTS = {  # name: (producer devices, trainer devices, coupled)
    "shared-1": (["cuda:0"], ["cuda:0"], False),
    "coupled-1": ([], ["cuda:0"], True),
    "split-2": (["cuda:0"], ["cuda:1"], False),
    "balanced-2": (["cuda:0"], ["cuda:0", "cuda:1"], False),
    "shared-2": (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"], False),
    "coupled-2": ([], ["cuda:0", "cuda:1"], True),
    "stall": (["cuda:0"], ["cuda:1"], False),
    "shared-2-stalls": (["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"], False),
    "coupled-2-stalls": ([], ["cuda:0", "cuda:1"], True),
    "shared-1-evals": (["cuda:0"], ["cuda:0"], False),
    "coupled-1-evals": ([], ["cuda:0"], True),
    "coupled-1-pauses": ([], ["cuda:0"], True),
}
TINY_PLACEMENTS = {name: (["cpu"] * len(p), ["cpu"] * min(1, len(t)), c) for name, (p, t, c) in PLACEMENTS.items()}


def base_overrides(args: argparse.Namespace, run_dir: Path) -> list[str]:
    common = [
        "training.max_steps=1000000",
        "training.checkpoint_every=1000000",
        "logging.log_every=10",
        "eval.every_steps=0",
        "logging.progress=false",
        'logging.wandb_mode="disabled"',
        "launch.restart_backoff_s=0.5",
        'data.length_mode="fixed"',
    ]
    if args.tiny:
        return common + ["data.mean_len=48", "data.max_seq_len=64", "batching.token_budget=64", "ring.num_slots=8"]
    return common + [
        *qwen3_8b_target(run_dir.parent),
        "data.num_samples=1000000",
        f"data.mean_len={args.length}",
        f"data.max_seq_len={args.length}",
        "data.max_step=63",
        f"batching.token_budget={args.length}",
        "batching.window_docs=256",
        "drafter.num_layers=5",
        "drafter.block_size=16",
        f"drafter.num_anchors={args.anchors}",
        'ring.backend="cuda"',
        f"ring.num_slots={args.slots}",
        "ring.heartbeat_interval_s=1.0",
        "ring.heartbeat_timeout_s=60.0",
    ]


def run_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """What a run changes on top of the base: its stalls and, for the stall test, the lighter step."""
    if name == "stall":
        return [f"drafter.num_anchors={args.stall_anchors}", f"ring.num_slots={args.stall_slots}"]
    if name.endswith("-stalls"):
        stalls = [f"training.checkpoint_every={args.stall_every}"]
        if not name.startswith("coupled"):
            stalls += [f"ring.num_slots={args.stall_slots}", f"ring.headroom_slots={args.stall_slots - args.slots}"]
        return stalls
    if name.endswith("-evals"):
        cadence = [
            f"training.checkpoint_every={args.eval_every}",
            f"eval.every_steps={args.eval_every}",
            f"eval.num_prompts={args.eval_prompts}",
            f"logging.log_every={EVAL_LOG_EVERY}",
        ]
        return cadence + (
            []
            if name.startswith("coupled")
            else [f"ring.num_slots={args.eval_slots}", f"eval.producer_share={args.producer_share}"]
        )
    if name.endswith("-pauses"):
        return [f"training.checkpoint_every={args.eval_every}", f"logging.log_every={EVAL_LOG_EVERY}"]
    return []


def run_environment(name: str, args: argparse.Namespace) -> dict[str, str]:
    """The pauses a run's trainer takes, --pause-s every --stall-every (-stalls) or --eval-every (-pauses) steps:
    a hold of the batch it is about to train (common/faults.py's DFLASH_FAULT_DELAY)."""
    every = args.stall_every if name.endswith("-stalls") else args.eval_every if name.endswith("-pauses") else 0
    return {DELAY_ENV: f"trainer.batch={args.pause_s}/{every}"} if every else {}


class Sampler(threading.Thread):
    """Polls producer and trainer status files: the time series of slots published and ring occupancy."""

    def __init__(self, run: RunDir, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.rundir, self.period_s = run, period_s
        self.rows: list[dict] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            row = {"t": time.time(), "trainer_state": (read_json(self.rundir.trainer_status) or {}).get("state")}
            for status in ProducerStatus.read_all(self.rundir):
                row[f"p{status.id}"] = {
                    "published": status.server.get("published", 0),
                    "blocked_s": status.server.get("blocked_s", 0.0),
                    "updated": status.updated,
                    **{k: status.ring.get(k, 0) for k in ("slots", "free", "filling", "ready", "leased")},
                }
            self.rows.append(row)


def ledger_rows(run: RunDir) -> list[dict]:
    if not run.ledger.is_file():
        return []
    rows = [json.loads(line) for line in run.ledger.read_text().splitlines() if line.strip()]
    return [r for r in rows if "time" in r]


def samples_between(rows: list[dict], t0: float, t1: float) -> int:
    return sum(len(r["samples"]) for r in rows if t0 < r["time"] <= t1)


def published_rate(timeline: list[dict], t0: float, t1: float) -> float:
    """Slots published per second by all producers in [t0, t1], from the sampled status files."""
    inside = [r for r in timeline if t0 <= r["t"] <= t1]
    if len(inside) < 2:
        return float("nan")
    first, last = inside[0], inside[-1]
    keys = [k for k in last if k.startswith("p") and k in first]
    published = sum(last[k]["published"] - first[k]["published"] for k in keys)
    span = max(1e-9, max(last[k]["updated"] for k in keys) - min(first[k]["updated"] for k in keys)) if keys else 0
    return published / span if keys else float("nan")


def kill_run(run: RunDir) -> None:
    """SIGKILL every process of the run (a benchmark needs no final checkpoint): the supervisor first,
    so that nothing is restarted, then everything whose command line names the run directory.
    Process groups are not enough: torchrun starts its ranks with setsid (process groups of their own), and ranks
    left running would share the GPUs with the next run. Then the run's /dev/shm segments, which no process
    removes after a SIGKILL: its trainer's staging is the drafter's weights and optimizer state (12.6 GB at
    the Qwen3-8B shapes)."""
    launcher = LauncherRecord.read(run.launcher)
    if launcher is not None and launcher.pid:
        try:
            os.kill(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    needle = str(run.root).encode()
    for _ in range(50):
        pids = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and int(p.name) != os.getpid() and needle in _cmdline(p)
        ]
        if not pids:
            sweep_stale_trainer_staging(run_tag(run.root))
            sweep_stale_segments()  # its rings (those of any dead owner, as a ring's creation sweeps them)
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"processes of {run.root} survive SIGKILL: {pids}")


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def measure(name: str, args: argparse.Namespace, placements: dict) -> dict:
    """One pipeline or coupled run: start it, wait for warm steps, measure a window, kill it."""
    producer_devices, trainer_devices, coupled = placements[name]
    tmp = Path(tempfile.mkdtemp(prefix=f"df-{name}-", dir="/tmp"))
    run = RunDir(tmp / "run")
    log = open(tmp / "launcher.log", "w")
    proc = start_run(name, args, placements[name], run, log)
    sampler = Sampler(run)
    started = time.time()
    result: dict = {"run": name, "producers": producer_devices, "trainer": trainer_devices, "coupled": coupled}
    try:
        sampler.start()

        def warm() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: exited early; see {tmp}/launcher.log and {run.root}/logs")
            rows = ledger_rows(run)
            return len(rows) >= args.warm_steps

        wait_for(warm, args.timeout, f"{name}: {args.warm_steps} warm steps")
        result["first_step_after_s"] = ledger_rows(run)[0]["time"] - started
        if name == "stall":
            result.update(measure_stall(args, run, sampler))
        elif name.endswith(("-stalls", "-evals", "-pauses")):
            result.update(measure_cycles(name, args, run, sampler))
        else:
            result.update(measure_window(args, run, sampler))
    finally:
        sampler.done.set()
        kill_run(run)
        proc.wait(timeout=60)
        log.close()
        shutil.rmtree(run.checkpoints, ignore_errors=True)  # GBs each at the 8B shapes
    result["timeline"] = [r for r in sampler.rows if r["t"] >= started]
    result["ledger"] = [[r["time"], len(r["samples"])] for r in ledger_rows(run)]
    return result


def start_run(name: str, args: argparse.Namespace, placement: tuple, run: RunDir, log) -> subprocess.Popen:
    """Start run ``name`` in ``run``, its output in ``log``: the coupled loop (under torchrun on several devices) or
    the pipeline's launcher."""
    producer_devices, trainer_devices, coupled = placement
    overrides = base_overrides(args, run.root) + run_overrides(name, args) + args.set
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **run_environment(name, args)}
    if not coupled:
        devices = [
            f"launch.producer_devices={json.dumps(producer_devices)}",
            f"launch.trainer_devices={json.dumps(trainer_devices)}",
        ]
        command = [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run.root), *overrides, *devices]
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    overrides += [f"training.device=\"{trainer_devices[0]}\""] if len(trainer_devices) == 1 else []
    cfg = load_config(ROOT / "launch" / "tiny.toml", overrides)
    run.root.mkdir(parents=True)
    save_config(cfg, run.config)
    trainer = ["-m", "launch.bench.coupled", "--run-dir", str(run.root)]
    if len(trainer_devices) > 1:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(d.split(":")[1] for d in trainer_devices)
        nproc = f"--nproc-per-node={len(trainer_devices)}"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", nproc, *trainer]
    else:
        command = [sys.executable, *trainer]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def measure_window(args: argparse.Namespace, run: RunDir, sampler: Sampler) -> dict:
    """The rates over a window of ``--seconds`` from now."""
    t0 = time.time()
    time.sleep(args.seconds)
    t1 = time.time()
    rows = ledger_rows(run)
    return {
        "samples_per_s": samples_between(rows, t0, t1) / (t1 - t0),
        "net_samples_per_s": net_rate(rows, sampler.rows, t0, t1),
        "producer_samples_per_s": published_rate(sampler.rows, t0, t1),
        "window_s": t1 - t0,
    }


def measure_stall(args: argparse.Namespace, run: RunDir, sampler: Sampler) -> dict:
    """One pause of the trainer: around it, the producer's rate during it and the trainer's before and after."""

    # Pause once the backlog of the start is drained (the ring stays nearly empty: the lighter
    # step outruns the producer). SIGSTOP freezes the whole trainer, its feeder thread too.
    def drained() -> bool:
        recent = [r for r in sampler.rows[-12:] if "p0" in r]
        return len(recent) == 12 and all(r["p0"]["ready"] <= 2 for r in recent)

    try:
        drained_before = wait_for(drained, args.timeout / 2, "a drained ring")
    except TimeoutError:  # the trainer does not outrun the producer here: pause anyway, and say so
        drained_before = False
        print("stall: the ring never drained; pausing with a backlog", flush=True)
    pid = int(read_json(run.trainer_status)["pid"])
    paused = time.time()
    os.kill(pid, signal.SIGSTOP)  # the trainer's heartbeat timeout (60 s here) outlasts the pause
    time.sleep(args.stall_s)
    os.kill(pid, signal.SIGCONT)
    resumed = time.time()
    time.sleep(args.seconds)

    def caught_up() -> float | None:
        """When the pause's backlog was drained: the first sample after the resume with an empty ring."""
        return next((r["t"] for r in sampler.rows if "p0" in r and r["t"] > resumed and r["p0"]["ready"] <= 2), None)

    try:  # the catch-up can take longer than the window after the pause
        wait_for(lambda: caught_up() is not None, args.timeout / 2, "the pause's backlog drained")
    except TimeoutError:
        print("stall: the backlog of the pause was not drained in time", flush=True)
    rows = ledger_rows(run)
    before, after = (paused - args.seconds, paused), (resumed, resumed + args.seconds)
    peak = max(
        (r for r in sampler.rows if "p0" in r and paused <= r["t"] <= resumed + 1), key=lambda r: r["p0"]["ready"]
    )
    return {
        "stall_s": resumed - paused,
        "paused_at": paused,
        "resumed_at": resumed,
        "drained_before": drained_before,
        "trainer_before_samples_per_s": samples_between(rows, *before) / args.seconds,
        "trainer_after_samples_per_s": samples_between(rows, *after) / args.seconds,
        "producer_before_samples_per_s": published_rate(sampler.rows, *before),
        "producer_during_samples_per_s": published_rate(sampler.rows, paused + 1.0, resumed),
        "producer_after_samples_per_s": published_rate(sampler.rows, *after),
        "ready_at_resume": peak["p0"]["ready"],
        "catch_up_s": caught_up() - resumed if caught_up() else None,
    }


def measure_cycles(name: str, args: argparse.Namespace, run: RunDir, sampler: Sampler) -> dict:
    """Runs that checkpoint and pause (or evaluate) every few steps: the rates over whole cycles only, from the end
    of one checkpoint to the end of the ``--cycles``-th after it."""

    def checkpoint_step() -> int:
        return (read_json(run.checkpoints / "latest.json") or {}).get("step", 0)

    cycle = args.eval_every if name.endswith(("-evals", "-pauses")) else args.stall_every  # steps between checkpoints
    first = wait_for(checkpoint_step, args.timeout, "the first checkpoint")
    if args.skip_cycles:  # e.g. past the first evaluation, which also makes the evaluator's reference
        skipped = first + args.skip_cycles * cycle
        wait_for(lambda: checkpoint_step() >= skipped, args.timeout * args.skip_cycles, "the skipped cycles")
        first = checkpoint_step()
    t0 = time.time()
    wait_for(lambda: checkpoint_step() >= first + args.cycles * cycle, args.timeout * args.cycles, "whole cycles")
    t1 = time.time()
    rows = ledger_rows(run)
    measured = {
        "samples_per_s": samples_between(rows, t0, t1) / (t1 - t0),
        "window_s": t1 - t0,
        "producer_samples_per_s": published_rate(sampler.rows, t0, t1),
        "net_samples_per_s": net_rate(rows, sampler.rows, t0, t1),
        **backlog_span(sampler.rows, t0, t1),
    }
    if name.endswith("-evals"):
        measured.update(evaluation_rates(run, t0, t1, cycle))
    return measured


def evaluation_spans(run: RunDir) -> list[tuple[float, float]]:
    """(start, end) of every evaluation that came back: a producer's from its claim to its result, the coupled
    loop's from its eval line in metrics.jsonl (written at the end, with its duration)."""
    spans = []
    for here in sorted((run.root / "evals").glob("step-*")):
        claim, result = read_json(here / "claim.json"), read_json(here / "result.json")
        if claim and result and not result.get("lost"):
            spans.append((claim["claimed"], result["finished"]))
    if not spans and run.metrics.is_file():
        for line in run.metrics.read_text().splitlines():
            record = json.loads(line)
            if "eval/seconds" in record:
                spans.append((record["time"] - record["eval/seconds"], record["time"]))
    return spans


def evaluation_phases(run: RunDir) -> dict[str, list[tuple[float, float]]]:
    """The (start, end) of each phase of producer 0's evaluations, from the claim, the result and its timings:
    loading the export, the reference (the first only), decoding, the simulated acceptance, and the AFTER_EVAL_S
    after the result (the producer refills the slots the trainer took meanwhile)."""
    phases: dict[str, list[tuple[float, float]]] = {}
    for here in sorted((run.root / "evals").glob("step-*")):
        claim, result = read_json(here / "claim.json"), read_json(here / "result.json")
        if not claim or not result or result.get("lost") or "eval/decode_seconds" not in result.get("metrics", {}):
            continue
        metrics, finished = result["metrics"], result["finished"]
        started = finished - metrics["eval/seconds"]
        decoding = started + metrics["eval/reference_seconds"]
        bounds = {
            "loading": (claim["claimed"], started),
            "reference": (started, decoding),
            "decoding": (decoding, decoding + metrics["eval/decode_seconds"]),
            "simulated acceptance": (decoding + metrics["eval/decode_seconds"], finished),
            f"{AFTER_EVAL_S:g} s after": (finished, finished + AFTER_EVAL_S),
        }
        for phase, span in bounds.items():
            phases.setdefault(phase, []).append(span)
    return phases


def _steps_inside(
    steps: list[tuple[float, float]], spans: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """The durations of the steps (intervals) that lie mostly inside ``spans``, and of those that touch none."""
    inside, outside = [], []
    for a, b in steps:
        share = sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans) / max(b - a, 1e-9)
        if share >= 0.5:
            inside.append(b - a)
        elif share == 0.0:
            outside.append(b - a)
    return inside, outside


def evaluation_rates(run: RunDir, t0: float, t1: float, checkpoint_every: int) -> dict:
    """The trainer's own step rate during the evaluations of [t0, t1] and between them, step by step: a step's
    interval (from the ledger line of the step before to its own) counts as during where it lies mostly inside
    an evaluation, as between where it touches none. Left out are the step after each checkpoint (it holds the
    checkpoint's copy and any wait for the previous write, which the coupled loop pays alike) and the steps of
    metrics windows that waited for data (a drained ring is the pipeline's rate, which samples_per_s measures).
    Between includes the producer's refill of its ring after an evaluation. The metrics windows go into the
    result as they are, for reading a run afterwards."""
    spans = [span for span in evaluation_spans(run) if span[1] >= t0 and span[0] <= t1]
    windows, starved_steps = [], set()
    for line in run.metrics.read_text().splitlines() if run.metrics.is_file() else []:
        w = json.loads(line)
        if "steps_per_s" not in w or not t0 <= w["time"] <= t1:
            continue
        windows.append(
            {
                key: w.get(key)
                for key in (
                    "step",
                    "time",
                    "steps_per_s",
                    "step_time_s",
                    "starved_fraction",
                    "checkpoint_fraction",
                    "alloc_retries",
                )
            }
        )
        if w["starved_fraction"] > 0:
            starved_steps.update(range(w["step"] - EVAL_LOG_EVERY + 1, w["step"] + 1))
    rows = ledger_rows(run)
    steps = [
        (before["time"], row["time"])
        for before, row in zip(rows, rows[1:])
        if t0 <= before["time"]
        and row["time"] <= t1
        and before["step"] % checkpoint_every
        and row["step"] not in starved_steps
    ]
    rate = lambda xs: len(xs) / sum(xs) if xs else None  # noqa: E731
    during, between = _steps_inside(steps, spans)
    by_phase = {}
    for phase, phase_spans in evaluation_phases(run).items():
        inside, _ = _steps_inside(steps, [span for span in phase_spans if span[1] >= t0 and span[0] <= t1])
        by_phase[phase] = {"steps_per_s": rate(inside), "steps": len(inside)}
    durations = [b - a for a, b in spans if t0 <= a <= t1]
    asked = [read_json(here / "request.json") or {} for here in (run.root / "evals").glob("step-*")]
    return {
        "evaluations": len(durations),
        "evaluation_s": sum(durations) / len(durations) if durations else None,
        "evaluations_asked": sum(1 for r in asked if t0 <= r.get("requested", 0) <= t1) if asked else None,
        "own_steps_per_s_during_evals": rate(during),
        "own_steps_per_s_between_evals": rate(between),
        "steps_during_evals": len(during),
        "steps_between_evals": len(between),
        "own_steps_per_s_by_phase": by_phase,
        "windows": windows,
        "evaluation_spans": spans,
    }


def _is_ring(key: str) -> bool:
    return key.startswith("p") and key[1:].isdigit()


def _row_backlog(row: dict) -> int:
    """Batches in the rings (ready, leased or filling) in one timeline sample."""
    return sum(v["ready"] + v["leased"] + v["filling"] for k, v in row.items() if _is_ring(k))


def backlog_at(timeline: list[dict], t: float) -> int:
    """Batches in the rings at the sample nearest to ``t``."""
    rows = [r for r in timeline if any(_is_ring(k) for k in r)]
    return _row_backlog(min(rows, key=lambda r: abs(r["t"] - t))) if rows else 0


def net_rate(ledger: list[dict], timeline: list[dict], t0: float, t1: float) -> float:
    """Samples trained per second, corrected for the rings' backlog change: a trainer draining a
    backlog made before the window is not credited with it (nor one that grows a backlog debited)."""
    grown = backlog_at(timeline, t1) - backlog_at(timeline, t0)
    return (samples_between(ledger, t0, t1) + grown) / (t1 - t0)


def backlog_span(timeline: list[dict], t0: float, t1: float) -> dict:
    """The rings' backlog at both ends of the window and its least inside. ``net`` credits the change between
    the ends, so it says something only where the window starts and ends in the same phase of the cycle; a
    backlog that never ran dry means the trainer set the pace, and the samples trained are the sustained rate."""
    inside = [_row_backlog(r) for r in timeline if t0 <= r["t"] <= t1 and any(_is_ring(k) for k in r)]
    return {
        "backlog_start": backlog_at(timeline, t0),
        "backlog_end": backlog_at(timeline, t1),
        "backlog_min": min(inside) if inside else None,
    }


def run_stage(name: str, args: argparse.Namespace) -> dict:
    """The producer alone or the trainer alone, by their own benchmark programs (last line is JSON)."""
    if name == "producer":
        command = ["-m", "launch.bench.producer", "--warmup", str(args.warmup_s), "--seconds", str(args.seconds)]
        command += ["--tiny"] if args.tiny else ["--fixed-len", str(args.length), "--budget", str(args.length)]
    else:
        command = [
            "-m",
            "launch.bench.step",
            "--variants",
            "compile-layers" if not args.tiny else "eager",
            "--master-fp32",
            "--num-docs",
            "1",
            "--steps",
            "20",
            "--warmup",
            "3",
        ]
        command += ["--tiny"] if args.tiny else ["--seq-len", str(args.length), "--num-anchors", str(args.anchors)]
    out = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stdout[-2000:]}{out.stderr[-3000:]}")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if name == "producer":
        return {
            "run": name,
            "samples_per_s": data["samples_per_s"],
            "tokens_per_s": data["tokens_per_s"],
            "mfu": data.get("mfu"),
        }
    step = data["results"][0]
    return {
        "run": name,
        "samples_per_s": step["samples_per_s"],
        "tokens_per_s": step["tokens_per_s"],
        "mfu": step["mfu"],
        "step_ms": step["step_ms"],
    }


def ideal(name: str, stages: dict) -> float | None:
    """The rate a placement could reach: per GPU, the stages it runs take their alone-times in turn."""
    if "producer" not in stages or "trainer" not in stages or name not in PLACEMENTS:
        return None
    p, t = stages["producer"]["samples_per_s"], stages["trainer"]["samples_per_s"]
    producers, trainers, coupled = PLACEMENTS[name]
    if coupled or producers == trainers:
        return len(trainers) / (1 / p + 1 / t)  # every GPU does both, one after the other
    if not set(producers) & set(trainers):
        return min(len(producers) * p, len(trainers) * t)
    # balanced-2: DDP keeps the ranks in step, so the shared GPU sets the pace: per step it runs the
    # target for every rank's sample and its own rank's step.
    n = len(trainers)
    return n / (n / p + 1 / t)


def parse_stage_rates(text: str, parser: argparse.ArgumentParser) -> dict:
    """``producer=13.15,trainer=6.27`` -> the stages' results as ``ideal`` reads them."""
    stages = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            stages[name.strip()] = {"samples_per_s": float(value)}
        except ValueError:
            parser.error(f"--stage-rates: {item!r} is not name=samples_per_s")
    if set(stages) != {"producer", "trainer"}:
        parser.error(f"--stage-rates: needs producer= and trainer=, got {sorted(stages)}")
    return stages


def decoupled_over_coupled(results: list[dict]) -> dict[str, float]:
    """Samples/s of each decoupled run over each coupled run of the same invocation (side by side, one machine)."""
    return {
        f"{d['run']} / {c['run']}": d["samples_per_s"] / c["samples_per_s"]
        for d in results
        if d.get("coupled") is False and d.get("samples_per_s")  # the stages alone have no "coupled"
        for c in results
        if c.get("coupled") is True and c.get("samples_per_s")
    }


def print_table(results: list[dict], stages: dict) -> None:
    header = (
        f"{'run':<18}{'producers':>14}{'trainer':>18}{'samples/s':>11}{'net':>8}{'ideal':>8}{'of ideal':>10}"
        f"{'producer/s':>12}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        best = ideal(r["run"], stages)
        rate = r.get("samples_per_s", float("nan"))
        net = r.get("net_samples_per_s", rate)
        print(
            f"{r['run']:<18}{','.join(r.get('producers', [])) or '-':>14}{','.join(r.get('trainer', [])) or '-':>18}"
            f"{rate:>11.2f}{net:>8.2f}{(best or float('nan')):>8.2f}{(net / best if best else float('nan')):>10.1%}"
            f"{r.get('producer_samples_per_s', float('nan')):>12.2f}"
        )
    for r in results:
        if r["run"].endswith("-evals"):
            during, between = r.get("own_steps_per_s_during_evals"), r.get("own_steps_per_s_between_evals")
            asked = "" if r.get("evaluations_asked") is None else f" ({r['evaluations_asked']} asked)"
            print(
                f"{r['run']}: {r.get('evaluations')} evaluations of {r.get('evaluation_s') or 0:.1f} s in the window{asked}; "
                f"trainer's own steps/s during them {during if during is None else round(during, 3)}, "
                f"between them {between if between is None else round(between, 3)}"
                + (
                    f" ({during / between - 1:+.1%}; {r['steps_during_evals']} and {r['steps_between_evals']} steps)"
                    if during and between
                    else ""
                )
            )
        phases = [
            f"{phase} {v['steps_per_s']:.2f} ({v['steps']})"
            for phase, v in r.get("own_steps_per_s_by_phase", {}).items()
            if v["steps_per_s"] is not None
        ]
        if phases:
            print(f"{r['run']}: trainer's own steps/s by evaluation phase (steps): " + ", ".join(phases))
        if r.get("backlog_min") is not None and r.get("producers"):
            print(
                f"{r['run']}: rings' backlog {r['backlog_start']} -> {r['backlog_end']} slots over the window, "
                f"never below {r['backlog_min']}"
                + (" (the trainer set the pace: samples/s is the sustained rate)" if r["backlog_min"] > 2 else "")
            )
        if r["run"] == "stall":
            print(
                f"stall test: trainer paused {r['stall_s']:.1f} s; producer {r['producer_before_samples_per_s']:.2f} samples/s "
                f"before, {r['producer_during_samples_per_s']:.2f} during, {r['producer_after_samples_per_s']:.2f} after; "
                f"trainer {r['trainer_before_samples_per_s']:.2f} before, {r['trainer_after_samples_per_s']:.2f} after; "
                f"{r['ready_at_resume']} slots ready at resume, drained {r['catch_up_s']} s later"
            )


def plot(results_path: Path, png: Path) -> None:
    """Ring occupancy over time of the stall run (ready / leased / free fractions) and the trainer's steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text())
    stall = next(r for r in results["runs"] if r["run"] == "stall")
    t0 = stall["timeline"][0]["t"]
    rows = [r for r in stall["timeline"] if "p0" in r]
    t = [r["t"] - t0 for r in rows]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for key, colour in (("ready", "tab:green"), ("leased", "tab:orange"), ("free", "tab:grey")):
        ax.plot(t, [r["p0"][key] / max(1, r["p0"]["slots"]) for r in rows], label=key, color=colour)
    for axis in (ax, ax2):
        axis.axvspan(
            stall["paused_at"] - t0,
            stall["resumed_at"] - t0,
            color="tab:red",
            alpha=0.12,
            label="trainer paused" if axis is ax else None,
        )
    ax.set_ylabel("fraction of ring slots")
    ax.set_title(f"ring of producer 0 while the trainer pauses {stall['stall_s']:.0f} s")
    ax.legend(loc="upper left")
    ledger = stall["ledger"]
    ax2.plot(
        [x - t0 for x, _ in ledger], [sum(n for _, n in ledger[: i + 1]) for i in range(len(ledger))], label="trained"
    )
    ax2.plot(t, [r["p0"]["published"] - rows[0]["p0"]["published"] for r in rows], label="published by the producer")
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("samples")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plot"]:
        parser = argparse.ArgumentParser(prog="python -m launch.bench.pipeline plot")
        parser.add_argument("results", type=Path)
        parser.add_argument("--png", type=Path, default=ROOT / "docs" / "ring_occupancy.png")
        args = parser.parse_args(argv[1:])
        plot(args.results, args.png)
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    placements = TINY_PLACEMENTS if args.tiny else PLACEMENTS
    if args.tiny:
        args.length, args.stall_slots, args.slots = 64, 64, 8
    stages = parse_stage_rates(args.stage_rates, parser) if args.stage_rates else {}
    results: list[dict] = []
    for name in run_names(args):
        results.append(run_named(name, args, placements, stages))
        if args.json and "error" not in results[-1]:  # after every run: a run cut short keeps what it measured
            args.json.write_text(json.dumps({"bench": "pipeline", "tiny": args.tiny, "runs": results}))
    print()
    measured = [r for r in results if "error" not in r]
    print_table(measured, stages)
    ratios = decoupled_over_coupled(measured)
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x in samples trained")
    record = {
        "bench": "pipeline",
        "tiny": args.tiny,
        "length": args.length,
        "anchors": args.anchors,
        "runs": results,
        "decoupled_over_coupled": ratios,
    }
    if args.json:
        args.json.write_text(json.dumps(record))
    print(json.dumps({**record, "runs": [{k: v for k, v in r.items() if k not in JSON_ONLY} for r in results]}))
    return 0


def run_names(args: argparse.Namespace) -> list[str]:
    """``--runs``, else the stages alone and every placement this machine's GPUs allow."""
    if args.runs:
        return args.runs.split(",")
    gpus = 0
    if not args.tiny:
        import torch

        gpus = torch.cuda.device_count()
    fits = [n for n, (p, t, _) in PLACEMENTS.items() if args.tiny or max(int(d.split(":")[1]) for d in p + t) < gpus]
    return ["producer", "trainer", *fits]


def run_named(name: str, args: argparse.Namespace, placements: dict, stages: dict) -> dict:
    """Measure run ``name`` (a stage alone also into ``stages``); a failure is a row with its error (and, under
    $OUT, the run's logs)."""
    print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
    try:
        result = run_stage(name, args) if name in ("producer", "trainer") else measure(name, args, placements)
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
        print(f"{name} failed: {exc}", flush=True)
        if os.environ.get("OUT"):
            for log in Path("/tmp").glob(f"df-{name}-*/run/logs/*.log"):
                Path(os.environ["OUT"], f"{name}-{log.name}").write_text(log.read_text()[-100_000:])
        return {"run": name, "error": str(exc)[-2000:]}
    if name in ("producer", "trainer"):
        stages[name] = result
    print({k: v for k, v in result.items() if k not in JSON_ONLY}, flush=True)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, timeout=400.0, warm_steps=8)
    parser.add_argument("--runs", default=None, help="comma list (default: all that this machine's GPUs allow)")
    parser.add_argument("--length", type=int, default=3072, help="tokens per sample (one sample per slot and step)")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--slots", type=int, default=8, help="ring slots of the steady runs")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window of each steady run")
    parser.add_argument("--warmup-s", type=float, default=15.0, help="producer-alone warm-up")
    parser.add_argument("--stall-s", type=float, default=30.0)
    parser.add_argument("--stall-anchors", type=int, default=64, help="stall run: anchors (a lighter step)")
    parser.add_argument("--stall-slots", type=int, default=480, help="stall runs: ring slots (room for the pause)")
    parser.add_argument("--stall-every", type=int, default=60, help="*-stalls: checkpoint and pause every N steps")
    parser.add_argument("--pause-s", type=float, default=10.0, help="*-stalls, *-pauses: the evaluation stand-in")
    parser.add_argument("--cycles", type=int, default=2, help="*-stalls, *-evals, *-pauses: checkpoint cycles measured")
    parser.add_argument(
        "--skip-cycles",
        type=int,
        default=0,
        help="*-stalls, *-evals, *-pauses: whole cycles after the first checkpoint left out of the window",
    )
    parser.add_argument(
        "--eval-every", type=int, default=40, help="*-evals, *-pauses: checkpoint and evaluate (or pause) every N steps"
    )
    parser.add_argument("--eval-prompts", type=int, default=16, help="*-evals: prompts per evaluation")
    parser.add_argument(
        "--eval-slots",
        type=int,
        default=128,
        help="*-evals: ring slots of the decoupled run (its backlog feeds the trainer while producer 0 evaluates)",
    )
    parser.add_argument(
        "--producer-share",
        type=float,
        default=1.0,
        help="*-evals: eval.producer_share of the decoupled run; 1 serves every request, the coupled cadence",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, e.g. launch.mps=true (repeatable)",
    )
    parser.add_argument(
        "--stage-rates",
        default=None,
        metavar="producer=P,trainer=T",
        help="samples/s of the stages alone, measured earlier, for the ideal column of runs "
        "that leave out the producer and trainer runs",
    )
    parser.add_argument("--json", type=Path, default=None)
    return parser


if __name__ == "__main__":
    sys.exit(main())

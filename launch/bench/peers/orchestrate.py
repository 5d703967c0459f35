"""The peers benchmark's run: the data once, then per view ours and each peer trained alone on the card, one after
the other, then every row's drafter evaluated by our evaluator on the same held-out records, all rows against one
reference of the target. Every row's figures go to ``out/peers-VIEW-ROW.json`` as soon as they are known (trained,
then evaluated), for the table (launch/bench/peers/table.py) and for a later call on the same --out, which trains
and evaluates only what is missing."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from launch.bench.peers.common import Budget, PeakGpuMemory, Peer, PeerJob, PeerRun, TrainingRow
from launch.bench.peers.features import (
    TargetCapture,
    epoch_order,
    first_batches,
    rows_of,
    run_config,
    tokens_of,
    training_source,
)
from launch.bench.peers.plan import bytes_per_token, default_max_tokens, draft_shape, pick_peers
from launch.bench.quality import evaluated_together, evaluation_runs, last_checkpoint
from launch.bench.side_by_side import synthesized_quality_command

HUMANEVAL_PROMPTS = {False: 164, True: 4}
"""HumanEval prompts evaluated (launch.bench.quality's sizes), on a GPU and with --smoke."""


def known_peers(cfg, smoke: bool) -> dict[str, Peer]:
    """Every peer this benchmark knows, built for the preset's step (a peer whose module is not there yet is
    reported missing)."""
    shape = dict(token_budget=cfg.batching.token_budget, anchors=cfg.drafter.num_anchors, max_len=cfg.data.max_seq_len)
    peers: dict[str, Peer] = {}
    for name, cls in (("specforge", "SpecForge"), ("speculators", "Speculators")):
        try:
            peers[name] = getattr(importlib.import_module(f"launch.bench.peers.{name}"), cls)(**shape, smoke=smoke)
        except (ImportError, AttributeError) as exc:
            peers[name] = _Absent(name, f"{name}: launch/bench/peers/{name}.py cannot be used here ({exc})")
    return peers


@dataclasses.dataclass
class _Absent:
    name: str
    line: str

    def missing(self) -> str:
        return self.line


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def trained(out: Path, view: str, row: str) -> dict | None:
    """A row an earlier call of this --out trained (a call may run some rows, the next the others): its record, which
    names the drafter to evaluate (``export``), evaluated or not."""
    record = _json(out / f"peers-{view}-{row}.json")
    return record if "export" in record and "error" not in record else None


def save(out: Path, view: str, row: str, record: dict) -> None:
    (out / f"peers-{view}-{row}.json").write_text(json.dumps(record, indent=2) + "\n")


def train_ours(out: Path, quality: list[str], view: str, budget: list[str]) -> dict:
    """Our row trained: ``launch.bench.quality --reuse-data --throughput-only`` with ``budget`` (--minutes or
    --steps), alone on the card; its figures, its last checkpoint (``export``) and the card's peak memory while it
    trained."""
    name = f"ours-{view}"
    started = time.monotonic()
    with PeakGpuMemory() as peak, open(out / f"peers-{name}.log", "a") as log:
        command = [*quality, "--reuse-data", "--throughput-only", "--name", name, *budget]
        if (code := subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode) != 0:
            sys.exit(f"our row failed with exit {code}; see {out / f'peers-{name}.log'}")
    result = json.loads((out / f"quality-{name}.json").read_text())
    ledger = [json.loads(line) for line in (out / name / "ledger.jsonl").read_text().splitlines()]
    checkpoint = last_checkpoint(out / name)
    return {
        "row": "ours",
        "view": view,
        "export": str(checkpoint),
        "dump_s": 0.0,
        "train_s": result["train_s"],
        "trained_s": result.get("trained_s"),
        "steps": result["steps"],
        "samples": result["trained_samples"],
        "sample_ids": [sample for entry in ledger for _producer, _epoch, sample in entry["samples"]],
        "peak_gpu_bytes": peak.peak_bytes,
        "disk_bytes": 0,
        "wall_s": time.monotonic() - started,
    }


def run_peer(peer: Peer, out: Path, view: str, rows: list[TrainingRow], ctx: dict, budget: Budget) -> dict:
    """One peer's row trained: its dump and training to ``budget``; all but its export deleted after, so that the
    next peer has the disk (the export is evaluated with the other rows', ``evaluate_rows``)."""
    work = out / f"{peer.name}-{view}"
    if work.exists():
        shutil.rmtree(work)
    capture = TargetCapture(ctx["cfg"], ctx["device"])
    started = time.monotonic()
    run: PeerRun = peer.run(PeerJob(work, rows, capture, ctx["draft"], budget, out / f"peers-{peer.name}-{view}.log"))
    capture.close()
    record = {"row": peer.name, "view": view, "wall_s": time.monotonic() - started}
    record |= {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(run).items()}
    record["samples"], record["rows"] = run.samples_trained, len(rows)
    record["row_tokens"] = sum(len(r.input_ids) for r in rows)
    prune(work, run.export)
    return record


def evaluate_rows(out: Path, view: str, ctx: dict) -> int:
    """Every trained row of ``view`` not evaluated yet, together: each evaluation in one process for all the rows
    (the target loaded and its reference made once, not once a row), the evaluations at once; each row alone should
    that fail (``evaluated_together``). How many rows failed (each said why; its trained record kept, so that a
    later call evaluates it again)."""
    waiting = {
        path: record
        for path in sorted(out.glob(f"peers-{view}-*.json"))
        if "export" in (record := _json(path)) and "held_out" not in record and "error" not in record
    }
    exports = [Path(r["export"]) for r in waiting.values()]
    names = [f"{r['row']}-{view}" for r in waiting.values()]
    figures = evaluated_together(exports, names, ctx["run_dir"], out, view, ctx["evaluations"]) if waiting else []
    for (path, record), taus in zip(waiting.items(), figures):
        if taus is not None:
            path.write_text(json.dumps(record | taus, indent=2) + "\n")
    return sum(taus is None for taus in figures)


def prune(work: Path, export: Path) -> None:
    """Everything of a peer's ``work`` but the folder holding its export: its features (tens of GB on a GPU) and
    checkpoints go before the next peer dumps its own."""
    for child in work.iterdir():
        if export.resolve().is_relative_to(child.resolve()):
            continue
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def views(args: argparse.Namespace, cfg, source) -> list[tuple[str, list[str], Budget | None]]:
    """(name, our row's budget options, the peers' budget; None: the samples ours trained, one epoch) per view."""
    if args.smoke:
        return [("smoke", ["--steps", "2"], None)]
    planned = []
    if args.minutes:
        planned.append((f"m{args.minutes:g}", ["--minutes", str(args.minutes)], Budget(seconds=60 * args.minutes)))
    if args.equal_data:
        batches, ids = first_batches(cfg, source, args.equal_data)
        print(f"equal data: our first {batches} batches hold {len(ids)} samples (>= {args.equal_data})", flush=True)
        planned.append((f"d{args.equal_data}", ["--steps", str(batches)], None))
    return planned


def check_held_out(run_dir: Path, source) -> None:
    """Our run held out the records the peers' rows leave out (none of the rows is a held-out record)."""
    stored = json.loads((run_dir / "held_out.json").read_text())
    if set(stored["ids"]) & {int(i) for i in source.ids} or len(stored["ids"]) + len(source) != stored["num_records"]:
        sys.exit(f"{run_dir / 'held_out.json'} holds out other records than the peers' rows leave out")


def run(args: argparse.Namespace, out: Path) -> int:
    """Synthesize, then every view: ours, then each peer set up, each evaluated. The peers that failed (each said
    why), or 2 when no peer asked for is set up."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = run_config(args.gguf, out, args.held_out, args.smoke)
    peers = peers_set_up(args, cfg)
    if peers is None:
        return 2
    options = ["--held-out", str(args.held_out), "--eval-every", "0", "--sampled-prompts", str(args.sampled_prompts)]
    quality = synthesized_quality_command(args.gguf, out, args.magpie, *options, smoke=args.smoke)
    source = training_source(cfg)
    draft = draft_shape(cfg, out / "draft")
    max_tokens = args.peer_max_tokens or default_max_tokens(
        out, bytes_per_token(draft, draft.config.target_hidden_size)
    )
    print(f"the peers' disk cap: {max_tokens:,} tokens of rows", flush=True)
    failed = 0
    for view, ours_budget, budget in views(args, cfg, source):
        ours = trained(out, view, "ours")
        if ours is None:
            ours = train_ours(out, quality, view, ours_budget)
            ours["tokens_trained"] = tokens_of(source, ours["sample_ids"])
            save(out, view, "ours", {**ours, "peer_max_tokens": max_tokens})
        print(f"{view}: ours trained {ours['samples']} samples in {ours['train_s']:.0f} s", flush=True)
        check_held_out(out / f"ours-{view}", source)
        context = {
            "cfg": cfg,
            "device": "cpu" if args.smoke else "cuda:0",
            "draft": draft,
            "run_dir": out / f"ours-{view}",
            "evaluations": evaluation_runs(
                args.held_out, out / "humaneval", HUMANEVAL_PROMPTS[args.smoke], args.sampled_prompts
            ),
        }
        rows, budget = peer_rows(cfg, source, view, ours, budget, max_tokens)
        failed += run_peers(peers, out, view, rows, context, budget, max_tokens)
        failed += evaluate_rows(out, view, context)
    return failed


def peers_set_up(args: argparse.Namespace, cfg) -> list | None:
    """The peers asked for that are set up (each missing one said), or None (said why) when none can run."""
    try:
        peers, missing = pick_peers(args.peers, known_peers(cfg, args.smoke))
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return None
    for line in missing:
        print(f"missing peer: {line}", flush=True)
    if args.peers and not peers:
        print(
            "error: none of the peers asked for is set up (see above); ours alone: launch.bench.quality",
            file=sys.stderr,
        )
        return None
    return peers


def peer_rows(cfg, source, view: str, ours: dict, budget: Budget | None, max_tokens: int) -> tuple[list, Budget]:
    """The rows a view's peers train on, and their budget: without one, the samples ours trained, in its order,
    one epoch; else an epoch in the run's order. Both within the disk cap of ``max_tokens``."""
    if budget is not None:
        return rows_of(source, epoch_order(cfg, source), max_tokens)[1], budget
    ids, rows = rows_of(source, ours["sample_ids"], max_tokens)
    if len(ids) < len(ours["sample_ids"]):
        print(f"{view}: the peers' disk cap holds {len(ids)} of the {ours['samples']} samples ours trained")
    return rows, Budget(samples=len(rows))


def run_peers(peers: list, out: Path, view: str, rows: list, context: dict, budget: Budget, max_tokens: int) -> int:
    """Train each peer not trained in an earlier call on ``rows``; how many failed (each row saved)."""
    failed = 0
    for peer in peers:
        if trained(out, view, peer.name) is not None:
            print(f"{view}: {peer.name} trained in an earlier call", flush=True)
            continue
        try:
            record = run_peer(peer, out, view, rows, context, budget)
        except (SystemExit, Exception) as exc:  # one peer's failure loses neither ours nor the other peer's row
            failed += 1
            print(f"{view}: {peer.name} failed: {exc}", flush=True)
            save(out, view, peer.name, {"row": peer.name, "view": view, "error": str(exc)})
            continue
        save(out, view, peer.name, {**record, "peer_max_tokens": max_tokens})
        print(f"{view}: {peer.name} trained {record['samples']} samples, {record['steps']} steps", flush=True)
    return failed

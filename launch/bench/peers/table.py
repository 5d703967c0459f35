"""The peers table: one row per trainer and view from ``out/peers-VIEW-ROW.json``, ours first, each tau beside the
best peer's."""

from __future__ import annotations

import json
from pathlib import Path

from launch.bench.harness import Table

GIB = 2**30
ORDER = {"ours": 0, "specforge": 1, "speculators": 2}
EVALUATIONS = ("held_out", "humaneval", "held_out_sampled", "humaneval_sampled")


def table_rows(out: Path) -> list[dict]:
    """Every row evaluated in ``out`` (a row still training, or cut short, is left out), by view then trainer, with
    its samples per second of training and per GPU-minute (dump included) and, for ours, each tau and that rate over the best peer's."""
    rows = []
    for path in sorted(out.glob("peers-*-*.json")):
        record = json.loads(path.read_text())
        if "error" in record:
            rows.append(record)
            continue
        if "held_out" not in record:
            continue
        record.pop("sample_ids", None)
        minutes = (record["dump_s"] + record["train_s"]) / 60
        record["samples_per_gpu_min"] = record["samples"] / minutes if minutes > 0 else None
        record["samples_per_s"] = record["samples"] / record["train_s"] if record["train_s"] > 0 else None
        rows.append(record)
    rows.sort(key=lambda r: (r["view"], ORDER.get(r["row"], len(ORDER))))
    for ours in (r for r in rows if r["row"] == "ours"):
        peers = [r for r in rows if r["view"] == ours["view"] and r["row"] != "ours" and "error" not in r]
        for key in [*(f"{e}_tau" for e in EVALUATIONS), "samples_per_gpu_min"]:
            best = max((_value(p, key) for p in peers if _value(p, key)), default=None)
            if best and _value(ours, key):
                ours[f"{key}_vs_best_peer"] = _value(ours, key) / best
    return rows


def _value(row: dict, key: str) -> float | None:
    """A row's figure: ``EVAL_tau`` is the evaluation's tau in our convention."""
    if key.endswith("_tau"):
        return (row.get(key.removesuffix("_tau")) or {}).get("tau")
    return row.get(key)


def _pair(row: dict, evaluation: str) -> str:
    e = row.get(evaluation)
    if not e:
        return "-"
    zlab = e.get("zlab_tau")
    return f"{e['tau']:.3f}/{zlab:.3f}" if zlab is not None else f"{e['tau']:.3f}"


def print_table(rows: list[dict]) -> None:
    columns = [
        ("view", "<7"),
        ("row", "<12"),
        ("dump s", ">7"),
        ("train s", ">7"),
        ("steps", ">6"),
        ("samples", ">8"),
        ("tokens", ">11"),
        ("samples/GPU-min", ">15"),
        ("peak GiB", ">8"),
        ("disk GiB", ">8"),
        ("held-out", ">11"),
        ("HumanEval", ">11"),
        ("held-out T=1", ">12"),
        ("HumanEval T=1", ">13"),
        ("sim", ">6"),
    ]
    table = Table(columns)
    print(table.header())
    for r in rows:
        if "error" in r:
            print(f"{r['view']:<7} {r['row']:<12} failed: {r['error']}")
            continue
        peak = r.get("peak_gpu_bytes")
        tokens = r.get("tokens_trained")
        print(
            table.row(
                r["view"],
                r["row"],
                f"{r['dump_s']:.0f}",
                f"{r['train_s']:.0f}",
                r["steps"],
                r["samples"],
                "-" if tokens is None else f"{tokens:,}",
                "-" if r["samples_per_gpu_min"] is None else f"{r['samples_per_gpu_min']:.0f}",
                "-" if peak is None else f"{peak / GIB:.1f}",
                f"{r['disk_bytes'] / GIB:.1f}",
                *(_pair(r, e) for e in EVALUATIONS),
                f"{r['held_out']['sim_tau']:.3f}",
            )
        )
    for ours in (r for r in rows if r["row"] == "ours"):
        ratios = {k.removesuffix("_vs_best_peer"): v for k, v in ours.items() if k.endswith("_vs_best_peer")}
        if ratios:
            print(f"{ours['view']}: ours over the best peer: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(
        "tau as ours/z-lab's (greedy; T=1: sampled, top-p 0.95); a peer's GPU minutes include its dump; the peers "
        "train on at most peer_max_tokens tokens of rows (what their disk holds), ours streams every record"
    )

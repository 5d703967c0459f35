"""The drafter kinds (DFlash, DFlash 2, DSpark) on a real model, at equal data and equal GPU time.

    python -m launch.bench.kinds --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR --minutes 4 --sampled-prompts 48 \\
        dflash dflash2 dspark dflash@1 dflash2@1 dspark@1 --warm
    python -m launch.bench.kinds --out DIR --table                                       # the table so far

The data is synthesized once (``launch.bench.quality --synthesize-only``: the target's own Magpie prompts and
answers, HumanEval's prompts answered too). Then every ROW (a name of ``ROWS``, ``@SEED`` for training.seed) is one
``launch.bench.quality --reuse-data --minutes M`` run, all side by side on the GPU under one MPS daemon: each trains
for the same wall-clock budget (training.max_minutes) while the others run, so a kind whose step costs more trains
fewer steps. Once a wave's rows have trained, they are evaluated together by real decoding (greedy, and sampled with
``--sampled-prompts``): each evaluation one process for all the rows' last checkpoints, against one reference of
the target. Every row's producers also evaluate it every ``--eval-every`` steps while it trains: the equal-steps
view (real tau held-out at the steps every row reached), beside the equal-minutes one.

The rows are sized to the card first (``plan``): each row needs its producers, its trainer and its standby trainer
(launch/bench/memory.py estimates them from the preset), and rows that do not fit the card together run in waves of rows
that do (as even as can be, in the order given: list the rows compared side by side next to each other). A row that
does not fit the card alone stops the benchmark with exit 2, saying what would fit, before anything starts.
``--card-gib`` gives the card's memory instead of asking the GPU; ``--plan`` prints the waves and stops.

``--warm``: DFlash 2 warm-started from DFlash at the same total budget. The first DFlash row keeps a checkpoint
every 50 steps; once it and the first DFlash 2 row have trained, a DFlash 2 drafter starts from the DFlash
checkpoint nearest half the budget (``drafter.init_from``) and trains half the steps the DFlash 2 row trained
beside the others (steps, not minutes: it trains once the other rows have trained, with more of the GPU than they
had; its wave is evaluated after it). So it has spent half a budget as DFlash and half as DFlash 2.

Prints a table and one JSON line (DIR/kinds.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.bench.memory import GIB, MemoryEstimate
from launch.bench.quality import SIZES, evaluated_together, evaluation_runs, last_checkpoint, record_evaluation, save
from launch.bench.side_by_side import (
    SideBySide,
    parse_side_by_side,
    save_and_emit,
    side_by_side_parser,
    synthesized_quality_command,
)

ROWS: dict[str, tuple[str, list[str]]] = {
    "dflash": ("dflash", []),
    "dflash2": ("dflash2", []),
    "dflash2-exclude": ("dflash2", ['drafter.dflash2.selector_missing_gold="exclude"']),
    "dflash2-stopgrad": ("dflash2", ["drafter.dflash2.selector_stop_gradient=true"]),
    "dspark": ("dspark", []),
    "dspark-gated": ("dspark", ['drafter.dspark.markov_head_type="gated"']),
}
"""The kinds on the target's preset (launch/smollm2-135m.toml): DFlash; DFlash 2 with its defaults (the gold token
injected among the selector's candidates where the top-K missed it, gradients through the candidates); DFlash 2
with the gold excluded instead; DFlash 2 with the selector's loss stopped at the candidate logits; DSpark with its
defaults (a vanilla rank-256 Markov head, a confidence head); DSpark with the gated Markov head."""
WARM = "dflash2-warm"
WARM_SOURCE_CHECKPOINT_EVERY = 50
CARD_RESERVE = 0.05
"""The share of the card no row may plan on: the MPS server's own memory, and the estimate's error."""


def row_of(spec: str) -> tuple[str, tuple[str, list[str]]]:
    """``name[@seed]`` -> (run name, (its kind, its config overrides)). Exit 2 naming an unknown row."""
    name, _, seed = spec.partition("@")
    if name not in ROWS:
        print(f"unknown row {name!r} in {spec!r}; known: {', '.join(ROWS)}", file=sys.stderr)
        sys.exit(2)
    kind, overrides = ROWS[name]
    return f"{name}-s{int(seed or 0)}", (kind, [*overrides, f"training.seed={int(seed or 0)}"])


@functools.cache
def _estimate(gguf: Path, kind: str, overrides: tuple[str, ...]) -> tuple[MemoryEstimate, bool]:
    """The preset's estimate with a row's kind and overrides, and whether its run starts a standby trainer."""
    from common.config import load_config
    from launch.bench.memory import estimate
    from launch.bench.quality import PRESET

    cfg = load_config(PRESET, [f"target.path={json.dumps(str(gguf.resolve()))}", f"drafter.kind={kind}", *overrides])
    return estimate(cfg), cfg.launch.standby_trainer_after_s >= 0


def row_needs(gguf: Path, runs: dict[str, tuple[str, list[str]]], producers: int) -> dict[str, tuple[int, str]]:
    """Each row's bytes on the card, with how they add up: ``producers`` producers, the trainer and its standby, of
    the preset with the row's kind and overrides (launch/bench/memory.py)."""
    needs: dict[str, tuple[int, str]] = {}
    for name, (kind, overrides) in runs.items():
        same_memory = tuple(o for o in overrides if not o.startswith("training.seed="))  # the seed changes nothing
        e, has_standby = _estimate(gguf, kind, same_memory)
        standby = e.standby if has_standby else 0
        total = producers * e.producer + e.trainer + standby
        needs[name] = (
            total,
            f"{total / GIB:.1f} GiB: {producers} producers of {e.producer / GIB:.1f}, a trainer of {e.trainer / GIB:.1f} "
            f"and its standby of {standby / GIB:.1f}",
        )
    return needs


def plan_waves(needs: dict[str, int], usable: int) -> list[list[str]]:
    """The rows, in their order, in the fewest waves whose rows fit ``usable`` bytes together, the waves as even as
    can be (their sizes differ by one at most). ValueError naming a row that does not fit alone."""
    names = list(needs)
    for name in names:
        if needs[name] > usable:
            raise ValueError(name)
    for count in range(1, len(names) + 1):
        size, extra = divmod(len(names), count)
        waves, start = [], 0
        for index in range(count):
            end = start + size + (index < extra)
            waves.append(names[start:end])
            start = end
        if all(sum(needs[n] for n in wave) <= usable for wave in waves):
            return waves
    raise AssertionError("one row per wave fits")  # every row fits alone (checked above)


def card_bytes(card_gib: float | None) -> int:
    """The card's memory: ``--card-gib``, else what the GPU says (exit 2 without one)."""
    if card_gib is not None:
        return int(card_gib * GIB)
    # Asked in a process of its own, so that no CUDA state of this one outlives the question beside the rows.
    ask = "import torch; print(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0)"
    total = int(subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True, check=True).stdout)
    if not total:
        print("error: no CUDA GPU to size the rows for: give its memory with --card-gib, or --smoke", file=sys.stderr)
        sys.exit(2)
    return total


def plan(args: argparse.Namespace, runs: dict[str, tuple[str, list[str]]]) -> list[list[str]]:
    """The waves of ``runs`` on the card, printed; exit 2 naming a row that cannot fit alone and what would fit.

    The warm row trains a number of steps, not minutes, and starts once its source rows trained: it goes into their
    wave where it fits there (it then trains once they have trained, before their evaluation), else into a wave of
    its own at the end, never beside rows that train on the clock."""
    card = card_bytes(args.card_gib)
    usable = int(card * (1 - CARD_RESERVE))
    rows = {**runs, **({f"{WARM}-s0": runs["dflash2-s0"]} if args.warm else {})}
    needs = row_needs(args.gguf, rows, args.producers)
    try:
        waves = plan_waves({name: needs[name][0] for name in runs}, usable)
        if args.warm:
            warm = f"{WARM}-s0"
            if needs[warm][0] > usable:
                raise ValueError(warm)
            home = max(i for i, wave in enumerate(waves) if {"dflash-s0", "dflash2-s0"} & set(wave))
            if sum(needs[n][0] for n in waves[home]) + needs[warm][0] <= usable:
                waves[home].append(warm)
            else:
                waves.append([warm])
    except ValueError as exc:
        name = str(exc)
        fewer = [
            p
            for p in range(args.producers - 1, 0, -1)
            if row_needs(args.gguf, {name: rows[name]}, p)[name][0] <= usable
        ]
        print(
            f"error: row {name} needs {needs[name][1]}; the card has {card / GIB:.1f} GiB, {usable / GIB:.1f} of which "
            f"rows may use ({CARD_RESERVE:.0%} kept free). "
            + (
                f"It fits with --producers {fewer[0]}."
                if fewer
                else "It does not fit with one producer either: lower batching.token_budget or drafter.num_anchors "
                "in launch/smollm2-135m.toml, or use a larger card."
            ),
            file=sys.stderr,
        )
        sys.exit(2)
    print(f"card: {card / GIB:.1f} GiB, rows may use {usable / GIB:.1f}", flush=True)
    for name, (_, how) in needs.items():
        print(f"  {name} needs {how}", flush=True)
    for index, wave in enumerate(waves, 1):
        total = sum(needs[n][0] for n in wave)
        print(f"wave {index}: {', '.join(wave)} ({total / GIB:.1f} GiB)", flush=True)
    if len(waves) > 1:
        print(
            f"the rows do not fit the card together: {len(waves)} waves, each row beside those of its wave only",
            flush=True,
        )
    return waves


def checkpoint_nearest(run_dir: Path, seconds: float) -> Path:
    """The run's checkpoint whose seconds of training (trainer_state.json) are nearest ``seconds``."""
    checkpoints = list((run_dir / "checkpoints").glob("step-*"))
    if not checkpoints:
        sys.exit(f"{run_dir} kept no checkpoint to warm-start from")
    return min(
        checkpoints,
        key=lambda p: abs(json.loads((p / "trainer_state.json").read_text())["trained_s"] - seconds),
    )


def trained(out: Path, name: str) -> dict | None:
    """A row's quality JSON once its training is over (its wave's rows are then evaluated together), else None."""
    path = out / f"quality-{name}.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if "trained_s" in result else None


def table(out: Path) -> list[dict]:
    """One row per evaluated run in ``out``, in the order DFlash, DFlash 2, its options; each tau beside DFlash's
    (the first seed's)."""
    rows = []
    for path in sorted(out.glob("quality-*-s*.json")):
        run = json.loads(path.read_text())
        if "held_out" not in run:
            continue  # still training, or cut short
        row = {
            "row": path.stem.removeprefix("quality-"),
            "kind": run["kind"],
            "overrides": run["overrides"],
            "steps": run["steps"],
            "samples": run["trained_samples"],
            "trained_min": (run.get("trained_s") or 0) / 60,
            "samples_per_s": run.get("samples_per_s"),
            "busy_share": run.get("busy_share"),
            "selector_recall": run.get("kind_metrics", {}).get("selector/recall"),
            "selector_accuracy": run.get("kind_metrics", {}).get("selector/accuracy"),
            "kind_metrics": run.get("kind_metrics", {}),
            "curve": {point["step"]: point["tau"] for point in run.get("curve", [])},
        }
        for name in ("held_out", "humaneval", "held_out_sampled", "humaneval_sampled"):
            if name in run:
                row[f"{name}_tau"] = run[name]["tau"]
                row[f"{name}_zlab_tau"] = run[name].get("zlab_tau")
        row["held_out_sim_tau"] = run["held_out"]["sim_tau"]
        rows.append(row)
    order = {name: i for i, name in enumerate([*ROWS, WARM])}
    rows.sort(key=lambda r: (order.get(r["row"].rsplit("-s", 1)[0], len(order)), r["row"]))
    baseline = next((r for r in rows if r["row"] == "dflash-s0"), None)
    for row in rows:
        for name in ("held_out", "humaneval", "held_out_sampled", "humaneval_sampled"):
            key = f"{name}_tau"
            if baseline and row.get(key) and baseline.get(key):
                row[f"{name}_vs_dflash"] = row[key] / baseline[key]
    return rows


def equal_steps(rows: list[dict]) -> list[dict]:
    """The equal-steps view: at each step every row evaluated during training, each row's real tau held-out (from its
    producers' evaluations of that step's weights)."""
    common = set.intersection(*(set(r["curve"]) for r in rows)) if rows else set()
    return [{"step": step, **{r["row"]: r["curve"][step] for r in rows}} for step in sorted(common)]


def print_equal_steps(rows: list[dict]) -> None:
    points = equal_steps(rows)
    if not points:
        print("equal steps: no step that every row evaluated during training (--eval-every)")
        return
    names = [r["row"] for r in rows]
    print("real tau held-out during training, at the steps every row reached:")
    print(f"{'step':>6} " + " ".join(f"{name:>16}" for name in names))
    for point in points:
        print(f"{point['step']:6d} " + " ".join(f"{point[name]:16.3f}" for name in names))


def _cell(value: float | None, form: str = "{:.3f}") -> str:
    return "-" if value is None else form.format(value)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'row':22} {'steps':>6} {'samples':>8} {'min':>5} {'samples/s':>9} {'busy':>5} "
        f"{'held-out':>15} {'x DFlash':>8} {'HumanEval':>15} {'x DFlash':>8} {'held-out T=1':>15} "
        f"{'HumanEval T=1':>15} {'sim':>6} {'recall':>6} {'acc':>6}"
    )
    for r in rows:
        pairs = {
            name: f"{_cell(r.get(f'{name}_tau'))} / {_cell(r.get(f'{name}_zlab_tau'))}"
            for name in ("held_out", "humaneval", "held_out_sampled", "humaneval_sampled")
        }
        print(
            f"{r['row']:22} {r['steps']:6d} {r['samples']:8d} {r['trained_min']:5.1f} "
            f"{_cell(r['samples_per_s'], '{:.0f}'):>9} {_cell(r['busy_share'], '{:.0%}'):>5} "
            f"{pairs['held_out']:>15} {_cell(r.get('held_out_vs_dflash'), '{:.3f}x'):>8} "
            f"{pairs['humaneval']:>15} {_cell(r.get('humaneval_vs_dflash'), '{:.3f}x'):>8} "
            f"{pairs['held_out_sampled']:>15} {pairs['humaneval_sampled']:>15} {_cell(r['held_out_sim_tau']):>6} "
            f"{_cell(r['selector_recall']):>6} {_cell(r['selector_accuracy']):>6}"
        )
    print("tau as ours / z-lab's; x DFlash: ours against dflash-s0's; recall and acc: the selector's, last batches")


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The arguments (a smoke run's prompts cut to what ``launch.bench.quality --smoke`` evaluates) and the parser."""
    parser = side_by_side_parser(__doc__.split("\n\n")[0], "kinds", magpie=24576)
    parser.add_argument("--minutes", type=float, default=4.0, help="training budget of every row (wall clock)")
    parser.add_argument("--held-out", type=int, default=128, help="synthesized records held out for evaluation")
    parser.add_argument("--sampled-prompts", type=int, default=48, help="prompts of each set decoded sampled")
    parser.add_argument(
        "--eval-every", type=int, default=200, help="steps between evaluations during training (the equal-steps view)"
    )
    parser.add_argument(
        "--producers", type=int, default=2, help="producers of every row, all on the one GPU (launch.producer_devices)"
    )
    parser.add_argument("--warm", action="store_true", help="also DFlash 2 warm-started from the first DFlash row")
    parser.add_argument(
        "--card-gib", type=float, help="the GPU's memory in GiB, to size the rows for (default: what the GPU says)"
    )
    parser.add_argument("--plan", action="store_true", help="print the rows' waves on the card and stop")
    parser.add_argument("rows", nargs="*", metavar="ROW", help=f"name[@seed], names: {', '.join(ROWS)}")
    args = parse_side_by_side(parser, argv)
    if args.smoke:  # the pipeline only: 48 sampled HumanEval prompts took 9 min a drafter on two cores
        args.held_out, args.sampled_prompts = min(args.held_out, SIZES["held_out"][2]), min(args.sampled_prompts, 2)
    return args, parser


def main(argv: list[str] | None = None) -> int:
    args, parser = parse(argv)
    out = args.out.resolve()
    failed = 0
    if not args.table:
        runs = dict(row_of(spec) for spec in args.rows)
        if args.warm and not {"dflash-s0", "dflash2-s0"} <= set(runs):
            parser.error("--warm needs the rows dflash and dflash2 (seed 0): its source and its step count")
        if args.card_gib is not None and args.card_gib <= 0:
            parser.error(f"--card-gib must be > 0, got {args.card_gib}")
        waves = [[*runs, *([f"{WARM}-s0"] if args.warm else [])]] if args.smoke else plan(args, runs)
        if args.plan:
            return 0
        started = time.monotonic()
        failed = train_side_by_side(args, out, runs, waves)
        print(f"all rows in {(time.monotonic() - started) / 60:.1f} min from the GGUF file", flush=True)
    rows = table(out)
    print_table(rows)
    print_equal_steps(rows)
    save_and_emit(out, "kinds", rows, minutes=args.minutes, equal_steps=equal_steps(rows))
    return 1 if failed else 0


def train_side_by_side(
    args: argparse.Namespace, out: Path, runs: dict[str, tuple[str, list[str]]], waves: list[list[str]]
) -> int:
    """Synthesize the data (once per --out), then train the rows of each wave at the same time and evaluate them
    together, one wave after the other; with --warm, the warm-started row once its source and its step count are
    known. How many rows failed to train or to be evaluated (each said why)."""
    device = "cpu" if args.smoke else "cuda:0"
    quality = synthesized_quality_command(
        args.gguf,
        out,
        args.magpie,
        *("--held-out", str(args.held_out), "--sampled-prompts", str(args.sampled_prompts)),
        *("--eval-every", str(10 if args.smoke else args.eval_every)),
        smoke=args.smoke,
    )
    producers = f"launch.producer_devices={json.dumps([device] * args.producers)}"

    def command(name: str, kind: str, options: list[str], overrides: list[str]) -> list[str]:
        trains = ["--reuse-data", "--no-final-eval", "--name", name, "--kind", kind]
        return [*quality, *trains, *options, *overrides, producers]

    processes = max(len(wave) for wave in waves) * (args.producers + 1)
    failed = 0
    with SideBySide(out, "kinds", processes, smoke=args.smoke) as rows:  # one MPS daemon for every wave
        for index, wave in enumerate(waves, 1):
            if len(waves) > 1:
                print(f"wave {index} of {len(waves)}: {', '.join(wave)}", flush=True)
            for name in wave:
                if name == f"{WARM}-s0":
                    continue
                kind, overrides = runs[name]
                if args.warm and name == "dflash-s0":  # the warm row's source: checkpoints to pick half the budget from
                    overrides = [
                        *overrides,
                        f"training.checkpoint_every={WARM_SOURCE_CHECKPOINT_EVERY}",
                        "training.keep_last=100000",
                    ]
                rows.launch(name, command(name, kind, ["--minutes", str(args.minutes)], overrides))
            if f"{WARM}-s0" in wave:  # its source and step count ran in this wave or an earlier one
                while not (trained(out, "dflash-s0") and trained(out, "dflash2-s0")):
                    if any(rows.children[n].poll() not in (None, 0) for n in ("dflash-s0", "dflash2-s0")):
                        sys.exit(
                            "the warm row's source or step count failed; see kinds-dflash-s0.log, kinds-dflash2-s0.log"
                        )
                    time.sleep(5)
                source = checkpoint_nearest(out / "dflash-s0", 30 * args.minutes)
                steps = max(1, trained(out, "dflash2-s0")["steps"] // 2)
                print(f"{WARM}: from {source.name} of dflash-s0, {steps} steps", flush=True)
                overrides = [f"drafter.init_from={json.dumps(str(source))}", "training.seed=0"]
                rows.launch(f"{WARM}-s0", command(f"{WARM}-s0", "dflash2", ["--steps", str(steps)], overrides))
            failed += len(rows.wait(wave))
            failed += evaluate_rows(args, out, wave, f"wave{index}")
    return failed


def evaluate_rows(args: argparse.Namespace, out: Path, names: list[str], label: str) -> int:
    """The rows of ``names`` that trained, evaluated together: each evaluation one ``launch.evaluate`` process for
    all their last checkpoints, against one reference of the target (every row trains on the same data and holds
    out the same records, so the first row's run names them), each row alone should that fail; each row's figures
    go into its record (quality-ROW.json) as ``launch.bench.quality`` writes them. How many failed (each said why)."""
    done = [name for name in names if trained(out, name) is not None]
    if not done:
        return 0
    humaneval = SIZES["humaneval_prompts"][2 if args.smoke else 1]
    runs = evaluation_runs(args.held_out, out / "humaneval", humaneval, args.sampled_prompts)
    started = time.monotonic()
    checkpoints = [last_checkpoint(out / name) for name in done]
    figures = evaluated_together(checkpoints, done, out / done[0], out, label, runs)
    seconds = time.monotonic() - started
    for name, row_figures in zip(done, figures):
        if row_figures is not None:
            result = trained(out, name)
            record_evaluation(result, row_figures, seconds)
            save(out, name, result)
    print(f"{label}: {len(done)} rows evaluated together in {seconds:.0f} s", flush=True)
    return sum(row_figures is None for row_figures in figures)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())

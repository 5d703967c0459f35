"""The recipe table: training options side by side on a real model, at equal data and equal steps.

    python -m launch.bench.recipes --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR \\
        default layers5 layers12 step16k:2000 lr_half
    python -m launch.bench.recipes --gguf FILE --out DIR default@1 layers12@1              # second seeds, later
    python -m launch.bench.recipes --out DIR --table                                         # the table so far

Each RECIPE is a name of ``RECIPES``, or names joined by ``+`` (their settings together), with ``:STEPS`` for its
own training steps and ``@SEED`` for training.seed (0 when left out). The data is synthesized once
(``launch.bench.quality --synthesize-only``: the target's own Magpie prompts and answers, HumanEval's prompts
answered too); then every recipe is one
``launch.bench.quality --reuse-data`` run: the same records in the same order for the same steps, then real tau
on the held-out synthesized records and on HumanEval. The recipes train side by side on one GPU (one MPS
daemon serves them all), so each one's samples/s is its rate while sharing the GPU with the others: an option
that costs speed shows it against the rows that ran beside it. Prints a table and one JSON line (DIR/recipes.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from launch.bench.side_by_side import (
    SideBySide,
    parse_side_by_side,
    save_and_emit,
    side_by_side_parser,
    synthesized_quality_command,
)

RECIPES: dict[str, list[str]] = {
    "default": [],
    "former": ['training.weighting="decay"', 'training.optimizer="adamw"'],
    "dpace": ['training.weighting="dpace"'],
    "lk_soft": ['training.label_mode="target_soft"', 'training.objective="lk"'],
    "lk_hybrid": ['training.objective="lk_hybrid"'],
    "wsd": ['training.schedule="wsd"'],
    "muon": ['training.optimizer="muon"'],
    "dense": ["drafter.num_anchors=16384"],
    "layers3": ["drafter.num_layers=3"],
    "layers5": ["drafter.num_layers=5"],
    "layers12": ["drafter.num_layers=12"],
    "lr_half": ["training.lr=6e-4"],
    "lr_double": ["training.lr=2.4e-3"],
    "step16k": ["batching.token_budget=16384", "drafter.num_anchors=512", "training.lr=6e-4"],
}
"""Each option alone, as config overrides on the project's defaults for the target (launch/smollm2-135m.toml: D-PACE
and Muon, 8 drafter layers, 65,536 tokens and 2,048 anchors per step, lr 1.2e-3). former: the weighting and
optimizer before D-PACE and Muon (decay weights, AdamW); the options of the first recipe table were measured on
top of it and of the former step (BENCHMARKS.md), e.g. ``former+step16k+layers5+wsd``.
lk_soft: the LK loss needs soft labels to differ from the CE (with the data's tokens -log q(label) is the CE), so
it trains on the target's distribution. dense: 16,384 anchors per 65,536-token batch (1 per 4 tokens, the
published recipe's density on samples shorter than its 3,072 tokens) against the preset's 2,048 (1 per 32).
layers3, layers5, layers12, lr_half, lr_double: the preset's size and step against smaller and larger.
step16k: the preset's former step, a quarter of the tokens and anchors at half the lr (a 135M target's steps are
short: the larger one trains more tokens per second, BENCHMARKS.md#quality). Epochs are set by ``--steps`` against
``--magpie``, the same for every recipe of one call unless a recipe names its own steps (``name:STEPS``)."""


def overrides_of(spec: str) -> tuple[str, list[str]]:
    """``name[+name...][:steps][@seed]`` -> (run name, its config overrides). Exit 2 naming an unknown recipe."""
    names, _, seed = spec.partition("@")
    names, _, steps = names.partition(":")
    overrides = [f"training.max_steps={int(steps)}"] if steps else []
    for name in names.split("+"):
        if name not in RECIPES:
            sys.exit(f"unknown recipe {name!r} in {spec!r}; known: {', '.join(RECIPES)}")
        overrides += RECIPES[name]
    seed = seed or "0"
    return f"{names}{f'-{int(steps)}steps' if steps else ''}-s{seed}", [*overrides, f"training.seed={int(seed)}"]


def table(out: Path) -> list[dict]:
    """One row per recipe run found in ``out`` (its quality-NAME.json), best held-out real tau first."""
    rows = []
    for path in sorted(out.glob("quality-*-s*.json")):
        run = json.loads(path.read_text())
        if "held_out" not in run:
            continue  # still training, or cut short
        rows.append(
            {
                "recipe": path.stem.removeprefix("quality-"),
                "overrides": run["overrides"],
                "tau_held_out": run["held_out"]["tau"],
                "sim_tau_held_out": run["held_out"]["sim_tau"],
                "tau_humaneval": run["humaneval"]["tau"],
                "sim_tau_humaneval": run["humaneval"]["sim_tau"],
                "samples": run["trained_samples"],
                "train_s": run["train_s"],
                "samples_per_s": run["trained_samples"] / run["train_s"],
                "steps": run["steps"],
            }
        )
    return sorted(rows, key=lambda row: -row["tau_held_out"])


def print_table(rows: list[dict]) -> None:
    baseline = next((row["tau_held_out"] for row in rows if row["recipe"] == "default-s0"), None)
    print(
        f"{'recipe':28} {'tau held-out':>12} {'vs default':>10} {'tau HumanEval':>13} {'sim tau':>8} "
        f"{'steps':>6} {'samples':>8} {'samples/s':>9} {'train min':>9}"
    )
    for row in rows:
        gain = f"{row['tau_held_out'] / baseline - 1:+.1%}" if baseline else "-"
        print(
            f"{row['recipe']:28} {row['tau_held_out']:12.3f} {gain:>10} {row['tau_humaneval']:13.3f} "
            f"{row['sim_tau_held_out']:8.3f} {row['steps']:6d} {row['samples']:8d} {row['samples_per_s']:9.1f} "
            f"{row['train_s'] / 60:9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser(__doc__.split("\n\n")[0], "recipes", magpie=36864)
    parser.add_argument("--steps", type=int, default=800, help="training steps of every recipe")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluations during training (0: at the end only)")
    parser.add_argument(
        "--rows", type=int, help="rows the synthesis decodes at once (synthesize.rows; the preset's when left out)"
    )
    parser.add_argument(
        "recipes", nargs="*", metavar="RECIPE", help="name[+name...][:steps][@seed], e.g. dense+wsd@1, step16k:2000"
    )
    args = parse_side_by_side(parser, argv)
    out = args.out.resolve()
    failed = []
    if not args.table:
        runs = dict(overrides_of(spec) for spec in args.recipes)
        failed = train_side_by_side(args, out, runs)
    rows = table(out)
    print_table(rows)
    save_and_emit(out, "recipes", rows)
    return 1 if failed else 0


def train_side_by_side(args: argparse.Namespace, out: Path, runs: dict[str, list[str]]) -> list[str]:
    """Synthesize the data (once per --out), then run every recipe's training and evaluation at the same time; the
    recipes that failed (each said why)."""
    quality = synthesized_quality_command(
        args.gguf,
        out,
        args.magpie,
        *("--steps", str(args.steps), "--eval-every", str(args.eval_every)),
        *(["--rows", str(args.rows)] if args.rows else []),
        smoke=args.smoke,
    )
    with SideBySide(out, "recipe", processes=2 * len(runs), smoke=args.smoke) as runs_on_the_gpu:
        for name, overrides in runs.items():
            runs_on_the_gpu.launch(name, [*quality, "--reuse-data", "--name", name, *overrides])
        return runs_on_the_gpu.wait()


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())

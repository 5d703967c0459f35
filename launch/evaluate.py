"""Acceptance evaluation of a checkpoint or an export, offline: real speculative decoding of the run's target
with the drafter (greedy, or sampled with lossless rejection sampling at eval.temperature > 0), on the held-out
split of the run's data (producer/acceptance/).

    python -m launch.evaluate --checkpoint RUN/checkpoints/step-N     # the run's target and held-out data
    python -m launch.evaluate --checkpoint DIR --target HF_DIR [--config FILE] [key=value ...]
    python -m launch.evaluate --checkpoint DIR --temperature 0.7 --top-p 0.95 --seed 1 eval.max_new_tokens=2048
    python -m launch.evaluate --checkpoint DIR --by-length 'eval.length_buckets=[2048, 8192, 32768]'
    python -m launch.evaluate --checkpoint A --checkpoint B --run-dir RUN       # several drafters, one reference

Several ``--checkpoint``: the target is loaded once and its reference (the greedy continuations and the records'
features) made once, then each drafter is evaluated against it in turn; every checkpoint is loaded before the first
evaluation, so one that cannot be read stops the command at once (exit 2, naming it) without spending the target's
time. ``--json-out`` then holds a list, one result per checkpoint in their order.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch

from common.acceptance.report import AcceptanceReport
from common.config import ConfigError, RunConfig, load_config
from common.drafter.base import Drafter
from common.drafter.export import drafter_folder, load_drafter
from common.drafter.loss import LossConfig
from common.drafter.target_head import TargetHead, load_target_head
from common.lifecycle import EXIT_CONFIG_ERROR
from common.rundir import RunDir
from producer.acceptance.evaluator import AcceptanceEvaluator, build_evaluator
from producer.target_model.load import load_target_model, target_head_of


def _run_dir_of(checkpoint: Path) -> Path | None:
    """The run directory above a checkpoint (the first parent with a config.toml)."""
    return next((p for p in checkpoint.resolve().parents if (p / "config.toml").is_file()), None)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Real speculative decoding of the target with an exported drafter (greedy, or sampled with "
        "lossless rejection sampling): tau (ours and z-lab's), per-position acceptance and target "
        "forwards saved on held-out data."
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        type=Path,
        action="append",
        help="exported drafter dir (z-lab or speculators), or a run's checkpoints/step-N; given several times, each "
        "drafter is evaluated against one reference of the target",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="run whose config.toml names the target and data (default: the run the first checkpoint is in)",
    )
    parser.add_argument("--config", type=Path, help="a run TOML instead of a run dir")
    parser.add_argument("--target", help="Hugging Face target dir (replaces the config's target)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    parser.add_argument("--temperature", type=float, help="eval.temperature: 0 greedy (the default), > 0 sampled")
    parser.add_argument("--top-p", type=float, help="eval.top_p of sampled decoding")
    parser.add_argument("--top-k", type=int, help="eval.top_k of sampled decoding")
    parser.add_argument("--seed", type=int, help="eval.seed of sampled decoding")
    parser.add_argument(
        "--by-length",
        action="store_true",
        help="also print tau and per-position acceptance per bucket of context length (eval.length_buckets) beside "
        "the break-even tau there, timed in this run",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. eval.num_prompts=32")
    return parser


def _config(args: argparse.Namespace, run_dir: Path | None) -> RunConfig:
    """The run's config (or --config's) with the command's overrides, its target on the device it is drawn on;
    ConfigError naming the key."""
    config_file = args.config or (run_dir / "config.toml" if run_dir else None)
    overrides = list(args.overrides)
    if args.target:
        overrides += [f"target.path={json.dumps(args.target)}", "target.config_overrides={}"]
    for key, value in (
        ("temperature", args.temperature),
        ("top_p", args.top_p),
        ("top_k", args.top_k),
        ("seed", args.seed),
    ):
        if value is not None:
            overrides.append(f"eval.{key}={value}")
    cfg = load_config(config_file, overrides)
    # Random target weights depend on the device type they are drawn on: by default the producers'
    # (a tensor-parallel producer's entry names several devices; its rank 0 draws them on the first).
    device = args.device if args.device != "auto" else next(iter(cfg.launch.producer_devices), "auto").split(",")[0]
    cfg.target = dataclasses.replace(cfg.target, device=device)
    return cfg


def _not_the_runs_target(run_dir: Path | None, cfg: RunConfig, head: TargetHead) -> str | None:
    """Why the target built here is not the one the run's producers built (None: it is, or nothing tells)."""
    produced = RunDir(run_dir).target_head if run_dir is not None and cfg.target.path is None else None
    if produced is None or not (produced / "config.json").is_file():
        return None
    shipped = load_target_head(produced, device=head.embed_weight.device)
    differs = [
        name
        for name in ("embed_weight", "lm_head_weight", "norm_weight")
        if not torch.equal(getattr(shipped, name), getattr(head, name))
    ]
    if not differs:  # the drafter shares all three: each must be the producers' bit for bit
        return None
    return (
        f"the target built here is not the run's (its {', '.join(differs)} differ from the head in "
        f"{produced}): try --device cpu or the producers' device"
    )


def _load_drafters(checkpoints: list[Path], head: TargetHead, cfg: RunConfig) -> list[Drafter]:
    """Every checkpoint's drafter, on the target's device, before any evaluation; ValueError naming the first one
    that cannot be read."""
    loss_config = LossConfig(label_mode=cfg.training.label_mode)
    drafters = []
    for checkpoint in checkpoints:
        drafter_dir, own_checkpoint = drafter_folder(checkpoint)
        try:
            drafters.append(
                load_drafter(
                    drafter_dir, head, loss_config, own_checkpoint=own_checkpoint, device=head.embed_weight.device
                )
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{checkpoint}: not a drafter this command can read ({exc})") from exc
    return drafters


def _result(checkpoint: Path, report: AcceptanceReport, by_length: bool, gap_tolerance: float) -> dict:
    """Print ``report``'s table (and its by-length table); its JSON result."""
    print(report.table())
    if by_length:
        print(report.by_length_table())
    within = report.gap_within(gap_tolerance)
    if not within:
        print(f"the gap exceeds eval.gap_tolerance: {gap_tolerance} of B - 1 = {report.block_size - 1}")
    result = {
        "checkpoint": str(checkpoint),
        **report.metrics(prefix=""),
        "gap_within_tolerance": within,
        "by_length": [bucket.as_dict() for bucket in report.by_length],
        "skipped": report.skipped_records,
    }
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run_dir = args.run_dir or (None if args.config else _run_dir_of(args.checkpoint[0]))
    try:
        cfg = _config(args, run_dir)
    except ConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    model = load_target_model(cfg.target)
    head = target_head_of(model)
    not_the_runs = _not_the_runs_target(run_dir, cfg, head)
    if not_the_runs:
        print(not_the_runs, file=sys.stderr)
        return EXIT_CONFIG_ERROR
    try:
        drafters = _load_drafters(args.checkpoint, head, cfg)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    held_out_file = RunDir(run_dir).held_out if run_dir is not None else None
    evaluators: dict[tuple[int, ...], AcceptanceEvaluator] = {}  # drafters of one set of target layers share one
    results = []
    for checkpoint, drafter in zip(args.checkpoint, drafters):
        layers = tuple(drafter.config.target_layer_ids)
        if layers not in evaluators:
            evaluators[layers] = build_evaluator(cfg, model, list(layers), held_out_file=held_out_file)
        if len(args.checkpoint) > 1:
            print(f"== {checkpoint}")
        report = evaluators[layers].evaluate(drafter)
        results.append(_result(checkpoint, report, args.by_length, cfg.eval.gap_tolerance))
    if args.json_out:
        written = results[0] if len(results) == 1 else results
        args.json_out.write_text(json.dumps(written, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

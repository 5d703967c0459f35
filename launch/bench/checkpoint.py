"""Benchmark: how long training stands still for a checkpoint, written synchronously or in the background,
and how long the write takes from eight threads (trainer/tensor_files.py) or from one.

    python -m launch.bench.checkpoint                      # a 1024-wide draft on the CPU
    python -m launch.bench.checkpoint --device cuda:0 --hidden 4096 --intermediate 12288 --layers 5 --vocab 151936
    torchrun --nproc-per-node 2 -m launch.bench.checkpoint --parallelism fsdp --modes synchronous  # sharded
    torchrun --nproc-per-node 2 -m launch.bench.checkpoint --parallelism fsdp --modes background

A real Trainer (the tiny config with a wider random target) takes an AdamW step, then saves. "stall" is
how long ``save_checkpoint`` keeps the training loop; "write" is until the checkpoint is on disk and
named by latest.json. Medians over --repeats saves per mode. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from common.config import load_config, save_config
from common.lifecycle import exit_process
from common.rundir import RunDir
from launch.bench.harness import emit
from producer.build import load_target
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[2]


def build_trainer(run: RunDir, args: argparse.Namespace, async_checkpoint: bool) -> Trainer:
    heads = max(1, args.hidden // 128)
    overrides = [
        'logging.wandb_mode="disabled"',
        f'training.device="{args.device}"',
        'target.dtype="bfloat16"',
        f"training.async_checkpoint={str(async_checkpoint).lower()}",
        f"drafter.num_layers={args.layers}",
        f'training.parallelism="{args.parallelism}"',
        f"target.config_overrides={{hidden_size={args.hidden}, intermediate_size={args.intermediate}, num_hidden_layers=8, "
        f"num_attention_heads={heads}, num_key_value_heads={max(1, heads // 4)}, head_dim=128, vocab_size={args.vocab}}}",
    ]
    cfg = load_config(ROOT / "launch" / "tiny.toml", overrides)
    run.checkpoints.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run.config)
    if int(os.environ.get("RANK", 0)) == 0:
        load_target(
            cfg, run, producer_id=0, device=None, group=None
        )  # exports the random target's head, as a producer does
    return Trainer(cfg, run)  # under torchrun the other ranks wait for that head


@contextlib.contextmanager
def run_directory(parent: str | None, async_checkpoint: bool) -> Iterator[Path]:
    """A fresh directory for one measurement, removed after. Under torchrun the ranks share it: it is
    named after their common parent, the torchrun agent, and rank 0 removes it once all are done."""
    if "RANK" not in os.environ:
        with tempfile.TemporaryDirectory(prefix="df-ckpt-", dir=parent) as tmp:
            yield Path(tmp)
        return
    path = Path(parent or tempfile.gettempdir()) / f"df-ckpt-{os.getppid()}-{int(async_checkpoint)}"
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if os.environ["RANK"] == "0":
            shutil.rmtree(path, ignore_errors=True)


MODES = ("synchronous", "background", "one-thread")
"""one-thread: in the background, the checkpoint's bytes written by one thread (the baseline of the several
threads of trainer/tensor_files.py)."""


def measure(args: argparse.Namespace, mode: str) -> dict:
    async_checkpoint = mode != "synchronous"
    with run_directory(args.dir, async_checkpoint) as tmp:
        trainer = build_trainer(RunDir(tmp / "run"), args, async_checkpoint)
        if mode == "one-thread":
            trainer.checkpoints.write_threads = 1
        params = [p for p in trainer.drafter.parameters() if p.requires_grad]
        stalls, writes = [], []
        try:
            for repeat in range(args.repeats + 1):  # the first save allocates the host buffers: not counted
                for p in params:
                    p.grad = torch.randn_like(p)
                trainer.optimizer.step()
                trainer.optimizer.zero_grad()
                trainer.step = repeat + 1
                started = time.perf_counter()
                trainer.save_checkpoint()
                stalled = time.perf_counter() - started
                trainer.checkpoints.wait()
                if repeat:
                    stalls.append(stalled)
                    writes.append(time.perf_counter() - started)
            size = sum(f.stat().st_size for f in trainer.run_dir.latest_checkpoint().rglob("*") if f.is_file())
        finally:
            trainer.close()
    return {
        "mode": mode,
        "stall_s": statistics.median(stalls),
        "write_s": statistics.median(writes),
        "checkpoint_bytes": size,
        "trainable_params": sum(p.numel() for p in params),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=2, help="draft layers")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="where the checkpoints are written (default: the system's temp dir)"
    )
    parser.add_argument(
        "--parallelism", choices=("ddp", "fsdp"), default="ddp", help="under torchrun with several ranks"
    )
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}; one per torchrun launch")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        parser.error(f"--modes: choose from {MODES}, got {args.modes!r}")
    if len(modes) > 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Each Trainer joins and leaves the process group; joining it again in the same process under
        # torchrun's rendezvous hangs, so a distributed run measures one mode per launch.
        parser.error(
            "--modes: under torchrun measure one mode per launch (--modes synchronous, then --modes background)"
        )
    rows = [measure(args, mode) for mode in modes]
    if os.environ.get("RANK", "0") != "0":
        return 0
    print(f"{'mode':<20}{'params':>14}{'checkpoint MB':>15}{'stall s':>10}{'write s':>10}{'GB/s':>7}")
    for r in rows:
        print(
            f"{r['mode']:<20}{r['trainable_params']:>14,}{r['checkpoint_bytes'] / 1e6:>15.1f}{r['stall_s']:>10.3f}"
            f"{r['write_s']:>10.3f}{r['checkpoint_bytes'] / 1e9 / r['write_s']:>7.2f}"
        )
    by_mode = {r["mode"]: r for r in rows}
    ratios = {}
    if {"synchronous", "background"} <= set(by_mode):
        ratios["stall_background_over_synchronous"] = (
            by_mode["background"]["stall_s"] / by_mode["synchronous"]["stall_s"]
        )
    if {"background", "one-thread"} <= set(by_mode):
        ratios["write_threads_over_one_thread"] = by_mode["background"]["write_s"] / by_mode["one-thread"]["write_s"]
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}")
    emit(
        {
            "bench": "checkpoint",
            "device": args.device,
            "parallelism": args.parallelism,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "rows": rows,
            **ratios,
        }
    )
    return 0


if __name__ == "__main__":
    exit_process(main())

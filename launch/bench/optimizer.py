"""Benchmark the trainer's optimizer step alone (trainer/optim.py): Muon for the drafter's matrices with AdamW for the
rest, or AdamW for all, on a drafter's parameters with random gradients. Prints the step's time and the operators it
issues (on CUDA each one a kernel launch or more), the products among them, and a JSON line.

    python -m launch.bench.optimizer                            # the SmolLM2 preset's drafter (8 layers), on CUDA
    python -m launch.bench.optimizer --tiny                     # the tiny drafter with 8 layers, on the CPU
    python -m launch.bench.optimizer --host-only                # the preset's drafter on the meta device

``--host-only`` steps on the meta device: every operator is dispatched as on a GPU but computes nothing, so the time
is the host's cost of issuing the step (on a GPU, what a small-shape step waits for when its host is slower than its
device; the device's launch cost and fused AdamW's single kernel are not in it: AdamW runs torch's multi-tensor path).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import Counter

import torch

from common.drafter.model import DFlashDrafter
from common.drafter.target_head import TargetHead
from launch.bench.harness import Table, add_json_argument, emit, gpu_name, synchronize
from launch.bench.step import DRAFTS, tiny_draft
from trainer.optim import OPTIMIZERS, RULE_KEY, build_optimizer

PRODUCTS = ("aten::mm", "aten::bmm", "aten::matmul", "aten::addmm", "aten::baddbmm")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.host_only:
        device = torch.device("meta")
    if device.type != "cuda":
        torch.set_num_threads(1)
    config = tiny_draft(16) if args.tiny else DRAFTS[args.draft](16)
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers, layer_types=[])
    rows = [time_optimizer(config, name, device, args) for name in args.optimizers.split(",")]
    print(
        f"device {gpu_name(device) or device.type}, draft {'tiny' if args.tiny else args.draft}, {config.num_hidden_layers} layers"
    )
    table = Table(
        [("optimizer", "<9"), ("matrices", ">9"), ("step ms", ">9.2f"), ("operators", ">10"), ("products", ">9")]
    )
    print(table.header())
    for r in rows:
        print(table.row(r["optimizer"], r["muon_matrices"], r["step_ms"], r["operators"], r["products"]))
    emit({"bench": "optimizer_step", "device": gpu_name(device) or device.type, "results": rows}, args.json)


def time_optimizer(config, name: str, device: torch.device, args: argparse.Namespace) -> dict:
    """One optimizer's step on the drafter of ``config`` (fp32 master weights, as the trainer's): the best mean of
    ``--repeats`` runs of ``--steps`` steps, and the operators of one step issued directly under it."""
    from torch.profiler import profile

    torch.manual_seed(0)
    head_device = torch.device("cpu") if device.type == "meta" else device  # the frozen head is no optimizer's
    head = TargetHead.random(config.vocab_size, config.hidden_size, torch.bfloat16, head_device)
    drafter = DFlashDrafter(config, head).to(device=device, dtype=torch.float32)
    optimizer = build_optimizer(drafter, name, 1e-4, 0.0, fused=device.type == "cuda")
    for p in drafter.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    for _ in range(args.warmup):
        optimizer.step()
    synchronize(device)
    with profile() as prof:
        optimizer.step()
        synchronize(device)
    step = next(e for e in prof.events() if e.name.startswith("Optimizer.step"))
    issued = Counter(e.name for e in prof.events() if e.cpu_parent is step)
    best = float("inf")
    for _ in range(args.repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            optimizer.step()
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / args.steps)
    matrices = sum(len(g["params"]) for g in optimizer.param_groups if g.get(RULE_KEY) == "muon")
    return {
        "optimizer": name,
        "muon_matrices": matrices,
        "step_ms": 1000 * best,
        "operators": sum(n for op, n in issued.items() if op.startswith("aten::")),
        "products": sum(issued[op] for op in PRODUCTS),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny drafter on the CPU")
    parser.add_argument("--draft", choices=sorted(DRAFTS), default="smollm2-135m", help="draft shape")
    parser.add_argument("--layers", type=int, default=None, help="drafter layers (the draft's own; --tiny: 8)")
    parser.add_argument("--optimizers", default="muon,adamw", help=f"comma list of {OPTIMIZERS}")
    parser.add_argument("--host-only", action="store_true", help="on the meta device: the host's cost of a step")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.tiny and args.layers is None:
        args.layers = 8
    return args


if __name__ == "__main__":
    main()

"""Benchmark one DFlash training step (forward, backward, fused AdamW or --optimizer muon) at the Qwen3-8B draft shapes, for each
drafter kind asked (--kinds dflash,dflash2: the table adds each kind's step time over the first kind's).

Features are random and already on the device; weights are random bf16. One "sample" is one packed
sequence of --seq-len tokens with --num-anchors blocks. MFU = model FLOPs (common.drafter.model.
train_flops, attention over the query-key pairs the step's masks let attend, frozen head weight gradient
excluded) / time / the bf16 matmul rate measured here (an 8192^3 matmul). Every kind is counted with DFlash's
FLOPs, so a kind's extra modules show as a longer step and a lower MFU, not as more work.

    python -m launch.bench.step                       # H200: eager layers vs compiled layers
    python -m launch.bench.step --variants compile-layers --steps 20
    python -m launch.bench.step --tiny                # CPU smoke run
    python -m launch.bench.step --kinds dflash,dflash2 --variants compile-layers --draft qwen3.6-27b
    torchrun --nproc-per-node 2 -m launch.bench.step --variants compile-layers --master-fp32 --parallelism ddp
    python -m launch.bench.step --kinds dflash,dflash2 --profile /tmp/prof   # + a torch.profiler table per row

``--profile DIR`` runs ``--profile-steps`` more steps of each row under torch.profiler before the timed ones and writes
DIR/profile_{draft}_{kind}_{variant}.txt: the operators and kernels by self time (device time on CUDA) and by calls,
and a summary per step: kernels launched, host-device synchronisations (cudaStreamSynchronize / cudaDeviceSynchronize /
cudaMemcpy to the host, and the aten calls that cause them: item, nonzero, boolean-mask indexing), the device's busy
time against the step's wall time (the rest are host gaps).

Under torchrun every rank trains its own batch on its GPU (DDP or FSDP, as trainer.train does) and
rank 0 prints the whole group's samples/s; divided by the single-GPU figure that is the scaling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.batch import PackedBatch
from common.config.training import TrainingConfig
from common.drafter.base import Drafter
from common.drafter.draft_config import DraftConfig
from common.drafter.kinds import KINDS, kind_of
from common.drafter.loss import LossConfig
from common.drafter.model import build_drafter, train_flops
from common.drafter.target_head import TargetHead
from common.lifecycle import exit_process
from launch.bench.harness import QWEN3_8B, Table, emit, gpu_name, matmul_tflops, synchronize
from trainer.optim import OPTIMIZERS, build_optimizer
from trainer.profile import start_profiler, stop_and_write
from trainer.sharding import full_tensor, parallelize

VARIANTS = ("eager", "compile-layers", "compile-layers-graphs", "compile-model")
"""compile-layers-graphs: each compiled layer's forward and backward replayed as CUDA graphs (torch.compile's
reduce-overhead mode, static shapes): the launches of a small-shape step without the host issuing each kernel."""


def qwen3_8b_draft(block_size: int) -> DraftConfig:
    """The Qwen3-8B draft (five layers), as DraftConfig derives it from the target."""
    from transformers import AutoConfig

    return DraftConfig.from_target(
        AutoConfig.for_model(**QWEN3_8B), num_draft_layers=5, mask_token_id=151669, block_size=block_size
    )


def qwen36_27b_draft(block_size: int) -> DraftConfig:
    """The released Qwen3.6-27B draft's shape (248,320-wide head), as DraftConfig derives it from the target."""
    from transformers import Qwen3_5TextConfig

    from launch.bench.target import QWEN36_27B_SHAPE

    fields = {k: v for k, v in QWEN36_27B_SHAPE.items() if k != "model_type"}
    return DraftConfig.from_target(Qwen3_5TextConfig(**fields), mask_token_id=248070, block_size=block_size)


def smollm2_draft(block_size: int) -> DraftConfig:
    """The SmolLM2-135M preset's draft (8 layers over the 30-layer target, launch/smollm2-135m.toml)."""
    from transformers import LlamaConfig

    target = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    return DraftConfig.from_target(target, num_draft_layers=8, mask_token_id=16, block_size=block_size)


DRAFTS = {"qwen3-8b": qwen3_8b_draft, "qwen3.6-27b": qwen36_27b_draft, "smollm2-135m": smollm2_draft}
STEP_SHAPES = {"smollm2-135m": (65536, 2048, 160)}
"""(tokens, anchors, documents) of a draft's step where its preset trains another one than the default 3,072 tokens,
512 anchors and 4 documents: launch/smollm2-135m.toml's token_budget and num_anchors, ~160 documents of its data."""


def tiny_draft(block_size: int) -> DraftConfig:
    return DraftConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        target_hidden_size=128,
        num_target_layers=8,
        target_layer_ids=[1, 5],
        mask_token_id=999,
        block_size=block_size,
    )


def random_batch(config: DraftConfig, seq_len: int, num_docs: int, device: torch.device) -> PackedBatch:
    gen = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(seq_len - 1, generator=gen)[: num_docs - 1] + 1).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq_len])]).to(torch.int32)
    loss_mask = torch.ones(seq_len, dtype=torch.uint8)
    loss_mask[cu[:-1].long()] = 0  # a token of "prompt" per document
    batch = PackedBatch(
        input_ids=torch.randint(0, config.vocab_size, (seq_len,), generator=gen, dtype=torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=cu,
        sample_ids=torch.arange(num_docs),
        aux_hidden=torch.randn(seq_len, config.fused_feature_size, generator=gen).to(torch.bfloat16),
        # the target's final hidden state, which the producers ship for a kind whose objective reads it
        last_hidden=torch.randn(seq_len, config.hidden_size, generator=gen).to(torch.bfloat16)
        if kind_of(config.kind).needs_final_hidden
        else None,
    )
    return batch.to(device)


def drafter_of_variant(
    config: DraftConfig,
    variant: str,
    device: torch.device,
    chunk_rows: int,
    master_fp32: bool = False,
    parallelism: str = "single",
    weighting: str = TrainingConfig.weighting,
) -> Drafter:
    """The drafter on ``device`` (on the host under FSDP, which moves each rank's shards itself), its
    layers or whole forward compiled as ``variant`` says."""
    head = TargetHead.random(config.vocab_size, config.hidden_size, torch.bfloat16, device)
    param_dtype = torch.float32 if master_fp32 else torch.bfloat16
    # The trainer's loss (trainer.build.loss_config_of): its slot weighting, LossConfig's chunk of head rows.
    loss_config = LossConfig(chunk_rows=chunk_rows, weighting=weighting)
    drafter = build_drafter(config, head, loss_config).to(dtype=param_dtype)
    if parallelism != "fsdp":
        drafter.to(device)  # FSDP moves each rank's shards to the device itself
    if variant in ("compile-layers", "compile-layers-graphs"):
        mode = "reduce-overhead" if variant == "compile-layers-graphs" else None
        for layer in drafter.layers:
            layer.compile(dynamic=False, mode=mode)
    elif variant == "compile-model":
        drafter.compile(dynamic=False)  # compiles forward(): fc, embedding, rope and the layers together
    return drafter


def bench_variant(
    config: DraftConfig, variant: str, args: argparse.Namespace, device: torch.device, peak_tflops: float
) -> dict:
    torch.manual_seed(0)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    drafter = drafter_of_variant(
        config, variant, device, args.chunk_rows, args.master_fp32, args.parallelism, args.weighting
    )
    model = parallelize(drafter, device, ranks, sharded=args.parallelism == "fsdp")  # as trainer.train does
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.master_fp32)
    optimizer = build_optimizer(drafter, args.optimizer, 1e-4, 0.0, fused=device.type == "cuda")
    batch = random_batch(config, args.seq_len, args.num_docs, device)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank() if ranks > 1 else 0)
    prepared = drafter.prepare(batch, args.num_anchors, generator)

    graphs = variant == "compile-layers-graphs"

    def step(prepared):
        if graphs:  # a new step: the graphs' last outputs are dead, so replays take the fast path, not re-checks
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            loss, metrics = model(batch, args.num_anchors, generator, 0.0, prepared)
        loss.backward()
        # Next step's anchors and masks are queued while the GPU still runs this backward.
        next_prepared = drafter.prepare(batch, args.num_anchors, generator)
        full_tensor(torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0))  # as the trainer does
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return next_prepared, metrics

    for _ in range(args.warmup):
        prepared, metrics = step(prepared)
    synchronize(device)
    if args.profile and (not dist.is_initialized() or dist.get_rank() == 0):
        name = f"{'tiny' if args.tiny else args.draft}_{config.kind}_{variant}"
        prepared = profile_steps(step, prepared, device, args.profile_steps, args.profile, name)
    step_s, pairs, metrics = timed_steps(step, prepared, args.steps, device, ranks)
    flops = float(train_flops(config, args.seq_len, args.num_anchors, pairs)["total"])
    return {
        "kind": config.kind,
        "variant": variant if args.parallelism == "single" else f"{variant} {args.parallelism}x{ranks}",
        "ranks": ranks,
        "step_ms": step_s * 1e3,
        "samples_per_s": ranks / step_s,
        "tokens_per_s": ranks * args.seq_len / step_s,
        "tflop_per_sample": flops / 1e12,
        "achieved_tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / 1e12 / peak_tflops,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
        "loss": float(metrics["loss"]),
        "trainable_params": drafter.num_trainable_parameters(),
    }


def timed_steps(step, prepared, steps: int, device: torch.device, ranks: int) -> tuple[float, float, dict]:
    """``steps`` steps from ``prepared``, timed: seconds a step, attention pairs a step and the last step's metrics
    (the peak memory counted from the first of them; under torchrun, as fast as the slowest rank)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if ranks > 1:
        dist.barrier()
    start = time.perf_counter()
    pairs = 0.0
    for _ in range(steps):
        prepared, metrics = step(prepared)
        pairs = pairs + metrics["attention_pairs"]
    synchronize(device)
    if ranks > 1:
        dist.barrier()
    return (time.perf_counter() - start) / steps, float(pairs) / steps, metrics


def profile_steps(step, prepared, device: torch.device, steps: int, out_dir: str, name: str):
    """``steps`` more training steps under torch.profiler; writes out_dir/profile_{name}.txt (trainer/profile.py: a
    per-step summary, then the operators and kernels by self time and by calls), prints the summary and returns the
    prepared blocks of the next step."""
    profiler = start_profiler(device)
    start = time.perf_counter()
    for _ in range(steps):
        prepared, _ = step(prepared)
    synchronize(device)
    wall = time.perf_counter() - start
    print(json.dumps(stop_and_write(profiler, device, steps, wall, Path(out_dir) / f"profile_{name}.txt", name)))
    return prepared


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    device = setup_device(args)
    config = tiny_draft(args.block_size) if args.tiny else DRAFTS[args.draft](args.block_size)
    shape = (256, 32, 4) if args.tiny else STEP_SHAPES.get(args.draft, (3072, 512, 4))
    args.seq_len = args.seq_len or shape[0]
    args.num_anchors = args.num_anchors or shape[1]
    args.num_docs = args.num_docs or shape[2]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; choose from {sorted(KINDS)}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_tflops(device, args.matmul_size or (1024 if device.type == "cpu" else 8192))

    results = [
        bench_variant(dataclasses.replace(config, kind=kind, options=None), v, args, device, peak)
        for kind in kinds
        for v in variants
    ]
    baseline = {r["variant"]: r["step_ms"] for r in results if r["kind"] == kinds[0]}
    for r in results:
        r["step_vs_first_kind"] = r["step_ms"] / baseline[r["variant"]]
    if dist.is_initialized():
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return
    print_table(results, args, device, peak)
    emit(
        {
            "bench": "dflash_train_step",
            "matmul_tflops": peak,
            "seq_len": args.seq_len,
            "num_anchors": args.num_anchors,
            "block_size": args.block_size,
            "num_docs": args.num_docs,
            "chunk_rows": args.chunk_rows,
            "weighting": args.weighting,
            "master_fp32": args.master_fp32,
            "optimizer": args.optimizer,
            "draft": "tiny" if args.tiny else args.draft,
            "results": results,
        }
    )


def setup_device(args: argparse.Namespace) -> torch.device:
    """This rank's device; under torchrun the process group is made (else ``--parallelism`` becomes "single")."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        local_rank = int(os.environ["LOCAL_RANK"])
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    else:
        args.parallelism = "single"
    return device


def print_table(results: list[dict], args: argparse.Namespace, device: torch.device, peak: float) -> None:
    print(
        f"device {gpu_name(device) or 'cpu'}, "
        f"measured bf16 matmul {peak:.1f} TFLOP/s, seq {args.seq_len}, anchors {args.num_anchors}, "
        f"B {args.block_size}, docs {args.num_docs}, chunk {args.chunk_rows} rows, {args.weighting} weighting, "
        f"{args.optimizer}"
    )
    table = Table(
        [
            ("kind", "<9"),
            ("variant", "<22"),
            ("step ms", ">10.1f"),
            ("x first", ">9.3f"),
            ("samples/s", ">11.2f"),
            ("tokens/s", ">11.0f"),
            ("TFLOP/s", ">9.1f"),
            ("MFU", ">7.1%"),
            ("peak GiB", ">10.1f"),
            ("params M", ">10.1f"),
        ],
        gap="",
    )
    print(table.header())
    print("-" * len(table.header()))
    for r in results:
        cells = (r["step_ms"], r["step_vs_first_kind"], r["samples_per_s"], r["tokens_per_s"], r["achieved_tflops"])
        print(table.row(r["kind"], r["variant"], *cells, r["mfu"], r["peak_mem_gib"], r["trainable_params"] / 1e6))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--draft", choices=sorted(DRAFTS), default="qwen3-8b", help="draft shape")
    parser.add_argument("--variants", default="eager,compile-layers", help=f"comma list of {VARIANTS}")
    parser.add_argument("--kinds", default="dflash", help=f"comma list of drafter kinds {sorted(KINDS)}")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--seq-len", type=int, default=None, help="tokens per packed sequence (3072; smollm2-135m 65536; tiny 256)"
    )
    parser.add_argument(
        "--num-anchors", type=int, default=None, help="blocks per sequence (512; smollm2-135m 2048; tiny 32)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-docs", type=int, default=None, help="documents packed in the sequence (4; smollm2-135m 160)"
    )
    parser.add_argument(
        "--chunk-rows", type=int, default=LossConfig.chunk_rows, help="head/loss rows per chunk (the trainer's)"
    )
    parser.add_argument(
        "--weighting",
        default=TrainingConfig.weighting,
        choices=["decay", "streak", "dpace"],
        help="slot weighting of the loss (training.weighting's default)",
    )
    parser.add_argument(
        "--master-fp32",
        action="store_true",
        help="fp32 parameters and optimizer under bf16 autocast (what trainer.train does)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="the step's optimizer: torch's fused AdamW, or Muon for the matrices (what the presets' trainer runs)",
    )
    parser.add_argument("--profile", default=None, metavar="DIR", help="write a torch.profiler table per row to DIR")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps profiled per row (--profile)")
    parser.add_argument("--matmul-size", type=int, default=None, help="size of the reference matmul (8192)")
    parser.add_argument(
        "--parallelism",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="under torchrun: how the ranks share the drafter (as training.parallelism)",
    )
    return parser


if __name__ == "__main__":
    main()
    exit_process(0)

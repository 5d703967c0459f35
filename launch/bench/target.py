"""Throughput of the target side: plain HF forwards against the packed capture path.

On an H200 (default): a Qwen3-8B-shaped target with random bf16 weights, capturing layers
[1, 9, 17, 25, 33]. Reports tokens/s and MFU (against this GPU's own measured bf16 matmul rate) for

- ``hf``:       plain HF forward (logits and output_hidden_states included) on padded uniform 16 x 1024
                batches (``--rows``, ``--length``): the baseline;
- ``hf-cut``:   the same through the base model cut after the deepest captured layer (no lm_head);
- ``packed-*``: ``Target.capture`` on a chat length mix packed into token-budget batches, writing into a
                preallocated ring-slot-like buffer, per attention kernel and compile setting.

FLOPs (``producer.target_model.flops_per_document``): 2 * matmul params used * tokens + causal attention per
document (2 * L(L+1) * heads * head_dim per layer); norms, rotary and embedding lookups are not counted.

    python -m launch.bench.target                               # H200: ~3 minutes
    python -m launch.bench.target --attn varlen,flex,sdpa --compile both
    python -m launch.bench.target --shape qwen3.6-27b           # the hybrid Gated-DeltaNet family
    python -m launch.bench.target --tiny                        # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

from common.batch import PackedBatch
from common.codec import DTYPES
from common.config import TargetConfig
from common.drafter.draft_config import build_target_layer_ids
from launch.bench.harness import (
    TARGET_SHAPES,
    Table,
    add_json_argument,
    emit,
    gpu_name,
    matmul_tflops,
    synchronize,
    timed,
)
from producer.target_model.capture import Target
from producer.target_model.flops import flops_per_document
from producer.target_model.load import TINY_TARGET_CONFIG, load_target_model, resolve_device


def chat_lengths(count: int, seed: int, mean: float, low: int, high: int, sigma: float = 1.0) -> list[int]:
    """Seeded lognormal document lengths clipped to [low, high], the median tuned so the mean is ``mean``."""
    normal = torch.randn(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def clipped(mu: float) -> torch.Tensor:
        return torch.exp(mu + sigma * normal).clamp(low, high).round()

    lo_mu, hi_mu = math.log(low), math.log(high)
    for _ in range(60):  # bisection: the clipped mean grows with mu
        mid = (lo_mu + hi_mu) / 2
        lo_mu, hi_mu = (mid, hi_mu) if clipped(mid).mean() < mean else (lo_mu, mid)
    return [int(x) for x in clipped(lo_mu).tolist()]


def pack_token_budget(lengths: list[int], budget: int, vocab: int, seed: int) -> list[PackedBatch]:
    """Greedy in-order packing into batches of at most ``budget`` tokens, host tensors in pinned memory."""
    generator = torch.Generator().manual_seed(seed)
    groups: list[list[int]] = [[]]
    for length in lengths:
        if sum(groups[-1]) + length > budget:
            groups.append([])
        groups[-1].append(length)
    pin = torch.cuda.is_available()
    batches = []
    for index, group in enumerate(groups):
        total = sum(group)
        cu = torch.zeros(len(group) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(group).cumsum(0)
        ids = torch.randint(0, vocab, (total,), generator=generator, dtype=torch.int32)
        batches.append(
            PackedBatch(
                input_ids=ids.pin_memory() if pin else ids,
                loss_mask=torch.ones(total, dtype=torch.uint8),
                cu_seqlens=cu.pin_memory() if pin else cu,
                sample_ids=torch.arange(index * 10_000, index * 10_000 + len(group)),
            )
        )
    return batches


def peak_gib(device: torch.device) -> float:
    """GPU memory allocated at most since the last ``reset_peak`` (0 on the CPU)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def reset_peak(device: torch.device) -> None:
    """Start ``peak_gib``'s count afresh (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def bench_hf(model: nn.Module, cut_after: int | None, rows: int, length: int, count: int, warmup: int) -> dict:
    """Plain HF forward on uniform [rows, length] batches; ``cut_after``: base model with fewer layers."""
    config, device = model.config, next(model.parameters()).device
    base = model.get_decoder()
    ids = torch.randint(0, config.vocab_size, (rows, length), device=device)
    all_layers, saved_attention = base.layers, config._attn_implementation
    config._attn_implementation = "sdpa"  # exactly the stock SDPA path
    if cut_after is not None:
        base.layers = nn.ModuleList(list(all_layers)[: cut_after + 1])
    forward = model if cut_after is None else base
    reset_peak(device)
    try:
        with torch.inference_mode():
            seconds, warm = timed(
                lambda _: forward(input_ids=ids, use_cache=False, output_hidden_states=True), count, warmup, device
            )
    finally:
        base.layers, config._attn_implementation = all_layers, saved_attention
    layers = config.num_hidden_layers if cut_after is None else cut_after + 1
    flops = rows * flops_per_document(config, layers, length, with_lm_head=cut_after is None) * count
    return {
        "seconds": seconds,
        "warmup_s": warm,
        "tokens": rows * length * count,
        "flops": flops,
        "peak_gib": peak_gib(device),
    }


def bench_packed(target: Target, batches: list[PackedBatch], budget: int, count: int, warmup: int) -> dict:
    """``Target.capture`` over the packed batches (cycled), into a preallocated ring-slot-like buffer."""
    aux_slot = torch.empty(budget, target.aux_width, dtype=target.dtype, device=target.device)
    last_slot = torch.empty(budget, target.hidden_size, dtype=target.dtype, device=target.device)

    def step(index: int) -> None:
        batch = batches[index % len(batches)]
        total = batch.num_tokens
        last = last_slot[:total] if target.capture_last_hidden else None
        target.capture(batch, out_aux=aux_slot[:total], out_last=last)

    reset_peak(target.device)
    seconds, warm = timed(step, count, warmup, target.device)
    used = [batches[i % len(batches)] for i in range(count)]
    config = target.model.config
    flops = sum(
        flops_per_document(config, target.num_layers_run, int(length))
        for batch in used
        for length in (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    )
    return {
        "seconds": seconds,
        "warmup_s": warm,
        "tokens": sum(b.num_tokens for b in used),
        "flops": flops,
        "peak_gib": peak_gib(target.device),
    }


def relative_errors(got: torch.Tensor, want: torch.Tensor, hidden_size: int) -> list[float]:
    """Per captured layer: max |got - want| / max |want| (bf16 rounding differences grow with depth)."""
    errors = []
    for start in range(0, want.shape[1], hidden_size):
        a, b = got[:, start : start + hidden_size].float(), want[:, start : start + hidden_size].float()
        errors.append(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    return errors


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    cfg, sizes = target_and_sizes(args)
    budget, rows, length, mean, low, high, draft_layers, count = sizes
    device = resolve_device(cfg)
    attentions = (args.attn or ("varlen,flex" if device.type == "cuda" else "sdpa")).split(",")
    compile_mode = args.compile or ("on" if device.type == "cuda" else "off")
    compile_settings = {"on": [True], "off": [False], "both": [False, True]}[compile_mode]

    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_tflops(device, 8192 if device.type == "cuda" else 1024, DTYPES[cfg.dtype]) * 1e12
    start = time.perf_counter()
    model = load_target_model(cfg)
    synchronize(device)
    load_s = time.perf_counter() - start
    num_layers = model.config.num_hidden_layers
    layer_ids = build_target_layer_ids(num_layers, draft_layers)

    lengths = chat_lengths(count * budget // mean * 2, args.seed, mean, low, high)
    batches = pack_token_budget(lengths, budget, model.config.vocab_size, args.seed)[:count]
    fill = sum(b.num_tokens for b in batches) / (len(batches) * budget)
    print(
        f"device {device} | matmul {peak / 1e12:.0f} TFLOP/s | load {load_s:.1f}s | layers {layer_ids} | "
        f"{len(batches)} batches of <= {budget} tokens, fill {fill:.1%}, "
        f"{sum(len(b.sample_ids) for b in batches) / len(batches):.1f} docs/batch, mean length "
        f"{sum(lengths) / len(lengths):.0f}",
        flush=True,
    )

    results: dict[str, dict] = {}
    if not args.no_baselines:
        results["hf"] = bench_hf(model, None, rows, length, count, args.warmup)
        results["hf-cut"] = bench_hf(model, layer_ids[-1], rows, length, count, args.warmup)
    results.update(bench_variants(model, layer_ids, batches, args, attentions, compile_settings, budget, count))
    print_results(results, peak)
    emit(
        {
            "bench": "target",
            "device": gpu_name(device) or "cpu",
            "matmul_tflops": peak / 1e12,
            "layer_ids": layer_ids,
            "budget": budget,
            "fill": fill,
            "results": results,
        },
        args.json_out,
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen3 on CPU (proves the program runs)")
    parser.add_argument(
        "--shape", choices=sorted(TARGET_SHAPES), default="qwen3-8b", help="target shape (random weights)"
    )
    parser.add_argument("--rows", type=int, default=None, help="baseline rows per padded batch (16)")
    parser.add_argument("--length", type=int, default=None, help="baseline tokens per row (1024)")
    parser.add_argument(
        "--attn", default=None, help="packed kernels, comma list of varlen,flex,sdpa (default: varlen,flex on CUDA)"
    )
    parser.add_argument(
        "--compile", choices=("on", "off", "both"), default=None, help="torch.compile the layers (default: on for CUDA)"
    )
    parser.add_argument("--no-baselines", action="store_true", help="skip the plain HF forwards")
    parser.add_argument(
        "--last-hidden", action="store_true", help="also capture the last hidden state (runs every layer)"
    )
    parser.add_argument("--budget", type=int, default=None, help="tokens per packed batch (default 16384)")
    parser.add_argument("--batches", type=int, default=None, help="timed batches per variant (default 16)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches per variant (compilation happens here)")
    parser.add_argument("--seed", type=int, default=0)
    add_json_argument(parser, "--json-out")
    return parser.parse_args(argv)


def target_and_sizes(args: argparse.Namespace) -> tuple[TargetConfig, tuple[int, ...]]:
    """The target's config, and the sizes: tokens per packed batch, the baseline's rows and row length, the
    documents' mean, shortest and longest length, the draft's layers, and the timed batches."""
    if args.tiny:
        cfg = TargetConfig(config_overrides=dict(TINY_TARGET_CONFIG), device="cpu", dtype="float32", seed=args.seed)
        return cfg, (args.budget or 1024, 4, 256, 120, 8, 384, 2, args.batches or 4)
    cfg = TargetConfig(config_overrides=dict(TARGET_SHAPES[args.shape]), dtype="bfloat16", seed=args.seed)
    return cfg, (args.budget or 16384, args.rows or 16, args.length or 1024, 1000, 32, 3072, 5, args.batches or 16)


def bench_variants(
    model, layer_ids: list[int], batches: list, args: argparse.Namespace, attentions, compile_settings, budget, count
) -> dict[str, dict]:
    """Each packed variant (attention kernel, compiled or not), with its features' error against sdpa's; one broken
    variant is a row with its error, not the end of the bench."""
    results: dict[str, dict] = {}
    reference = None
    for compiled in compile_settings:
        for attention in attentions:
            if attention == "sdpa" and compiled:
                continue  # the per-document loop is never compiled
            name = f"packed-{attention}" + ("+compile" if compiled else "")
            try:
                target = Target(
                    model, layer_ids, capture_last_hidden=args.last_hidden, attention=attention, compile=compiled
                )
                results[name] = bench_packed(target, batches, budget, count, args.warmup)
                features = target.capture(batches[0])
                if reference is None:
                    reference = Target(
                        model, layer_ids, capture_last_hidden=False, attention="sdpa", compile=False
                    ).capture(batches[0])
                results[name]["rel_err_vs_sdpa"] = relative_errors(
                    features.aux_hidden, reference.aux_hidden, target.hidden_size
                )
            except Exception as error:  # one broken variant must not hide the others' numbers
                results[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            print(f"  done {name}", flush=True)
    return results


def print_results(results: dict[str, dict], peak: float) -> None:
    """The table; each result gets its rates (tokens/s, TFLOP/s, MFU against ``peak`` FLOP/s)."""
    table = Table(
        [
            ("variant", "<24"),
            ("tokens/s", ">12,.0f"),
            ("MFU", ">8.1%"),
            ("TFLOP/s", ">10.1f"),
            ("warmup s", ">10.1f"),
            ("peak GiB", ">10.1f"),
        ],
        gap="",
    )
    print(f"\n{table.header()}  rel err per layer vs sdpa")
    for name, result in results.items():
        if "error" in result:
            print(f"{name:<24}  ERROR {result['error']}")
            continue
        result["tokens_per_s"] = result["tokens"] / result["seconds"]
        result["tflops"] = result["flops"] / result["seconds"] / 1e12
        result["mfu"] = result["flops"] / result["seconds"] / peak
        errors = " ".join(f"{e:.0e}" for e in result.get("rel_err_vs_sdpa", []))
        cells = (result["tokens_per_s"], result["mfu"], result["tflops"], result["warmup_s"], result["peak_gib"])
        print(f"{table.row(name, *cells)}  {errors}")


if __name__ == "__main__":
    main()

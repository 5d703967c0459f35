"""Benchmark producer 0's acceptance evaluation (producer/acceptance/evaluator.py) at the Qwen3-8B shapes, alone.

Random weights: a Qwen3-8B-shaped target and the 8B draft (5 layers, block 16); random held-out documents
whose prompt is their first ``--prompt-len`` tokens. The first evaluation makes the target's reference (the
prompts' greedy continuations and features, the documents' features); the later ones run the drafter only.
Prints each evaluation's time split into making the reference, the replayed decoding (``--prompts`` prompts
together, ``--new-tokens`` each, per round) and the simulated acceptance, then with ``--profile`` the
operators of a later evaluation that took the most time, host and device. With ``--sampled``, the live sampled
decoding (temperature 1, top-p 0.95) of the prompts one at a time against all of them together, in one run.

    python -m launch.bench.acceptance                  # H200
    python -m launch.bench.acceptance --tiny           # CPU smoke run
    python -m launch.bench.acceptance --sampled        # sampled decoding, one prompt at a time against together
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from common.batch import Document
from common.config import EvalConfig, TargetConfig
from common.drafter.model import DFlashDrafter
from launch.bench.harness import QWEN3_8B, TINY_QWEN3, add_json_argument, emit, synchronize
from launch.bench.step import qwen3_8b_draft, tiny_draft
from producer.acceptance.evaluator import AcceptanceEvaluator
from producer.target_model.load import load_target_model, target_head_of


def documents(count: int, length: int, prompt_len: int, vocab: int, seed: int) -> list[Document]:
    rng = np.random.default_rng(seed)
    mask = np.ones(length, np.uint8)
    mask[:prompt_len] = 0
    return [Document(i, rng.integers(0, vocab, length).astype(np.int32), mask.copy()) for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as evaluate runs on a CPU
    shape = TINY_QWEN3 if args.tiny else QWEN3_8B
    model = load_target_model(
        TargetConfig(
            config_overrides=dict(shape), dtype="float32" if args.tiny else "bfloat16", device=str(device), seed=0
        )
    )
    config = tiny_draft(16) if args.tiny else qwen3_8b_draft(16)
    torch.manual_seed(0)  # the same random drafter every run, so that runs draft alike
    drafter = DFlashDrafter(config, target_head_of(model)).to(device)
    if not args.tiny:
        drafter.to(torch.bfloat16)
    docs = documents(args.prompts, args.doc_len, args.prompt_len, config.vocab_size, seed=0)
    sampling = dict(temperature=1.0, top_p=0.95) if args.sampled else {}
    eval_config = EvalConfig(
        num_prompts=args.prompts,
        max_new_tokens=args.new_tokens,
        batch_prompts=args.prompts,
        prompt_len=args.prompt_len,
        **sampling,
    )
    evaluator = AcceptanceEvaluator(model, docs, eval_config, list(config.target_layer_ids), num_anchors=64)
    if args.sampled:
        emit(time_sampled(evaluator, drafter, device), args.json)
        return
    # the first makes the target's reference
    rows = [time_evaluation(evaluator, drafter, device, repeat) for repeat in range(args.repeats + 1)]
    if args.profile:
        rows.append(profile_evaluation(evaluator, drafter, device))
    emit(rows, args.json)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument(
        "--doc-len", type=int, default=1024, help="tokens of each held-out document (simulated acceptance)"
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--sampled", action="store_true", help="sampled decoding: one prompt at a time against together"
    )
    add_json_argument(parser)
    return parser.parse_args(argv)


def time_evaluation(evaluator: AcceptanceEvaluator, drafter: DFlashDrafter, device: torch.device, repeat: int) -> dict:
    """One evaluation's seconds, split into the reference, the decoding (timed again alone, as evaluate runs it) and
    the rest; printed, and its row."""
    synchronize(device)
    started = time.perf_counter()
    report = evaluator.evaluate(drafter)
    synchronize(device)
    total = time.perf_counter() - started
    # The decoding alone, as evaluate runs it (in eval mode, in the evaluation's context).
    drafter.eval()
    with evaluator.evaluation_context():
        started = time.perf_counter()
        decoded = evaluator.decode(drafter, evaluator.reference)
        synchronize(device)
        decode = time.perf_counter() - started
    rounds = max(len(d.accepted) for d in decoded)  # drafter forwards of the batch
    simulated = total - decode - report.reference_seconds
    row = {
        "repeat": repeat,
        "seconds": total,
        "reference_s": report.reference_seconds,
        "decode_s": decode,
        "simulated_s": simulated,
        "rounds": rounds,
        "tau": report.tau,
        "ms_per_round": 1000 * decode / rounds,
    }
    print(
        f"{'first' if repeat == 0 else 'run ' + str(repeat):8s} evaluation {total:6.2f} s = reference "
        f"{report.reference_seconds:6.2f} s + decode {decode:5.2f} s + simulated and the rest {simulated:5.2f} s; "
        f"{rounds} rounds of {len(decoded)} prompts (tau {report.tau:.2f}), {row['ms_per_round']:.1f} ms per round"
    )
    return row


def time_sampled(evaluator: AcceptanceEvaluator, drafter: DFlashDrafter, device: torch.device) -> list[dict]:
    """The sampled decoding of every prompt (``decode_sampled``, in the evaluation's context), one prompt at a time and
    then all together: a row each, with its seconds, its speed-up over one at a time, and how many prompts decoded
    the same text both ways (all on a CPU in float32; in bf16 a larger product may round a draw the other way)."""
    drafter.eval()
    rows, texts = [], {}
    for size in (1, evaluator.config.batch_prompts):
        evaluator.config = dataclasses.replace(evaluator.config, batch_prompts=size)
        with evaluator.evaluation_context():
            synchronize(device)
            started = time.perf_counter()
            decoded = evaluator.decode_sampled(drafter)
            synchronize(device)
            seconds = time.perf_counter() - started
        texts[size] = [d.tokens for d in decoded]
        blocks = sum(len(d.accepted) for d in decoded)
        rows.append(
            {"prompts_together": size, "seconds": seconds, "blocks": blocks, "ms_per_block": 1000 * seconds / blocks}
        )
    rows[1]["speedup"] = rows[0]["seconds"] / rows[1]["seconds"]
    rows[1]["same_texts"] = sum(a == b for a, b in zip(texts[1], texts[rows[1]["prompts_together"]]))
    print(f"{'prompts together':>16} {'seconds':>8} {'blocks':>7} {'ms/block':>9}")
    for row in rows:
        print(f"{row['prompts_together']:>16} {row['seconds']:8.2f} {row['blocks']:7d} {row['ms_per_block']:9.2f}")
    print(
        f"together {rows[1]['speedup']:.2f}x faster than one at a time; {rows[1]['same_texts']} of "
        f"{len(texts[1])} prompts decoded the same text"
    )
    return rows


def profile_evaluation(evaluator: AcceptanceEvaluator, drafter: DFlashDrafter, device: torch.device) -> dict:
    """The operators of one more evaluation that took the most time, host and device (printed); its device seconds
    and kernels launched."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        evaluator.evaluate(drafter)
        synchronize(device)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=18, max_name_column_width=50))
    events = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in events) / 1e6 if device.type == "cuda" else 0.0
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA") if device.type == "cuda" else 0
    print(f"device busy {cuda_total:.2f} s of one evaluation; {kernels} kernels launched")
    return {"profile_device_s": cuda_total, "kernels": kernels}


if __name__ == "__main__":
    main()

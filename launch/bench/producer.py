"""Benchmark: the producer process end to end (data, packing, capture, ring writes, announcements).

    python -m launch.bench.producer                # Qwen3-8B-shaped target on cuda:0, CUDA ring
    python -m launch.bench.producer --ring host    # page-locked host ring (copies on a side stream)
    python -m launch.bench.producer --tiny         # the tiny CPU default (smoke run)
    python -m launch.bench.producer --kind dspark  # a kind whose objective reads the target's distribution: the
                                                   # producer captures and ships the final hidden state too

A real ``producer.server`` process fills its ring; a consumer in this process takes every batch,
acks it at once (no training) and counts tokens. After a warm-up the rate over ``--seconds`` is
the producer's throughput with everything included; the consumer never holds it back, so it is
what the target GPU delivers. MFU uses the same FLOP count as ``launch.bench.target``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.config import load_config, save_config
from common.rundir import RunDir
from common.status import ProducerStatus
from common.transport import RingClient
from launch.bench.harness import QWEN3_8B, ROOT, emit, qwen3_8b_target


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    run = RunDir(Path(tempfile.mkdtemp(prefix="df-prod-", dir="/tmp")) / "run")
    run.root.mkdir(parents=True)
    cfg = load_config(ROOT / "launch" / "tiny.toml", run_overrides(args, run))
    save_config(cfg, run.config)
    producer = subprocess.Popen(
        [sys.executable, "-m", "producer.server", "--run-dir", str(run.root), "--producer-id", "0"]
        + ["--device", "cpu" if args.tiny else "cuda:0"],
        cwd=ROOT,
        stdout=open(run.root / "producer.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        status, ready_s = wait_ready(producer, run)
        tokens, docs, batches, lengths, stats = consume(status.endpoint, args.warmup, args.seconds)
    finally:
        producer.terminate()
        producer.wait(timeout=60)
    tokens_per_s = tokens / args.seconds
    ring = status.ring["backend"]
    result = {
        "bench": "producer",
        "tiny": args.tiny,
        "kind": args.kind,
        "ships_final_hidden": cfg.ships_final_hidden,
        "ring": ring,
        "budget": cfg.batching.token_budget,
        "ready_s": ready_s,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": docs / args.seconds,
        "batches": batches,
        "docs_per_batch": docs / max(1, batches),
        "mean_doc_len": sum(lengths) / max(1, len(lengths)),
        "producer_blocked_fraction": stats.get("blocked_fraction"),
        "padding_efficiency": stats.get("batching", {}).get("padding_efficiency"),
    }
    if not args.tiny:
        result.update(mfu(args, cfg.ships_final_hidden, lengths))
    print(
        f"\nproducer process ({ring} ring, drafter kind {args.kind}"
        + (", final hidden state shipped" if cfg.ships_final_hidden else "")
        + f"): {tokens_per_s:,.0f} tokens/s over {args.seconds:.0f} s, "
        f"{batches} batches of {result['docs_per_batch']:.1f} docs (mean {result['mean_doc_len']:.0f} tokens)"
        + (f", MFU {result['mfu']:.1%}" if "mfu" in result else "")
        + f"; ready after {ready_s:.1f} s"
    )
    emit(result)
    return 0


def run_overrides(args: argparse.Namespace, run: RunDir) -> list[str]:
    """One producer of the tiny config or, without ``--tiny``, of the Qwen3-8B shape at the bench's batch."""
    overrides = ["launch.num_producers=1", "training.max_steps=1", f"drafter.kind={json.dumps(args.kind)}"]
    if args.tiny:
        return overrides
    return overrides + [
        *qwen3_8b_target(run.root),
        "data.num_samples=100000",
        f"data.mean_len={args.fixed_len or 1000}",
        "data.min_len=32",
        f"data.max_seq_len={max(3072, args.fixed_len)}",
        *(['data.length_mode="fixed"'] if args.fixed_len else []),
        "data.max_step=63",
        f"batching.token_budget={args.budget}",
        "batching.window_docs=512",
        "drafter.num_layers=5",
        f'ring.backend="{args.ring}"',
        "ring.num_slots=4",
        "ring.heartbeat_timeout_s=30.0",
    ]


def wait_ready(producer: subprocess.Popen, run: RunDir) -> tuple[ProducerStatus, float]:
    """The producer's status once it is ready to serve, and the seconds that took (10 minutes at most)."""
    started = time.monotonic()
    while not (status := ProducerStatus.read(run.producer_status(0)) or ProducerStatus()).ready:
        if producer.poll() is not None or time.monotonic() - started > 600:
            raise RuntimeError((run.root / "producer.log").read_text()[-3000:])
        time.sleep(0.2)
    return status, time.monotonic() - started


def consume(endpoint: str, warmup_s: float, seconds: float) -> tuple[int, int, int, list[int], dict]:
    """Take every batch and ack it at once; of those after ``warmup_s``, for ``seconds``: the tokens, the documents,
    the batches, the documents' lengths, and the producer's last figures."""
    client = RingClient(endpoint, "bench", 1, credits=4)
    client.connect(60)
    tokens = docs = batches = 0
    lengths: list[int] = []
    measure_from = time.monotonic() + warmup_s
    measure_to = measure_from + seconds
    while time.monotonic() < measure_to:
        for delivery in client.poll(timeout_s=0.05):
            if time.monotonic() >= measure_from:
                tokens += delivery.meta["tokens"]
                docs += delivery.meta["docs"]
                batches += 1
                cu = delivery.tensors["cu_seqlens"].tolist()
                lengths += [b - a for a, b in zip(cu[:-1], cu[1:])]
            client.ack(delivery, grant=1)
    stats = client.producer_stats
    client.close()
    return tokens, docs, batches, lengths, stats


def mfu(args: argparse.Namespace, ships_final_hidden: bool, lengths: list[int]) -> dict:
    """The target's model FLOPs utilization over the window, against ``--peak-tflops`` (else measured)."""
    from transformers import AutoConfig

    from producer.target_model.flops import flops_per_document

    peak = args.peak_tflops
    if peak is None:
        import torch

        from launch.bench.harness import matmul_tflops

        peak = matmul_tflops(torch.device("cuda:0"), 8192)
    config = AutoConfig.for_model(**QWEN3_8B)
    # layers 0..33 run for the features; every layer where the final hidden state is shipped too
    layers_run = config.num_hidden_layers if ships_final_hidden else 34
    flops = sum(flops_per_document(config, layers_run, n) for n in lengths)
    return {"peak_tflops": peak, "mfu": flops / args.seconds / 1e12 / peak}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--ring", choices=["cuda", "host"], default="cuda")
    parser.add_argument("--budget", type=int, default=16384, help="tokens per batch (one ring slot)")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before measuring")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--fixed-len",
        type=int,
        default=0,
        help="every document this many tokens (default: the chat length mix, mean 1,000)",
    )
    parser.add_argument("--kind", default="dflash", help="drafter.kind: what the producer ships for it")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="bf16 matmul rate for MFU (measured if omitted)"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

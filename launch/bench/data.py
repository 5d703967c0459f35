"""The producer's data path on the host: chat records read, rendered by the chat template, tokenized and packed.

For a small target this, not the GPU, sets the producer's pace (SmolLM2-135M's producer ran at 160-215k tokens/s, 7%
MFU). The benchmark builds ``--records`` chat records of about ``--answer-words`` words each in a JSONL file, then
runs the producer's own batch plan (producer/data/batching.py) over them for ``--epochs`` epochs, packing every batch
as the producer does before its forward, three ways in one run: each record rendered and tokenized alone (the
source before windows), each window's records tokenized in one call (the tokenizer's batch uses every core), and
windows with the documents kept for later epochs (``data.cache_mb``). Prints tokens/s per epoch of each, a table
and one JSON line.

    python -m launch.bench.data --gguf SmolLM2-135M-Instruct.Q4_1.gguf            # the real model's tokenizer
    python -m launch.bench.data --tokenizer DIR --records 2000 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from common.config import BatchingConfig, DataConfig
from launch.bench.harness import emit
from producer.data.batching import BatchCursor, BatchPlan
from producer.data.build import build_data_source
from producer.data.order import OrderConfig, ShardOrder

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which function returns value "
    "list string number python code example first second because however therefore"
).split()


def write_records(path: Path, count: int, answer_words: int, seed: int = 0) -> None:
    """Chat records, one user turn and one answer each, of lengths spread around ``answer_words``."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))
            answer = " ".join(rng.choice(WORDS) for _ in range(max(8, int(rng.lognormvariate(0, 0.5) * answer_words))))
            f.write(
                json.dumps(
                    {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
                )
                + "\n"
            )


def run(records: Path, tokenizer: str, cache_mb: int, epochs: int, token_budget: int, together: bool) -> list[dict]:
    """Tokens/s of each epoch of one shard's batch plan, every batch materialized (packed) as the producer does;
    ``together=False``: each record rendered and tokenized alone, as the source did before windows were."""
    config = DataConfig(
        format="chat", paths=[str(records)], tokenizer=tokenizer, max_seq_len=token_budget, cache_mb=cache_mb
    )
    source = build_data_source(config)
    if not together:
        source.prefetch = lambda sample_ids: None
    plan = BatchPlan(source, ShardOrder(len(source), OrderConfig(seed=0)), BatchingConfig(token_budget=token_budget))
    per_epoch = []
    for epoch in range(epochs):
        started, tokens, count = time.perf_counter(), 0, 0
        for window in range(plan.num_windows()):
            for index, sample_ids in enumerate(plan.window_batches(epoch, window)):
                tokens += plan.materialize(BatchCursor(epoch, window, index), sample_ids).num_tokens
                count += 1
        seconds = time.perf_counter() - started
        per_epoch.append(
            {"epoch": epoch, "tokens": tokens, "batches": count, "seconds": seconds, "tokens_per_s": tokens / seconds}
        )
    per_epoch[-1]["cache"] = source.cache.as_dict()
    return per_epoch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--gguf", type=Path, help="a GGUF target: its tokenizer and chat template")
    where.add_argument("--tokenizer", help="a Hugging Face folder with a chat template")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--answer-words", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--cache-mb", type=int, default=DataConfig.cache_mb)
    args = parser.parse_args(argv)
    if args.gguf is not None:
        from common.gguf import dequantized_folder

        tokenizer = str(dequantized_folder(args.gguf))
    else:
        tokenizer = args.tokenizer
    with tempfile.TemporaryDirectory() as folder:
        records = Path(folder) / "records.jsonl"
        write_records(records, args.records, args.answer_words)
        results = {
            name: run(records, tokenizer, mb, args.epochs, args.token_budget, together)
            for name, mb, together in (
                ("one at a time", 0, False),
                ("windows", 0, True),
                ("windows, kept", args.cache_mb, True),
            )
        }
    print(f"{'run':16} {'epoch':>5} {'batches':>7} {'tokens':>9} {'seconds':>8} {'tokens/s':>12}")
    for name, epochs in results.items():
        for row in epochs:
            print(
                f"{name:16} {row['epoch']:5d} {row['batches']:7d} {row['tokens']:9d} {row['seconds']:8.2f} "
                f"{row['tokens_per_s']:12,.0f}"
            )
    seconds = {name: sum(r["seconds"] for r in epochs) for name, epochs in results.items()}
    first = {name: epochs[0]["seconds"] for name, epochs in results.items()}
    base = "one at a time"
    print(
        f"cores {os.cpu_count()}; first epoch: windows {first['windows'] / first[base]:.2f}x the time of one at a time; "
        f"all {args.epochs} epochs: windows, kept {seconds['windows, kept'] / seconds[base]:.2f}x"
    )
    emit(
        {
            "bench": "data",
            "records": args.records,
            "epochs": args.epochs,
            "cores": os.cpu_count(),
            "runs": results,
            "first_epoch_ratio": first["windows"] / first[base],
            "all_epochs_ratio": seconds["windows, kept"] / seconds[base],
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""python -m launch.bench.served: the served check (--server) or served measurement of a running server (--url)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launch.bench.harness import emit
from launch.bench.served.check import SERVERS, main_check


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launch.bench.served",
        description="Serve an exported drafter with a real server and check its speculative decoding against our "
        "evaluator, live decoder and z-lab's decoder (--server; exit 1 when they differ, 2 when it cannot run), or "
        "measure a running server (--url; exit 2 when it cannot measure: the server down, or without /metrics).",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--server", choices=SERVERS, help="check an export served by this server")
    mode.add_argument("--url", help="measure the server running at this address (http://HOST:PORT)")
    parser.add_argument("--target", help="check: Hugging Face target folder, or a GGUF file (dequantized once)")
    parser.add_argument("--draft", type=Path, help="check: an export (z-lab format; any kind) or a checkpoint")
    parser.add_argument("--prompts", type=Path, help="JSON lines of prompts (chat records, text or token ids)")
    parser.add_argument("--run-dir", type=Path, help="the run's held-out prompts (token ids) instead of --prompts")
    parser.add_argument("--num-prompts", type=int, help="only the first N prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, help="check: the block size you serve with (must be the export's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="check: both sides' dtype")
    parser.add_argument("--no-live", action="store_true", help="check: leave out our live decoder")
    parser.add_argument("--no-zlab", action="store_true", help="check: leave out z-lab's dflash_generate")
    parser.add_argument(
        "--confidence-min",
        type=float,
        default=0.0,
        metavar="P",
        help="check: cut each block before its first draft whose confidence is below P, on every side (llama-server's "
        "--spec-draft-p-min, our eval.confidence_min; drafters with a confidence head, DSpark)",
    )
    parser.add_argument("--threads", type=int, default=1, help="check: llama-server's threads")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="check: seconds the server may take")
    parser.add_argument("--server-log", type=Path, help="check: keep the server's output in this file")
    parser.add_argument("--concurrency", type=int, default=8, help="measure: requests in flight at once")
    parser.add_argument("--temperature", type=float, default=0.0, help="measure: sampling temperature")
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.max_new_tokens < 1:
        print("served: --max-new-tokens must be at least 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.confidence_min <= 1.0:
        print("served: --confidence-min must lie in [0, 1]", file=sys.stderr)
        return 2
    if args.server:
        missing = [f"--{name}" for name in ("target", "draft") if getattr(args, name) is None]
        if (args.prompts is None) == (args.run_dir is None):
            missing.append("--prompts or --run-dir (one of them)")
        if missing:
            print(f"served: --server needs {', '.join(missing)}", file=sys.stderr)
            return 2
        return main_check(args)
    return main_measure(args)


def main_measure(args) -> int:
    from launch.bench.served.measure import CannotMeasure, held_out_records, measure, print_measurement
    from launch.bench.served.prompts import read_records

    if (args.prompts is None) == (args.run_dir is None):
        print("served: --url needs --prompts or --run-dir (one of them)", file=sys.stderr)
        return 2
    if args.concurrency < 1:
        print("served: --concurrency must be at least 1", file=sys.stderr)
        return 2
    try:
        records = (
            read_records(args.prompts, args.num_prompts)
            if args.prompts is not None
            else held_out_records(args.run_dir, args.num_prompts)
        )
    except (OSError, ValueError) as error:
        print(f"served: {error}", file=sys.stderr)
        return 2
    try:
        result = measure(args.url, records, args.concurrency, args.max_new_tokens, args.temperature)
    except (CannotMeasure, OSError) as error:  # exit 2 as the check's where it cannot run; 1 is its "they differ"
        print(f"served: {args.url}: {error}", file=sys.stderr)
        return 2
    print_measurement(result)
    emit(result, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

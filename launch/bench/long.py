"""Long documents: a drafter training step at 4K, 16K and 64K tokens per document, at equal tokens per step.

    python -m launch.bench.long [--tokens 65536] [--doc-lens 4096,16384,65536] [--kinds sliding,mixed] [--dense]
                                [--device cuda]

Each step packs ``--tokens`` tokens (65,536: sixteen 4K documents, four 16K ones or one 64K one) and samples
``--anchors`` blocks of 16 over them, then runs the drafter's forward and backward on the CPU, as the trainer does
there (``DFlashDrafter.forward_train``: anchors, the tiled masks, the layers, the loss); with ``--device cuda``
the trainer's CUDA path (compiled flex attention and its block masks). The drafter is small
(hidden 64, two layers, 4 heads of 16) so that the attention is a visible share of the step. Kinds: ``sliding``
(both layers slide over ``--window`` tokens), ``mixed`` (the first slides, the second sees its whole document up
to the anchor: the released drafts' sliding layers then a full one), ``full`` (both full) and, with ``--dense``,
``dense`` (both sliding, through one dense mask over the packed row: the CPU path before tiles).

At equal tokens and anchors per step, a cost linear in the document's length is flat across the rows: the
sliding kind should read ratios near 1 against the 4K row. A full layer's work per block grows with the document
(each block sees its document up to its anchor), so its ratios grow with it; the dense mask costs queries x
tokens per step whatever the documents.

Memory: each case runs in a process of its own; after a warm-up step, the freed heap is returned to the system
(malloc_trim), the peak resident set is reset (/proc/self/clear_refs) and the step's peak is VmHWM less the
resident set before it: what the step itself holds at its peak, its inputs excluded. (tracemalloc would not see
torch's allocations, which bypass Python's allocator.) On CUDA: the allocator's peak above what was allocated
before the step. Time: the median of ``--repeats`` steps.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import subprocess
import sys
import time

import torch

from launch.bench.harness import emit, synchronize

KINDS = {
    "sliding": ["sliding_attention", "sliding_attention"],
    "mixed": ["sliding_attention", "full_attention"],
    "full": ["full_attention", "full_attention"],
    "dense": ["sliding_attention", "sliding_attention"],
}
"""The drafter's layer types of each kind."""


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _release_and_reset_peak() -> float:
    """Give the freed heap back to the system, reset the peak resident set; the resident MiB now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status_mib("VmRSS")


def run_case(kind: str, doc_len: int, args: argparse.Namespace) -> dict:
    """One step's seconds (median) and peak MiB for documents of ``doc_len`` tokens; in this process."""
    torch.set_num_threads(1)
    device = torch.device(args.device)
    drafter, batch = _drafter_and_batch(kind, doc_len, args)
    drafter, batch = drafter.to(device), batch.to(device)

    def step() -> float:
        started = time.perf_counter()
        loss, _ = drafter.forward_train(batch, args.anchors, torch.Generator(device=device).manual_seed(1))
        loss.backward()
        drafter.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - started

    step()  # warm-up: compilation, lazy initialisations, the first touch of the inputs
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) / 2**20
    else:
        before = _release_and_reset_peak()
    seconds = [step() for _ in range(args.repeats)]
    peak = (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _status_mib("VmHWM")) - before
    return {"kind": kind, "doc_len": doc_len, "docs": args.tokens // doc_len, "seconds": statistics.median(seconds),
            "peak_mib": peak}  # fmt: skip


def _drafter_and_batch(kind: str, doc_len: int, args: argparse.Namespace) -> tuple:
    """The small drafter of ``kind`` (random weights) and one step's batch of ``doc_len``-token documents, on the
    CPU."""
    from common.batch import PackedBatch
    from common.drafter.draft_config import DraftConfig
    from common.drafter.model import DFlashDrafter
    from common.drafter.target_head import TargetHead

    config = DraftConfig(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        target_hidden_size=args.hidden,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=255,
        block_size=16,
        layer_types=KINDS[kind],
        sliding_window=args.window,
    )
    gen = torch.Generator().manual_seed(0)
    head = TargetHead(
        torch.randn(256, args.hidden, generator=gen), torch.randn(256, args.hidden, generator=gen) * 0.1,
        torch.ones(args.hidden), config.rms_norm_eps,
    )  # fmt: skip
    drafter = DFlashDrafter(config, head, attention_backend="sdpa" if kind == "dense" else None)
    tokens = args.tokens
    cu_seqlens = torch.arange(0, tokens + 1, doc_len, dtype=torch.int32)
    loss_mask = torch.ones(tokens, dtype=torch.uint8)
    loss_mask[cu_seqlens[:-1].long()] = 0
    batch = PackedBatch(
        input_ids=torch.randint(0, 255, (tokens,), generator=gen, dtype=torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        sample_ids=torch.arange(len(cu_seqlens) - 1),
        aux_hidden=torch.randn(tokens, config.fused_feature_size, generator=gen),
    )
    return drafter, batch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per step (every document length divides it)")
    parser.add_argument("--doc-lens", default="4096,16384,65536", help="tokens per document, comma-separated")
    parser.add_argument("--kinds", default="sliding,mixed", help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--dense", action="store_true", help="also the dense kind (one mask over the packed row)")
    parser.add_argument("--anchors", type=int, default=512, help="blocks of 16 per step")
    parser.add_argument("--window", type=int, default=256, help="sliding window in tokens")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu (tiled attention) or cuda (compiled flex attention)")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # KIND:DOC_LEN, run in this process (the child's side)
    args = parser.parse_args(argv)
    if args.case:
        kind, doc_len = args.case.split(":")
        print(json.dumps(run_case(kind, int(doc_len), args)))
        return 0

    doc_lens = [int(x) for x in args.doc_lens.split(",")]
    kinds = args.kinds.split(",") + (["dense"] if args.dense else [])
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    for doc_len in doc_lens:
        if args.tokens % doc_len:
            parser.error(f"--doc-lens: {doc_len} does not divide --tokens {args.tokens}")
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--dense")]
    rows = [run_child(kind, doc_len, passed) for kind in kinds for doc_len in doc_lens]
    print(
        f"{args.tokens} tokens and {args.anchors} blocks of 16 per step, window {args.window}, hidden {args.hidden}, "
        + ("CPU, one thread" if args.device == "cpu" else args.device)
    )
    ratios = print_rows(rows, kinds)
    emit(
        {
            "bench": "long",
            "device": args.device,
            "tokens_per_step": args.tokens,
            "anchors": args.anchors,
            "window": args.window,
            "hidden": args.hidden,
            "memory": "peak RSS above the step's start, a process per case"
            if args.device == "cpu"
            else "peak allocated above the step's start",
            f"ratio_{doc_lens[-1]}_to_{doc_lens[0]}": ratios,
            "rows": rows,
        }
    )
    return 0


def run_child(kind: str, doc_len: int, passed: list[str]) -> dict:
    """The row of one case, measured in a process of its own (this command with ``--case``)."""
    child = subprocess.run(
        [sys.executable, "-m", "launch.bench.long", *passed, "--case", f"{kind}:{doc_len}"],
        capture_output=True,
        text=True,
    )
    if child.returncode != 0:
        return {"kind": kind, "doc_len": doc_len, "error": child.stderr.strip().splitlines()[-1][:200]}
    return json.loads(child.stdout.strip().splitlines()[-1])


def print_rows(rows: list[dict], kinds: list[str]) -> dict:
    """Print the table, each row's time and memory against its kind's first (shorter documents); each kind's last
    ratios."""
    print(f"{'kind':>8} {'doc len':>8} {'docs':>5} {'step s':>8} {'x 1st':>6} {'peak MiB':>9} {'x 1st':>6}")
    ratios = {}
    for kind in kinds:
        mine = [r for r in rows if r["kind"] == kind]
        first = next((r for r in mine if "error" not in r), None)
        for row in mine:
            if "error" in row:
                print(f"{kind:>8} {row['doc_len']:8d} {'':>5} failed: {row['error']}")
                continue
            row["time_ratio"] = row["seconds"] / first["seconds"]
            row["memory_ratio"] = row["peak_mib"] / max(first["peak_mib"], 1e-9)
            print(
                f"{kind:>8} {row['doc_len']:8d} {row['docs']:5d} {row['seconds']:8.3f} {row['time_ratio']:6.2f} "
                f"{row['peak_mib']:9.1f} {row['memory_ratio']:6.2f}"
            )
        last = mine[-1]
        if "error" not in last:
            ratios[kind] = {"time": round(last["time_ratio"], 3), "memory": round(last["memory_ratio"], 3)}
    return ratios


if __name__ == "__main__":
    raise SystemExit(main())

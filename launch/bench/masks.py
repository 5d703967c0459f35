"""The drafter's block mask: its tiles from the blocks, against flex attention finding them pair by pair.

    python -m launch.bench.masks [--device cuda] [--sizes 512x16384,2048x65536,4096x16384]

Each size is ANCHORSxTOKENS (blocks of 16 over one packed batch of 1,024-token documents). ``flex_block_mask``
lists the tiles from the anchors' context ranges; the baseline hands the same mask function to
``create_block_mask``, which evaluates it at every query-key pair to find them. Prints the time and the peak
memory of each (on a GPU) and one JSON line. A baseline that does not fit the device's memory is reported so.
"tiles listed / needed" counts the tiles each lists (the first counts the gaps between two documents' context
ranges as seen: a tile too many is slower, never wrong).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from common.batch import PackedBatch
from common.drafter.blocks import build_blocks
from common.drafter.masks import FLEX_BLOCK, flex_block_mask
from launch.bench.harness import add_device_argument, emit

MASK_TOKEN = 0


def packed_batch(tokens: int, device: torch.device) -> PackedBatch:
    """Documents of 1,024 tokens, every token supervised but each document's first (what anchors need, no features)."""
    cu_seqlens = torch.arange(0, tokens + 1, 1024, dtype=torch.int32)
    loss_mask = torch.ones(tokens, dtype=torch.uint8)
    loss_mask[cu_seqlens[:-1].long()] = 0
    return PackedBatch(
        input_ids=torch.ones(tokens, dtype=torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        sample_ids=torch.arange(len(cu_seqlens) - 1),
        aux_hidden=torch.zeros(tokens, 1),
    ).to(device)


def timed(build, device: torch.device, repeats: int) -> dict:
    """Seconds per build (after one warm-up) and the peak memory it allocated, in GiB (GPU only)."""
    build()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    for _ in range(repeats):
        build()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / repeats
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if device.type == "cuda" else None
    return {"seconds": seconds, "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    parser.add_argument("--sizes", default="512x16384,2048x65536,4096x16384", help="ANCHORSxTOKENS,...")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for size in args.sizes.split(","):
        anchors, tokens = (int(x) for x in size.split("x"))
        blocks = build_blocks(
            packed_batch(tokens, device), anchors, 16, MASK_TOKEN, torch.Generator(device=device).manual_seed(0)
        )
        mask = flex_block_mask(blocks)
        q_len, kv_len = mask.seq_lengths
        row = {
            "anchors": anchors,
            "tokens": tokens,
            "queries": q_len,
            "keys": kv_len,
            "tiles": timed(lambda: flex_block_mask(blocks), device, args.repeats),
        }
        try:
            row["pairs"] = timed(
                lambda: create_block_mask(
                    mask.mask_mod, None, None, q_len, kv_len, device=device, BLOCK_SIZE=FLEX_BLOCK
                ),
                device,
                args.repeats,
            )
            exact = create_block_mask(mask.mask_mod, None, None, q_len, kv_len, device=device, BLOCK_SIZE=FLEX_BLOCK)
            row["tiles_listed"], row["tiles_needed"] = int(mask.to_dense().sum()), int(exact.to_dense().sum())
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # RuntimeError: the host allocator's "can't allocate"
            row["pairs"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(
        f"{'anchors':>7} {'tokens':>7} {'queries x keys':>16} {'tiles s':>9} {'GiB':>6} {'pairs s':>9} {'GiB':>6} "
        f"{'ratio':>7} tiles listed / needed"
    )
    for row in rows:
        tiles, pairs = row["tiles"], row["pairs"]
        gib = lambda r: f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        if "error" in pairs:
            tail = f"{'-':>9} {'-':>6} {'-':>7} baseline failed: {pairs['error']}"
        else:
            tail = (
                f"{pairs['seconds']:9.4f} {gib(pairs):>6} {tiles['seconds'] / pairs['seconds']:7.3f} "
                f"{row['tiles_listed']} / {row['tiles_needed']}"
            )
        print(
            f"{row['anchors']:7d} {row['tokens']:7d} {row['queries']:>7}x{row['keys']:<8} {tiles['seconds']:9.4f} "
            f"{gib(tiles):>6} {tail}"
        )
    emit({"bench": "masks", "device": str(device), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

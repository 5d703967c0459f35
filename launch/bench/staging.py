"""Benchmark: how fast a GPU state lands in new /dev/shm staging segments, the way a handover during a checkpoint
write makes them (trainer/handover.py ``SharedStaging.detach``), against copying into segments already made.

    python -m launch.bench.staging                 # 4.2 + 8.4 GB, a Qwen3-8B draft's weights and AdamW state
    python -m launch.bench.staging --gb 0.5 0.5    # smaller

Modes, each on fresh segments but "reused":
  reused          segments made and page-locked before, as the first checkpoint leaves them (the usual handover)
  fill+pin        fault every page in (fill), page-lock (cudaHostRegister), copy: what ``detach`` leads to
  pin             page-lock without the fill (the registration faults the pages in), copy
  pageable        no fill, no page-locking: the copy faults the pages in
Needs CUDA. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from pathlib import Path

import torch

from launch.bench.harness import emit

SHM = Path("/dev/shm")


def make_segment(path: Path, size: int, fill: bool, pin: bool) -> tuple[mmap.mmap, torch.Tensor]:
    with open(path, "w+b") as f:
        f.truncate(size)
        mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
    flat = torch.frombuffer(mapped, dtype=torch.uint8)
    if fill:
        flat.fill_(0)
    if pin:
        error = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {error}")
    return mapped, flat


def run_mode(mode: str, sources: list[torch.Tensor]) -> dict[str, float]:
    paths = [SHM / f"dflash-bench-staging.{os.getpid()}.{i}" for i in range(len(sources))]
    segments, timings = [], {}
    try:
        started = time.perf_counter()
        for path, source in zip(paths, sources):
            size = source.numel() * source.element_size()
            segments.append(make_segment(path, size, fill=mode in ("reused", "fill+pin"), pin=mode != "pageable"))
        made = time.perf_counter()
        if mode == "reused":
            started = made  # made before the handover: only the copy counts
        for (_, flat), source in zip(segments, sources):
            flat.view(source.dtype).view(source.shape).copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        done = time.perf_counter()
        timings = {
            "make_s": made - started if mode != "reused" else 0.0,
            "copy_s": done - made,
            "total_s": done - started,
        }
    finally:
        for (mapped, flat), path in zip(segments, paths):
            if mode != "pageable":
                torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())
            del flat
            path.unlink(missing_ok=True)
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--gb", type=float, nargs="+", default=[4.2, 8.4], help="segment sizes (GB), one per state tree"
    )
    parser.add_argument("--modes", nargs="+", default=["reused", "fill+pin", "pin", "pageable"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    sources = [torch.randn(int(gb * 1e9 / 4), device="cuda") for gb in args.gb]
    total_gb = sum(s.numel() * 4 for s in sources) / 1e9
    rows = {}
    print(f"{'mode':10s} {'make s':>8s} {'copy s':>8s} {'total s':>8s} {'GB/s':>7s}   ({total_gb:.1f} GB)", flush=True)
    for mode in args.modes:
        rows[mode] = run_mode(mode, sources)
        r = rows[mode]
        print(
            f"{mode:10s} {r['make_s']:8.2f} {r['copy_s']:8.2f} {r['total_s']:8.2f} {total_gb / r['total_s']:7.1f}",
            flush=True,
        )
    emit({"bench": "staging", "gb": args.gb, "device": torch.cuda.get_device_name(), **rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: how fast this host puts a checkpoint on disk, by the writers a checkpoint could use.

    python -m launch.bench.disk --dir /path/of/the/run          # 8 GB raw, 4 GB through each serializer
    python -m launch.bench.disk --dir /tmp --gb 1 --threads 1,4  # smaller

A checkpoint of the Qwen3-8B draft is 12.6 GB written every few hundred steps (every 40 in the stall
benchmark), and the trainer waits for the previous write before it starts the next. This measures what the
disk under the run directory allows, each figure with fsync included (a checkpoint is fsynced before
latest.json names it):

  raw, N threads   --gb from page-locked host memory in 256 MB writes, split over N files written at once
  torch.save       --gb/2 in 8 tensors, one file (what the train state was written with before 162a542)
  safetensors      --gb/2 in 8 tensors, one file (the library's save_file: how each file of a checkpoint was
                   written, a thread per file, from 162a542 to 8a792b0)
  tensor files     --gb/2 in 8 tensors, one file written by byte ranges from WRITE_THREADS threads
                   (trainer/tensor_files.py, what a checkpoint is written with now)

Then how long a live status file's write takes while such a write goes on (`tensor files`, --gb/2), with its
fsync and without, taking turns every 50 ms: the trainer rewrites trainer.json every few steps while an
evaluation is out, and a step waits for it.

Prints the tables, then one JSON line. The files are removed after each measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.rundir import atomic_write_json, fsync_file
from launch.bench.harness import emit
from trainer.tensor_files import TensorFile, write_tensor_files

GB = 1 << 30
CHUNK = 256 << 20


def raw(folder: Path, gb: float, threads: int) -> float:
    """Seconds to write ``gb`` over ``threads`` files at once, each fsynced by its writer."""
    per_file = int(gb * GB) // threads
    source = torch.full((per_file,), 7, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = memoryview(source.numpy())

    def write(index: int) -> None:
        with open(folder / f"raw-{index}", "wb", buffering=0) as f:
            for offset in range(0, per_file, CHUNK):
                f.write(view[offset : offset + CHUNK])
            os.fsync(f.fileno())

    started = time.perf_counter()
    writers = [threading.Thread(target=write, args=(i,)) for i in range(threads)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    return time.perf_counter() - started


def eight_tensors(gb: float) -> dict[str, torch.Tensor]:
    """``gb`` of fp32 in 8 tensors: a train state's shape, as the serializers and the tensor files write it."""
    return {f"t{i}": torch.ones(int(gb * GB) // 4 // 8) for i in range(8)}


def serialized(folder: Path, gb: float, how: str) -> tuple[float, float]:
    """(seconds to write, seconds in all with fsync) of ``gb`` in 8 fp32 tensors through ``how``."""
    tensors = eight_tensors(gb)
    path = folder / ("state.pt" if how == "torch.save" else "state.safetensors")
    started = time.perf_counter()
    if how == "torch.save":
        torch.save(tensors, path)
    elif how == "safetensors":
        save_file(tensors, str(path))
    else:
        write_tensor_files([TensorFile(path, tensors)])  # fsynced by its threads
    written = time.perf_counter() - started
    fsync_file(path)
    return written, time.perf_counter() - started


def status_writes(folder: Path, gb: float) -> dict[bool, list[float]]:
    """Seconds of each status write, by whether it was fsynced, while ``gb`` in 8 tensors is written as a
    checkpoint is (tensor files, fsynced)."""
    tensors = eight_tensors(gb)
    writer = threading.Thread(target=write_tensor_files, args=([TensorFile(folder / "state.safetensors", tensors)],))
    seconds: dict[bool, list[float]] = {True: [], False: []}
    writer.start()
    while writer.is_alive():
        durable = len(seconds[True]) <= len(seconds[False])
        started = time.perf_counter()
        atomic_write_json(folder / "status.json", {"step": len(seconds[True]) + len(seconds[False])}, durable=durable)
        seconds[durable].append(time.perf_counter() - started)
        time.sleep(0.05)
    writer.join()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dir", default="/tmp", help="a folder on the disk to measure (a scratch folder is made in it)"
    )
    parser.add_argument(
        "--gb", type=float, default=8.0, help="gigabytes of each raw measurement (half for the serializers)"
    )
    parser.add_argument("--threads", default="1,2,4,8", help="comma list of raw writer counts")
    args = parser.parse_args(argv)
    folder = Path(args.dir) / f"df-bench-disk-{os.getpid()}"
    try:
        rows = writer_rows(folder, args.gb, [int(t) for t in args.threads.split(",")])
        status = status_rows(folder, args.gb / 2)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_tables(rows, status, args.gb)
    emit({"bench": "disk", "dir": args.dir, "rows": rows, "status_writes": status})
    return 0


def writer_rows(folder: Path, gb: float, thread_counts: list[int]) -> list[dict]:
    """One row per raw writer count (``gb`` each), then one per serializer (half of it), each in a fresh ``folder``."""
    rows = []
    for threads in thread_counts:
        folder.mkdir(parents=True)
        seconds = raw(folder, gb, threads)
        rows.append(
            {"writer": f"raw, {threads} thread{'s' * (threads > 1)}", "gb": gb, "s": seconds, "gb_per_s": gb / seconds}
        )
        shutil.rmtree(folder)
    for how in ("torch.save", "safetensors", "tensor files"):
        folder.mkdir(parents=True)
        written, seconds = serialized(folder, gb / 2, how)
        rows.append({"writer": how, "gb": gb / 2, "s": seconds, "written_s": written, "gb_per_s": gb / 2 / seconds})
        shutil.rmtree(folder)
    return rows


def status_rows(folder: Path, gb: float) -> list[dict]:
    """The status writes' latency, with and without fsync, beside a ``gb`` GB checkpoint write."""
    folder.mkdir(parents=True)
    status = []
    for durable, seconds in status_writes(folder, gb).items():
        seconds.sort()
        status.append(
            {
                "status write": "fsync" if durable else "no fsync",
                "writes": len(seconds),
                "median_ms": 1000 * seconds[len(seconds) // 2],
                "p90_ms": 1000 * seconds[int(0.9 * (len(seconds) - 1))],
                "max_ms": 1000 * seconds[-1],
                "total_s": sum(seconds),
            }
        )
    shutil.rmtree(folder)
    return status


def print_tables(rows: list[dict], status: list[dict], gb: float) -> None:
    print(f"{'writer':<18}{'GB':>6}{'s (fsync incl.)':>17}{'GB/s':>7}")
    for row in rows:
        print(f"{row['writer']:<18}{row['gb']:>6.1f}{row['s']:>17.2f}{row['gb_per_s']:>7.2f}")
    print(f"\nstatus writes beside a {gb / 2:g} GB checkpoint write (taking turns):")
    print(f"{'status write':<14}{'writes':>8}{'median ms':>11}{'p90 ms':>9}{'max ms':>9}{'total s':>9}")
    for row in status:
        print(
            f"{row['status write']:<14}{row['writes']:>8}{row['median_ms']:>11.2f}{row['p90_ms']:>9.2f}"
            f"{row['max_ms']:>9.1f}{row['total_s']:>9.2f}"
        )


if __name__ == "__main__":
    raise SystemExit(main())

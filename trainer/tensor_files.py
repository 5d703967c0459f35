"""safetensors files written by byte ranges from several threads at once, straight from host tensors.

A checkpoint of the Qwen3-8B draft is 12.6 GB in two files of very different sizes: the drafter's fp32
weights (4.2 GB, one ``model.safetensors``, as servers load it) and the train state's tensors (8.4 GB).
Written one file per thread, the largest file ends alone; the H200 host's disk took 1.06 GB/s that way,
against 1.55-1.68 GB/s from four to eight writers at once (BENCHMARKS.md). So every file is laid out first
(its header, and where each tensor's bytes go) and sized, and then the bytes of all files together are cut
into contiguous runs of about equal length, one per thread; each thread writes its run with ``pwrite`` from
the tensors' own memory (no serialized copy) and flushes the files it wrote to. The files are plain
safetensors: the library's ``load_file`` reads them back.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

WRITE_THREADS = 8
"""Threads writing a checkpoint's bytes: the H200 host's disk gained from one writer up to eight."""
PIECE_BYTES = 64 << 20
"""The bytes of one pwrite call at most: runs are balanced to within this."""

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class TensorFile:
    """One safetensors file to write: where, which tensors (on the host, contiguous) and its text metadata."""

    path: Path
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Piece:
    file: int
    """Index of the file in the write's list."""
    offset: int
    data: memoryview


def _layout(file: TensorFile) -> tuple[int, list[tuple[int, memoryview]]]:
    """The file's size, and (offset, bytes) of its header and of every tensor.

    Widest dtypes first (then by name), so each tensor starts at a multiple of its element size (the header is
    padded to 8 bytes), as the library lays them out for loads that map the file.
    """
    entries: dict[str, dict] = {}
    data: list[tuple[int, memoryview]] = []
    offset = 0
    for name in sorted(file.tensors, key=lambda k: (-file.tensors[k].element_size(), k)):
        tensor = file.tensors[name]
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{file.path}: tensor {name!r} must be contiguous and on the host")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{file.path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        if size:
            data.append((offset, memoryview(tensor.reshape(-1).view(torch.uint8).numpy())))
        offset += size
    header = json.dumps(
        {"__metadata__": file.metadata, **entries} if file.metadata else entries, separators=(",", ":")
    ).encode()
    header += b" " * (-len(header) % 8)
    prefix = struct.pack("<Q", len(header)) + header
    return len(prefix) + offset, [(0, memoryview(prefix))] + [(len(prefix) + o, view) for o, view in data]


def _runs(pieces: list[_Piece], count: int) -> list[list[_Piece]]:
    """``pieces`` (in file order) cut into at most ``count`` contiguous runs of about equal bytes."""
    total = sum(len(p.data) for p in pieces)
    target = -(-total // count) if total else 1
    runs: list[list[_Piece]] = [[]]
    filled = 0
    for piece in pieces:
        if filled >= target and len(runs) < count:
            runs.append([])
            filled = 0
        runs[-1].append(piece)
        filled += len(piece.data)
    return [run for run in runs if run]


def _write_run(fds: list[int], run: list[_Piece]) -> None:
    """Write one run, then flush every file it wrote to (concurrent flushes of a file each wait for all of it)."""
    for piece in run:
        data, offset = piece.data, piece.offset
        while data:  # pwrite may write less than asked
            written = os.pwrite(fds[piece.file], data, offset)
            data, offset = data[written:], offset + written
    for index in sorted({piece.file for piece in run}):
        os.fsync(fds[index])


def write_tensor_files(files: list[TensorFile], threads: int = WRITE_THREADS) -> None:
    """Write ``files`` (each fsynced before this returns) with up to ``threads`` threads at once.

    The tensors must not change until it returns (they are written from their own memory). OSError (a full
    disk, say) is raised as it comes; what was written is left for the caller to remove.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    layouts = [_layout(file) for file in files]  # a tensor it cannot write is refused before any file is made
    fds: list[int] = []
    try:
        pieces: list[_Piece] = []
        for index, (file, (size, parts)) in enumerate(zip(files, layouts)):
            fds.append(os.open(file.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
            os.ftruncate(fds[-1], size)  # sized up front: the runs fill it in any order
            pieces += [
                _Piece(index, offset + start, view[start : start + PIECE_BYTES])
                for offset, view in parts
                for start in range(0, len(view), PIECE_BYTES)
            ]
        runs = _runs(pieces, threads)
        if len(runs) == 1:
            _write_run(fds, runs[0])
            return
        with ThreadPoolExecutor(len(runs), thread_name_prefix="tensor-files") as pool:
            for done in [pool.submit(_write_run, fds, run) for run in runs]:
                done.result()
    finally:
        for fd in fds:
            os.close(fd)

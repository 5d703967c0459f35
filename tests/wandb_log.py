"""Read the history series out of an offline wandb run file (.wandb: LevelDB log records of protobufs)."""

from __future__ import annotations

import struct
from pathlib import Path

BLOCK = 32768
FILE_HEADER = 7  # ":W&B", magic (2 bytes), version (1 byte)
RECORD_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, pending = FILE_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER:
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + RECORD_HEADER])
        chunk = data[pos + RECORD_HEADER : pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""
        else:
            break


def history(run_dir: Path) -> list[dict]:
    """Every history row (key -> JSON value text) of the offline runs under ``run_dir``/wandb."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for raw in records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                rows.append({(item.key or "/".join(item.nested_key)): item.value_json for item in record.history.item})
    return rows

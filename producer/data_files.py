"""Chat data as users hold it: JSONL, Parquet and Arrow files and Hugging Face dataset folders, read at random.

An entry of ``data.paths`` (after glob expansion) is

- a ``.parquet`` file: its rows, read by row group;
- an ``.arrow`` file: Arrow IPC (the stream format datasets' ``save_to_disk`` writes, or the file format),
  memory-mapped;
- a folder written by ``Dataset.save_to_disk`` (its ``state.json`` lists the ``data-0000i-of-0000N.arrow`` files),
  or by ``DatasetDict.save_to_disk`` (``dataset_dict.json`` names the splits, one such folder each; ``data.split``
  picks one), or any other folder of Parquet, Arrow or JSONL files, such as a hub snapshot
  (``data/train-00000-of-00002.parquet``). Such a folder's split is decided as datasets' own loader does: the name
  before ``-0000i-of-0000N`` when the files are named so, else a train, validation or test word that starts a folder's
  or file's name, else every file is the split "train";
- any other file: JSON lines (producer/data.py ``JsonlRecords``).

Sample ids run over the files in the order given, a folder's files in its order (``state.json``'s, else sorted by
path). The first record of each file is read at start and checked against the layout (producer/data.py
``ChatLayout``): data that cannot be read as configured stops the run (DataError, exit 2) naming the keys it has and
the ``data.*`` keys that fix it, before anything is trained; a record that cannot be read later is a bad record like
any other.

pyarrow reads Parquet and Arrow, and is optional (``pip install 'dflash-stream[parquet]'``); datasets is not needed.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np

from common.config import DataConfig
from producer.data import ChatLayout, DataError, FileRecords, JsonlRecords, Records

_TABLE_SUFFIXES = {".parquet": "Parquet", ".arrow": "Arrow"}
_FOLDER_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")
"""The files a folder without datasets' own files is read from."""
_METADATA = frozenset({"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"})
"""datasets' descriptions of a data set, which a hub snapshot may hold beside its data: never records."""

_SHARD_NAME = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}(?=[-.])")
"""``<split>-00000-of-00002.parquet``: how the hub and ``push_to_hub`` name a split's files."""

_SPLIT_WORD = re.compile(
    r"(?:^|[-._ ])(training|train|validation|valid|val|dev|testing|test|evaluation|eval)(?=[-._ 0-9]|$)"
)
_SPLIT_OF_WORD = {
    "train": "train",
    "training": "train",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "validation",
    "test": "test",
    "testing": "test",
    "eval": "test",
    "evaluation": "test",
}
"""The words datasets' loader takes a split from in a file's or folder's name, and the split each names."""


def _pyarrow(path: str) -> Any:
    """The pyarrow module, or a DataError naming the file that needs it and how to install it."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet  # noqa: F401 (pyarrow.parquet is a module of its own, imported to be used)
    except ImportError:
        raise DataError(
            f"data.paths: reading {path} needs pyarrow: pip install pyarrow (or pip install 'dflash-stream[parquet]')"
        ) from None
    return pyarrow


class ParquetRecords(Records):
    """The rows of a Parquet file, read at random: a row group is decoded the first time one of its rows is read and
    kept, so each is decoded once (memory: at most the uncompressed size of the columns read). Data larger than
    memory reads better from Arrow, which is read where it lies."""

    def __init__(self, path: str):
        super().__init__(path)
        pa = _pyarrow(path)
        try:
            self._file = pa.parquet.ParquetFile(path, memory_map=True)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"data.paths: {path} cannot be read as Parquet ({error})") from None
        meta = self._file.metadata
        counts = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        self.columns: list[str] = list(self._file.schema_arrow.names)
        self._groups: dict[int, Any] = {}
        self._lock = threading.Lock()  # a row group decoded once, whichever thread asks first

    def __len__(self) -> int:
        return self._starts[-1]

    def location(self, index: int) -> str:
        return f"{self.path}:row {index}"

    def project(self, columns: list[str]) -> None:
        self.columns = [name for name in columns if name in self._file.schema_arrow.names]
        self._groups = {}

    def read(self, index: int) -> dict[str, Any]:
        group = bisect.bisect_right(self._starts, index) - 1
        with self._lock:
            table = self._groups.get(group)
            if table is None:
                table = self._groups[group] = self._file.read_row_group(group, columns=self.columns)
        row = index - self._starts[group]
        return {name: table.column(name)[row].as_py() for name in self.columns}


class ArrowRecords(Records):
    """The rows of an Arrow IPC file (the stream format datasets' ``save_to_disk`` writes, or the file format),
    memory-mapped: a row is read where it lies, nothing is decoded ahead, and the pages are the kernel's to keep."""

    def __init__(self, path: str):
        super().__init__(path)
        pa = _pyarrow(path)
        try:
            mapped = pa.memory_map(path)
            try:
                reader = pa.ipc.open_stream(mapped)
                batches = list(reader)
            except pa.ArrowInvalid:  # not a stream: the file format (a footer indexes the batches)
                reader = pa.ipc.open_file(mapped)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"data.paths: {path} cannot be read as Arrow IPC ({error})") from None
        self._batches = batches
        self._starts = np.concatenate([[0], np.cumsum([len(b) for b in batches], dtype=np.int64)]).tolist()
        self._names = list(reader.schema.names)
        self.columns: list[str] = list(self._names)

    def __len__(self) -> int:
        return self._starts[-1]

    def location(self, index: int) -> str:
        return f"{self.path}:row {index}"

    def project(self, columns: list[str]) -> None:
        self.columns = [name for name in columns if name in self._names]

    def read(self, index: int) -> dict[str, Any]:
        which = bisect.bisect_right(self._starts, index) - 1
        batch, row = self._batches[which], index - self._starts[which]
        return {name: batch.column(name)[row].as_py() for name in self.columns}


def open_records(path: str) -> Records:
    """The records of one file, by its suffix: Parquet, Arrow, else JSON lines."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        return ParquetRecords(path)
    if suffix == ".arrow":
        return ArrowRecords(path)
    return JsonlRecords(path)


def _pick_split(splits: list[str], split: str | None, folder: str) -> str:
    """``split``, or by default "train" or the folder's only split."""
    if split is not None:
        if split not in splits:
            raise DataError(f"data.split: {split!r} is not a split of {folder} (its splits: {', '.join(splits)})")
        return split
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise DataError(f"data.split: {folder} has the splits {', '.join(splits)}: data.split names the one to read")


def _split_by_word(relative: Path) -> str | None:
    """The split a train, validation or test word names in a file's relative path (its folders first), or None."""
    for part in (*relative.parent.parts, relative.stem):
        match = _SPLIT_WORD.search(part.lower())
        if match:
            return _SPLIT_OF_WORD[match.group(1)]
    return None


def dataset_folder(folder: str, split: str | None) -> tuple[str, list[str]]:
    """What ``folder`` is, in words, and the files of its split in the order they are read (module docstring)."""
    root = Path(folder)
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text())["splits"]
        chosen = _pick_split(list(splits), split, folder)
        described, files = dataset_folder(str(root / chosen), None)
        return f"DatasetDict folder, split {chosen!r}: {described}", files
    if (root / "state.json").is_file():
        state = json.loads((root / "state.json").read_text())
        files = [str(root / data_file["filename"]) for data_file in state["_data_files"]]
        return f"Dataset folder of {len(files)} Arrow file{'s' * (len(files) != 1)}", files
    found = sorted(
        path
        for path in root.rglob("*")
        if path.suffix.lower() in _FOLDER_SUFFIXES
        and path.name not in _METADATA
        and path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(root).parts)  # a download's .cache
    )
    if not found:
        raise DataError(
            f"data.paths: {folder} holds no data set: neither datasets' dataset_dict.json or state.json nor a "
            f"{', '.join(_FOLDER_SUFFIXES)} file"
        )
    splits: dict[str, list[Path]] = {}
    sharded = [(path, match["split"]) for path in found if (match := _SHARD_NAME.match(path.name))]
    for path, name in sharded or [(path, _split_by_word(path.relative_to(root))) for path in found]:
        if name is not None:
            splits.setdefault(name, []).append(path)
    splits = splits or {"train": found}
    chosen = _pick_split(sorted(splits), split, folder)
    files = splits[chosen]
    kinds = sorted({_TABLE_SUFFIXES.get(path.suffix.lower(), "JSONL") for path in files})
    return f"folder, split {chosen!r}: {len(files)} {'/'.join(kinds)} file{'s' * (len(files) != 1)}", [
        str(path) for path in files
    ]


def _opens_a_json_array(path: str) -> bool:
    """Whether the file is one JSON document that opens with ``[`` (a list of records, not one record a line)."""
    with open(path, "rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


class ChatRecords(FileRecords):
    """The records of chat data's files as one sequence, each read as OpenAI messages by the data's layout."""

    def __init__(self, files: list[Records], layout: ChatLayout, described: list[str]):
        super().__init__(files)
        self.layout = layout
        self._described = described

    def read(self, sample_id: int) -> dict[str, Any]:
        """The record with its conversation as OpenAI messages under ``messages``; raises BadRecord."""
        return self.layout.openai_record(super().read(sample_id))

    def describe(self) -> list[str]:
        """One line per entry of the paths: what it is and how its records are read."""
        return list(self._described)


def chat_records(config: DataConfig, paths: list[str]) -> ChatRecords:
    """The chat records of ``paths`` (files and dataset folders, module docstring) as ``config`` lays them out;
    DataError when a file cannot be read or its first record not as configured."""
    layout = ChatLayout.of(config)
    files: list[Records] = []
    described = []
    for entry in paths:
        if os.path.isdir(entry):
            container, names = dataset_folder(entry, config.split)
        else:
            container, names = _TABLE_SUFFIXES.get(Path(entry).suffix.lower(), "JSONL"), [entry]
        layouts: dict[str, None] = {}  # the distinct ones, in order
        opened = [open_records(name) for name in names]
        for records in opened:
            sample = records.sample()
            if sample is None:
                if isinstance(records, JsonlRecords) and _opens_a_json_array(records.path):
                    raise DataError(
                        f"data.paths: {records.path} is one JSON array of records, not JSON lines: write one record "
                        "a line (jq -c '.[]' file.json > file.jsonl)"
                    )
                continue  # its first records are all bad: each is reported as one
            layouts[layout.check(sample, records.path)] = None
            records.project([layout.conversation_key(sample), "tools"])
        if not sum(len(records) for records in opened):
            raise DataError(f"data.paths: {entry} is empty (no records)")
        files += opened
        described.append(f"{entry}: {container}; {', '.join(layouts) or 'no record read yet'}")
    return ChatRecords(files, layout, described)

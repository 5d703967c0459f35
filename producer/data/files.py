"""Data files as users hold them: JSONL, Parquet and Arrow files and Hugging Face dataset folders, read at random.

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
- any other file: JSON lines (``JsonlRecords``).

Sample ids run over the files in the order given, a folder's files in its order (``state.json``'s, else sorted by
path). ``chat_records`` (producer/data/chat.py) reads the first record of each file at start and checks it against the
layout (``ChatLayout``): data that cannot be read as configured stops the run (DataError, exit 2) naming the keys it has and
the ``data.*`` keys that fix it, before anything is trained; a record that cannot be read later is a bad record like
any other.

pyarrow reads Parquet and Arrow, and is optional (``pip install 'dflash-stream[parquet]'``); datasets is not needed.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import json
import os
import re
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np

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


class DataError(ValueError):
    """The data cannot be used as configured (a missing or empty file, nothing usable in it): it would fail
    the same way on every try, so the run stops (exit 2). The message names the key and the file."""


class BadRecord(Exception):
    """A record that cannot become a document; the message says why."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def expand_paths(paths: list[str], folders: bool = False) -> list[str]:
    """Paths in the given order, each glob pattern replaced by its sorted matches; with ``folders`` a path may be a
    folder (a dataset folder of chat data)."""
    expanded: list[str] = []
    for path in paths:
        if glob.has_magic(path):
            matches = sorted(glob.glob(path))
            if not matches:
                raise DataError(f"data.paths: no file matches {path!r}")
            expanded.extend(matches)
        elif not (os.path.isfile(path) or (folders and os.path.isdir(path))):
            raise DataError(f"data.paths: data file not found: {path!r}")
        else:
            expanded.append(path)
    return expanded


def index_line_offsets(path: str, chunk_bytes: int = 1 << 24) -> np.ndarray:
    """Byte offsets of line starts plus the file size: line i is ``[off[i], off[i+1])``.

    A final line without a newline is a line; a trailing newline does not start an empty one.
    """
    newline_ends = []
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            newline_ends.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A) + (size + 1))
            size += len(chunk)
    ends = np.concatenate([np.zeros(1, np.int64), *newline_ends]).astype(np.int64)
    if ends[-1] != size:
        ends = np.append(ends, size)
    return ends


class RecordFiles:
    """Global record index over several files, given each file's record count."""

    def __init__(self, paths: list[str], counts: list[int]):
        self.paths = paths
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(file index, record index inside that file)."""
        file_index = bisect.bisect_right(self.starts, sample_id) - 1
        return file_index, sample_id - self.starts[file_index]


_SAMPLED_RECORDS = 100
"""How many records ``Records.sample`` looks at for one that is an object (bad first lines do not hide the layout)."""


class Records(ABC):
    """The records of one file, read at random by their index in it (JSON values: objects for chat data)."""

    def __init__(self, path: str):
        self.path = path

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read(self, index: int) -> Any:
        """The record; raises BadRecord."""

    @abstractmethod
    def location(self, index: int) -> str:
        """Where the record lives, for messages (``file:line``, ``file:row N``)."""

    def sample(self) -> dict[str, Any] | None:
        """The first record that is an object, for the checks at start (None when the first records are not)."""
        for index in range(min(len(self), _SAMPLED_RECORDS)):
            with contextlib.suppress(BadRecord):
                record = self.read(index)
                if isinstance(record, dict):
                    return record
        return None

    def project(self, columns: list[str]) -> None:
        """Read only these columns of a table from now on; a JSON line is read whole."""


class JsonlRecords(Records):
    """The lines of a JSONL file, read at random through an index of line byte offsets (blank lines count)."""

    def __init__(self, path: str):
        super().__init__(path)
        self._offsets = index_line_offsets(path)
        if len(self._offsets) < 2:
            raise DataError(f"data.paths: {path} is empty (no records)")
        # pread on a kept descriptor: no seek state, so reads are safe from several threads.
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def location(self, index: int) -> str:
        return f"{self.path}:{index + 1}"

    def read(self, index: int) -> Any:
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        raw = os.pread(self._fd, end - start, start)
        if not raw.strip():
            raise BadRecord("empty", "blank line")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise BadRecord("invalid_json", str(error)) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()


class FileRecords:
    """The records of several files as one sequence: a sample id is the record's index across the files in order."""

    def __init__(self, files: list[Records]):
        self.files = files
        self._index = RecordFiles([f.path for f in files], [len(f) for f in files])

    def __len__(self) -> int:
        return len(self._index)

    def read(self, sample_id: int) -> Any:
        file_index, index = self._index.locate(sample_id)
        return self.files[file_index].read(index)

    def location(self, sample_id: int) -> str:
        file_index, index = self._index.locate(sample_id)
        return self.files[file_index].location(index)


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


def entry_files(entry: str, split: str | None) -> tuple[str, list[str]]:
    """What one entry of the paths is (a dataset folder's kind, or a file's container) and the files it names."""
    if os.path.isdir(entry):
        return dataset_folder(entry, split)
    return _TABLE_SUFFIXES.get(Path(entry).suffix.lower(), "JSONL"), [entry]

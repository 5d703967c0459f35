"""The run directory's typed JSON records: one base for the status files (common/status.py) and the control files
(common/control.py).

A record is a dataclass written whole (common/rundir.py ``atomic_write_json``): a reader sees the old record or the
new one. ``read`` leaves out the keys of another version of the record, and returns None where there is no file or
where what is there lacks a required field (it is not such a record).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Self

from common.rundir import atomic_write_json, read_json


def known_fields(record: type, data: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``data`` that are fields of the dataclass ``record`` (those of another version left out)."""
    names = {f.name for f in dataclasses.fields(record)}
    return {key: value for key, value in data.items() if key in names}


class JsonRecord:
    DURABLE: ClassVar[bool] = True
    """Whether a write is on disk before it returns (fsync): control files are; live status, rewritten every
    second, is not, so that it never waits behind a checkpoint's write."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.to_json(), durable=self.DURABLE)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Self | None:
        try:
            return cls(**known_fields(cls, data))
        except TypeError:  # a required field is missing
            return None

    @classmethod
    def read(cls, path: Path) -> Self | None:
        data = read_json(path)
        return None if data is None else cls.from_json(data)

"""The held-out split: records of the run's data left out of training for evaluation, the same in every process
(``held_out_ids``), kept in the run's held_out.json from its first start on (``split_held_out``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from common.rundir import atomic_write_json, read_json
from producer.data.files import DataError
from producer.data.sources import DataSource


class SubsetSource(DataSource):
    """The records of ``source`` with the given ids, renumbered ``0 .. len(ids) - 1`` in their order."""

    def __init__(self, source: DataSource, ids: np.ndarray):
        super().__init__(source.config)
        self.source = source
        self.ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def location(self, sample_id: int) -> str:
        return self.source.location(int(self.ids[sample_id]))

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.source._read(int(self.ids[sample_id]))

    def prefetch(self, sample_ids: list[int]) -> None:
        self.source.prefetch([int(self.ids[i]) for i in sample_ids])

    def read_json(self, sample_id: int) -> Any:
        """The raw record (sources of JSON records only)."""
        return self.source.read_json(int(self.ids[sample_id]))


HELD_OUT_SEED = 0x5EED_E7A1
"""Mixed with data.shuffle_seed to pick the held-out records: fixed, so that every process picks the same ones."""


HELD_OUT_MOST = 0.1
"""The largest fraction of a data set held out by default: a small one keeps nine tenths to train on."""


def held_out_ids(num_records: int, count: int, shuffle_seed: int) -> np.ndarray:
    """The ids of the records held out for evaluation, sorted: ``count`` of them, at most a tenth of the data, drawn
    by a fixed seed spread over the whole data set (not its head or tail, which are often one source or length)."""
    count = min(count, int(num_records * HELD_OUT_MOST))
    rng = np.random.default_rng([HELD_OUT_SEED, shuffle_seed])
    return np.sort(rng.choice(num_records, size=count, replace=False))


def split_held_out(
    source: DataSource, count: int, shuffle_seed: int, held_out_file: Path | None = None
) -> tuple[DataSource, DataSource]:
    """(training records, held-out records) of ``source``: disjoint, together all of it, the same in every process.

    With ``held_out_file`` (a run's ``held_out.json``) the ids are the ones it stores, written there at the run's first
    start: a later start or evaluation with another ``eval.num_prompts`` holds out, and evaluates on, the same records
    (never some the run trained on). A file of another data set (another record count) is refused."""
    stored = read_json(held_out_file) if held_out_file is not None else None
    if stored is not None:
        if stored.get("num_records") != len(source):
            raise DataError(
                f"{held_out_file}: the run held out records of a data set of {stored.get('num_records')} "
                f"records, data.paths now holds {len(source)}: evaluate with the run's own data, or "
                "give eval.paths"
            )
        held = np.asarray(stored["ids"], dtype=np.int64)
    else:
        held = held_out_ids(len(source), count, shuffle_seed)
        if held_out_file is not None:
            atomic_write_json(held_out_file, {"num_records": len(source), "ids": held.tolist()})
    kept = np.setdiff1d(np.arange(len(source), dtype=np.int64), held, assume_unique=True)
    return SubsetSource(source, kept), SubsetSource(source, held)

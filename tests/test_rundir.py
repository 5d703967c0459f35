"""The run directory's atomic JSON files (common/rundir.py)."""

from __future__ import annotations

import threading

from common.rundir import atomic_write_json, read_json


def test_threads_of_one_process_write_the_same_status_file_without_failing(tmp_path):
    """Two threads rewriting one file (a producer's status is written by two): every write lands whole, none
    raises. Sharing the temporary name without taking turns, one thread's rename took the other's file
    away under it (FileNotFoundError), which crashed a producer."""
    path = tmp_path / "producers" / "p0.json"
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        try:
            for i in range(200):
                atomic_write_json(path, {"writer": writer, "i": i})
        except BaseException as exc:  # noqa: BLE001 - the test reports whatever a write raised
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert read_json(path)["i"] == 199
    assert sorted(p.name for p in path.parent.iterdir()) == ["p0.json"], "no temporary file left"

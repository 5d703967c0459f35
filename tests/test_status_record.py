"""RUN/trainer.json as one typed record (common/status.py): what the trainer writes is what the launcher reads."""

from __future__ import annotations

import json

from common.status import TrainerStatus


def test_the_record_round_trips_and_a_missing_file_reads_empty(tmp_path):
    path = tmp_path / "trainer.json"
    assert TrainerStatus.read(path) == TrainerStatus() and TrainerStatus.read(path).pid is None
    written = TrainerStatus(pid=7, incarnation=3, state="training", updated=5.0, step=12, kind_metrics={"a": 1.0})
    written.write(path)
    assert TrainerStatus.read(path) == written
    assert json.loads(path.read_text())["step"] == 12  # plain JSON for `run_all.sh status --json` and tools


def test_a_starting_trainer_writes_who_it_is_and_keys_of_another_version_are_left_out(tmp_path):
    path = tmp_path / "trainer.json"
    TrainerStatus.starting(pid=9, incarnation=4, state="taking over").write(path)
    started = TrainerStatus.read(path)
    assert (started.pid, started.incarnation, started.state, started.step) == (9, 4, "taking over", 0)
    path.write_text(json.dumps({"pid": 9, "state": "training", "a_later_field": 1}))
    assert TrainerStatus.read(path).state == "training"

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


def test_control_records_round_trip_and_another_file_reads_as_none(tmp_path):
    from common.control import HandoverMark, RestartRequest, RestartResult, StandbyGo

    path = tmp_path / "control.json"
    assert RestartRequest.read(path) is None  # none yet
    request = RestartRequest("abc", ["training.lr=3e-4"])
    request.write(path)
    assert RestartRequest.read(path) == request
    assert RestartResult.read(path) is None  # a request is no answer: its required fields are missing
    RestartResult("abc", False, error="training.label_mode: fixed").write(path)
    assert RestartResult.read(path).error == "training.label_mode: fixed"
    StandbyGo("12:34").write(path)
    assert StandbyGo.read(path).predecessor == "12:34"
    mark = HandoverMark(pid=1, start_ticks=2, step=3, time=4.0, state={"segments": []})
    mark.write(path)
    assert HandoverMark.read(path) == mark

"""The run's status files as typed records (common/status.py): what a process writes is what the others read."""

from __future__ import annotations

import json
import os

from common.rundir import RunDir
from common.status import ChildRecord, LauncherRecord, ProducerStatus, SynthesisStatus, TrainerStatus


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


def test_producer_statuses_round_trip_and_are_read_by_id(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    assert ProducerStatus.read(run.producer_status(0)) is None and ProducerStatus.read_all(run) == []
    one = ProducerStatus(id=1, pid=11, ready=True, endpoint="ipc://p1", ring={"slots": 4, "free": 4}, jobs={})
    zero = ProducerStatus(id=0, pid=10, torchrun_pid=5, ready=True, jobs={"evaluating": 40}, server={"reclaimed": 2})
    one.write(run.producer_status(1))
    zero.write(run.producer_status(0))
    assert ProducerStatus.read_all(run) == [zero, one]
    on_disk = json.loads(run.producer_status(0).read_text())
    assert on_disk["jobs"] == {"evaluating": 40} and on_disk["server"]["reclaimed"] == 2
    # rank 0 of a tensor-parallel producer writes it; the launcher started the torchrun
    assert zero.written_by(10) and zero.written_by(5) and not zero.written_by(12) and not one.written_by(None)
    run.producer_status(1).write_text(json.dumps({"id": 1, "pid": 11, "a_later_field": 1}))
    assert ProducerStatus.read(run.producer_status(1)) == ProducerStatus(id=1, pid=11)


def test_the_launcher_record_lists_its_children_trainers_first(tmp_path):
    path = tmp_path / "launcher.json"
    assert LauncherRecord.read(path) is None
    record = LauncherRecord(
        pid=os.getpid(),
        state="running",
        producers=[ChildRecord(pid=21, id=0, device="cpu"), ChildRecord(pid=None, id=1)],
        trainer=ChildRecord(pid=30, devices=["cpu"]),
        standby_trainer=ChildRecord(pid=31),
    )
    record.write(path)
    read = LauncherRecord.read(path)
    assert read.updated > 0 and read.producers[0] == ChildRecord(pid=21, id=0, device="cpu")
    assert [child.pid for child in read.children()] == [30, 31, 21]  # the producer not started yet is left out
    path.write_text(json.dumps({"pid": 1, "trainer": {"pid": 2, "a_later_field": 3}, "standby_trainer": None}))
    assert [child.pid for child in LauncherRecord.read(path).children()] == [2]
    path.write_text(json.dumps({"pid": 1, "state": "starting"}))  # written before any child started
    assert LauncherRecord.read(path).trainer == ChildRecord() and LauncherRecord.read(path).children() == []


def test_a_synthesis_status_round_trips_beside_its_shards(tmp_path):
    path = SynthesisStatus.path(tmp_path, 1)
    assert path == tmp_path / "status-p1.json" and SynthesisStatus.read(path) is None
    written = SynthesisStatus(producer=1, written=3, total=8, tokens_per_s=0.27, skipped={"turn_order": 1})
    written.write(path)
    assert SynthesisStatus.read(path) == written

"""trainer.json says "training" again as soon as a checkpoint's synchronous part is done: the launcher starts
a standby trainer only when it reads that state (launch/trainer_slot.py), and with a status written only every
logging.log_every steps it read "checkpointing" until then. A real Trainer on the tiny config."""

from __future__ import annotations

import os
import threading

from common.acceptance import records as evals
from common.rundir import read_json
from tests.test_checkpoint import make_trainer


def test_trainer_json_says_training_right_after_a_checkpoint_while_its_write_goes_on(short_tmp):
    trainer = make_trainer(short_tmp / "run")  # no log_metrics here: only the checkpoint writes the status
    release = threading.Event()
    try:
        trainer.state = "training"
        trainer.step = 3
        states, original_write, original_status = [], trainer.checkpoints._write, trainer.write_status
        trainer.write_status = lambda: (
            original_status(),
            states.append(read_json(trainer.run_dir.trainer_status)["state"]),
        )
        trainer.checkpoints._write = lambda snapshot: (release.wait(60), original_write(snapshot))
        trainer.save_checkpoint()
        assert trainer.checkpoints.writing, "the write goes on in the background"
        assert states == ["checkpointing", "training"], states
        assert read_json(trainer.run_dir.trainer_status)["state"] == "training"
        release.set()
        trainer.checkpoints.wait()
        assert trainer.run_dir.latest_checkpoint().name == "step-00000003"
    finally:
        release.set()
        trainer.close()


def test_the_status_never_waits_for_the_disk_and_the_checkpoint_still_does(short_tmp, monkeypatch):
    """trainer.json is rewritten every few steps while an evaluation is out. Its fsync waited behind the
    background checkpoint's gigabytes: 1.0-1.6 s a step on an H200 host. The status is written without one;
    the checkpoint's files and latest.json, which a restart reads back, still are fsynced."""
    trainer = make_trainer(short_tmp / "run")
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd))
    )
    try:
        trainer.step = 3
        trainer.write_status()
        assert read_json(trainer.run_dir.trainer_status)["step"] == 3
        assert synced == []
        trainer.save_checkpoint(blocking=True)
        assert any("trainer_state.json" in name for name in synced) and any("latest.json" in name for name in synced)
        assert not any("trainer.json" in name for name in synced), synced
    finally:
        trainer.close()


def test_an_evaluation_out_rewrites_the_status_only_when_its_result_comes(short_tmp):
    trainer = make_trainer(short_tmp / "run")
    writes: list[list[int]] = []
    original = trainer.write_status
    trainer.write_status = lambda: (
        original(),
        writes.append(read_json(trainer.run_dir.trainer_status)["evals_in_flight"]),
    )
    try:
        trainer.evals.in_flight.add((8, trainer.incarnation))
        for _ in range(3):  # the loop asks every few steps
            trainer.collect_evaluations()
        assert writes == []
        evals.finish(trainer.run_dir, evals.AcceptanceResult(step=8, incarnation=trainer.incarnation, lost="a test"))
        trainer.collect_evaluations()
        assert writes == [[]], "one write, saying nothing is out any more"
    finally:
        trainer.close()

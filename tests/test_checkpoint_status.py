"""trainer.json says "training" again as soon as a checkpoint's synchronous part is done: the launcher starts
a standby trainer only when it reads that state (launch/supervisor.py), and with a status written only every
logging.log_every steps it read "checkpointing" until then. A real Trainer on the tiny config."""

from __future__ import annotations

import threading

from common.rundir import read_json
from tests.test_checkpoint import make_trainer


def test_trainer_json_says_training_right_after_a_checkpoint_while_its_write_goes_on(short_tmp):
    trainer = make_trainer(short_tmp / "run")  # no log_metrics here: only the checkpoint writes the status
    release = threading.Event()
    try:
        trainer.state = "training"
        trainer.step = 3
        states, original_write, original_status = [], trainer.checkpoints._write, trainer.write_status
        trainer.write_status = lambda: (original_status(), states.append(read_json(trainer.run_dir.trainer_status)["state"]))
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

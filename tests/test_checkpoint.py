"""Checkpoints written in the background (trainer/checkpoint.py) by a real Trainer on the tiny config.

The write is held at a gate while training changes the weights and the optimizer state; the checkpoint
must still hold the state of the step it was taken at, and latest.json must name it only once written.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import load_config, save_config
from common.drafter.export import WEIGHTS_FILE
from common.rundir import RunDir, read_json
from producer.build import load_target
from trainer import checkpoint as checkpoint_module
from trainer import tensor_files
from trainer.checkpoint import HostStaging, read_train_state
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]


def make_trainer(run_dir, *overrides: str) -> Trainer:
    """A Trainer as the trainer process builds it, after a producer exported the target's head."""
    run = RunDir(run_dir)
    run.checkpoints.mkdir(parents=True)
    cfg = load_config(ROOT / "launch" / "tiny.toml", ['logging.wandb_mode="disabled"', *overrides])
    save_config(cfg, run.config)
    load_target(cfg, run, producer_id=0, device=None, group=None)
    return Trainer(cfg, run)


def optimizer_step(trainer: Trainer, seed: int) -> None:
    """An AdamW step with random gradients: moves every weight and every moment."""
    generator = torch.Generator().manual_seed(seed)
    for p in trainer.drafter.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad()


def test_a_background_checkpoint_holds_its_step_while_training_goes_on(short_tmp):
    trainer = make_trainer(short_tmp / "run", 'training.optimizer="adamw"')  # every parameter has AdamW moments
    try:
        run = trainer.run_dir
        optimizer_step(trainer, seed=1)
        trainer.step = 5
        weights_at_5 = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        moments_at_5 = {i: s["exp_avg"].clone() for i, s in trainer.optimizer.state_dict()["state"].items()}

        release, original = threading.Event(), trainer.checkpoints._write
        trainer.checkpoints._write = lambda snapshot: (release.wait(60), original(snapshot))
        trainer.save_checkpoint()
        assert trainer.checkpoints.writing, "save_checkpoint returned while the write is held"
        assert run.latest_checkpoint() is None, "latest.json names nothing before the folder is complete"
        assert read_json(run.trainer_status)["checkpoint_writing"] == "step-00000005", "the status shows the write"

        optimizer_step(trainer, seed=2)  # training goes on: step 6 changes weights and moments in place
        trainer.step = 6
        assert any(not torch.equal(v, trainer.drafter.state_dict()[k]) for k, v in weights_at_5.items())
        release.set()
        trainer.checkpoints.wait()

        latest = run.latest_checkpoint()
        assert latest is not None and latest.name == "step-00000005"
        assert read_json(latest / "trainer_state.json")["step"] == 5
        saved = load_file(str(latest / "drafter" / WEIGHTS_FILE))
        assert saved.keys() == weights_at_5.keys()
        for name, tensor in weights_at_5.items():
            torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
        saved_state = read_train_state(latest)["optimizer"]["state"]
        for index, moment in moments_at_5.items():
            torch.testing.assert_close(saved_state[index]["exp_avg"], moment, rtol=0, atol=0)
        trainer.write_status()
        record = read_json(run.trainer_status)["last_checkpoint"]
        assert record["name"] == "step-00000005" and record["write_s"] > 0 and record["stall_s"] >= 0
    finally:
        trainer.close()


def test_blocking_and_synchronous_checkpoints_are_written_before_the_next_step(short_tmp):
    trainer = make_trainer(short_tmp / "run", "training.async_checkpoint=false")
    try:
        trainer.step = 3
        trainer.save_checkpoint()
        assert not trainer.checkpoints.writing and trainer.run_dir.latest_checkpoint().name == "step-00000003"
        trainer.cfg.training.async_checkpoint = True
        trainer.step = 4
        trainer.save_checkpoint(blocking=True)  # the last step's and a stop's checkpoint
        assert not trainer.checkpoints.writing and trainer.run_dir.latest_checkpoint().name == "step-00000004"
    finally:
        trainer.close()


def test_a_stop_right_after_a_periodic_checkpoint_waits_for_it_and_writes_no_second(short_tmp):
    """A stop that comes in the step of a periodic checkpoint: that background write holds the very state the
    stop's blocking checkpoint would take, so the stop waits for it instead of writing the folder again."""
    trainer = make_trainer(short_tmp / "run")
    try:
        writes, release, original = [], threading.Event(), trainer.checkpoints._write
        trainer.checkpoints._write = lambda snapshot: (
            writes.append(snapshot.name),
            release.wait(60),
            original(snapshot),
        )
        trainer.step = 10
        trainer.save_checkpoint()  # the periodic one, in the background
        assert trainer.checkpoints.writing
        threading.Timer(0.3, release.set).start()
        trainer.save_checkpoint(blocking=True)  # the stop's
        assert writes == ["step-00000010"] and not trainer.checkpoints.writing
        assert trainer.run_dir.latest_checkpoint().name == "step-00000010", "the stop returned after the write"
        trainer.step = 11
        trainer.save_checkpoint(blocking=True)
        assert writes == ["step-00000010", "step-00000011"]
    finally:
        trainer.close()


def assert_same_tree(got, expected, where="train_state"):
    """Bitwise equal trees of dicts, lists and tensors (dtype and shape included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=where)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and list(got) == list(expected), where
        for key in expected:
            assert_same_tree(got[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for index, (a, b) in enumerate(zip(got, expected)):
            assert_same_tree(a, b, f"{where}/{index}")
    else:
        assert got == expected, where


def test_the_train_state_is_written_beside_the_weights_and_read_back_exactly(short_tmp, monkeypatch):
    """Large tensors of the train state go to tensors.safetensors, written by the same threads as the drafter's
    weights (runs that cross from one file into the other); the rest stays in tree.pt. Read back, it is the state
    saved, bit for bit, and checkpoints of the earlier layouts (one train_state.pt; tensors-K.safetensors shards)
    still load."""
    monkeypatch.setattr(checkpoint_module, "INLINE_BYTES", 4096)
    monkeypatch.setattr(tensor_files, "PIECE_BYTES", 16 << 10)
    trainer = make_trainer(short_tmp / "run", "training.async_checkpoint=false", 'training.optimizer="adamw"')
    try:
        optimizer_step(trainer, seed=2)
        trainer.step = 7
        expected = trainer.state_dict(trainer.optimizer.state_dict())
        weights = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
        written: list[list[int]] = []
        original = tensor_files._write_run
        monkeypatch.setattr(
            tensor_files,
            "_write_run",
            lambda fds, run: (written.append(sorted({p.file for p in run})), original(fds, run)),
        )
        trainer.save_checkpoint()
        assert len(written) == tensor_files.WRITE_THREADS and [0, 1] in written, "runs of both files, one crossing"
        folder = trainer.run_dir.latest_checkpoint()
        assert sorted(p.name for p in (folder / "train_state").iterdir()) == ["tensors.safetensors", "tree.pt"]
        state = read_train_state(folder)
        assert_same_tree(state, expected)
        assert_same_tree(
            dict(sorted(load_file(str(folder / "drafter" / WEIGHTS_FILE)).items())),
            dict(sorted(weights.items())),
            "weights",
        )
        inline = torch.load(folder / "train_state" / "tree.pt", weights_only=True)
        assert isinstance(inline["optimizer"]["state"][0]["step"], torch.Tensor), "small tensors stay in the tree"

        sharded = folder.parent / "step-00000002" / "train_state"
        sharded.mkdir(parents=True)
        tensors = load_file(str(folder / "train_state" / "tensors.safetensors"))
        names = sorted(tensors)
        for index in range(2):
            save_file({k: tensors[k] for k in names[index::2]}, str(sharded / f"tensors-{index}.safetensors"))
        torch.save(inline, sharded / "tree.pt")
        assert_same_tree(read_train_state(sharded.parent), expected)
    finally:
        trainer.close()


def test_latest_never_goes_back_to_an_earlier_step(short_tmp):
    """A write of an earlier step that ends after a later one's (a superseded write of a trainer that handed its
    state over, ending under its successor's) is kept as a folder but never named by latest.json."""
    trainer = make_trainer(short_tmp / "run", "training.keep_last=3")
    try:
        trainer.step = 16
        trainer.save_checkpoint(blocking=True)
        trainer.step = 8
        trainer.save_checkpoint(blocking=True)
        assert (trainer.run_dir.checkpoints / "step-00000008" / "trainer_state.json").is_file()
        assert trainer.run_dir.latest_checkpoint().name == "step-00000016"
        trainer.step = 24
        trainer.save_checkpoint(blocking=True)
        assert trainer.run_dir.latest_checkpoint().name == "step-00000024"
    finally:
        trainer.close()


def test_latest_advances_where_the_filesystem_has_no_flock(tmp_path, monkeypatch):
    """Checkpoints on NFS or Lustre without flock: advancing latest.json still works (unlocked), never raises."""
    import errno
    import fcntl

    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    (run.checkpoints / "step-00000004").mkdir()

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    assert run.advance_latest("step-00000004", 4)
    assert not run.advance_latest("step-00000002", 2)
    assert read_json(run.checkpoints / "latest.json") == {"name": "step-00000004", "step": 4}


@pytest.mark.gpu
def test_host_staging_copies_cuda_tensors_into_reused_page_locked_buffers():
    staging = HostStaging()
    tree = {
        "w": torch.randn(64, 32, device="cuda"),
        "state": {0: {"step": torch.tensor(3.0), "m": torch.randn(7, device="cuda")}},
        "lr": 1e-3,
    }
    first = staging.copy(tree, "t")
    assert first["w"].is_pinned() and first["w"].device.type == "cpu" and first["lr"] == 1e-3
    torch.testing.assert_close(first["w"], tree["w"].cpu(), rtol=0, atol=0)
    tree["w"].add_(1.0)
    assert not torch.equal(first["w"], tree["w"].cpu()), "a copy, not a view of the device tensor"
    second = staging.copy(tree, "t")
    assert second["w"].data_ptr() == first["w"].data_ptr(), "the buffer is reused"
    torch.testing.assert_close(second["w"], tree["w"].cpu(), rtol=0, atol=0)
    assert second["state"][0]["step"] is not tree["state"][0]["step"], "CPU tensors are cloned"

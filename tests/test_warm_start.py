"""The warm start (trainer/warm.py) a takeover builds ahead, and the trainer's wandb run started in the
background (trainer/wandb_run.py). The takeover that uses both is tests/test_handover.py's."""

from __future__ import annotations

import threading

import pytest
import torch

from common.config import load_config
from common.drafter.export import drafter_from_state, zlab_config
from common.drafter.loss import LossConfig
from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import random_batch, random_head, tiny_config
from trainer.build import WarmStart
from trainer.wandb_run import BackgroundRun
from trainer.warm import synthetic_batch


def warm_start(cfg=None) -> WarmStart:
    cfg = cfg or load_config(None, ["training.compile=false"])
    config = tiny_config()
    head = random_head(config)
    torch.manual_seed(123)  # another initialisation than the state's: loading must replace all of it
    drafter = DFlashDrafter(config, head)
    return WarmStart(cfg, torch.device("cpu"), None, head, "identity", config, drafter, compiled=False, seconds=0.0)


def trained_weights(config, head) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    drafter = DFlashDrafter(config, head)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return {k: v.clone() for k, v in drafter.state_dict().items()}


def test_the_warm_drafter_takes_the_state_and_computes_what_a_drafter_built_from_it_computes():
    warm = warm_start()
    weights = trained_weights(warm.draft_config, warm.head)
    loss_config = LossConfig(gamma=3.0)
    drafter = warm.drafter_for(warm.draft_config, weights, loss_config)
    assert drafter is warm.drafter and drafter.loss_config is loss_config
    reference = drafter_from_state(zlab_config(warm.draft_config, torch.float32), weights, warm.head, loss_config)
    batch = random_batch([20, 12], warm.draft_config)
    losses = []
    for model in (drafter, reference):
        loss, _ = model.forward_train(batch, 4, torch.Generator().manual_seed(1))
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for name, value in reference.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], value), name


def test_the_warm_drafter_refuses_another_architecture_or_dtype():
    warm = warm_start()
    weights = trained_weights(warm.draft_config, warm.head)
    other = tiny_config(block_size=8)
    assert warm.drafter_for(other, weights, LossConfig()) is None
    assert (
        warm.drafter_for(warm.draft_config, {k: v.to(torch.bfloat16) for k, v in weights.items()}, LossConfig()) is None
    )


def test_a_warm_start_fits_only_the_configuration_that_would_build_it():
    warm = warm_start()
    cpu = torch.device("cpu")
    assert warm.fits(load_config(None, ["training.compile=false", "training.lr=1e-5", "training.gamma=2.0"]), cpu)
    assert not warm.fits(load_config(None, ["training.compile=false", "drafter.num_layers=3"]), cpu)
    assert not warm.fits(load_config(None, ["training.compile=true"]), cpu)
    assert not warm.fits(load_config(None, ["training.compile=false", 'target.dtype="float32"']), cpu)
    assert not warm.fits(load_config(None, ["training.compile=false"]), torch.device("cuda", 0))


def test_the_synthetic_batch_has_the_shapes_a_compiled_trainer_is_fed():
    cfg = load_config(
        None,
        [
            "data.max_seq_len=96",
            "data.mean_len=48",
            "batching.token_budget=96",
            'training.label_mode="target_soft"',
            'target.dtype="bfloat16"',
        ],
    )
    config = tiny_config()
    batch = synthetic_batch(cfg, config, torch.device("cpu"))
    assert batch.num_tokens == 96 and batch.aux_hidden.shape == (96, config.fused_feature_size)
    assert batch.aux_hidden.dtype == torch.bfloat16 and batch.last_hidden.shape == (96, config.target_hidden_size)
    assert int(batch.loss_mask.sum()) == 95 and batch.cu_seqlens.tolist() == [0, 96]


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int | None]] = []
        self.finished = False

    def log(self, data, step=None):
        self.logged.append((data, step))

    def finish(self):
        self.finished = True


def test_what_is_logged_before_wandb_is_up_arrives_in_order():
    release, run = threading.Event(), FakeRun()

    def slow_init():
        release.wait(10)
        return run

    background = BackgroundRun(slow_init)
    for step in range(3):
        background.log({"loss": float(step)}, step=step)  # returns at once: init still waits
    assert run.logged == []
    release.set()
    background.log({"loss": 3.0}, step=3)
    background.finish()
    assert [step for _, step in run.logged] == [0, 1, 2, 3] and run.finished


def test_a_wandb_start_that_fails_stops_at_the_next_log():
    def failing_init():
        raise ValueError("no such project")

    background = BackgroundRun(failing_init)
    assert background.wait() is None
    with pytest.raises(RuntimeError, match="no such project"):
        background.log({"loss": 1.0}, step=1)
    background.finish()  # nothing to finish

"""The learning-rate schedules: cosine and warmup-stable-decay."""

import math

import pytest

from common.config import ConfigError, load_config
from trainer.optim import lr_lambda


def factors(*overrides: str, steps: int = 100) -> list[float]:
    cfg = load_config(None, ["training.warmup_ratio=0.1", *overrides])
    factor = lr_lambda(cfg, steps)
    return [factor(step) for step in range(steps + 1)]


def test_cosine_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    lr = factors("training.min_lr_ratio=0.1")
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    middle = 10 + 45
    assert lr[middle] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr[100] == pytest.approx(0.1)


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_decay_ratio():
    lr = factors("training.schedule=\"wsd\"", "training.decay_ratio=0.2", "training.min_lr_ratio=0.0")
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert all(f == 1.0 for f in lr[10:81])  # stable until step 80 of 100
    assert lr[90] == pytest.approx(0.5) and lr[100] == 0.0
    assert all(a > b for a, b in zip(lr[80:100], lr[81:101]))
    # The same steps on the cosine are lower in the middle of the run: the schedules differ.
    assert factors()[50] < 0.8


def test_bad_schedule_fields_name_the_field():
    with pytest.raises(ConfigError, match="schedule"):
        load_config(None, ["training.schedule=\"linear\""])
    with pytest.raises(ConfigError, match="decay_ratio"):
        load_config(None, ["training.decay_ratio=0"])
    with pytest.raises(ConfigError, match="optimizer"):
        load_config(None, ["training.optimizer=\"muon\"", "training.parallelism=\"fsdp\""])

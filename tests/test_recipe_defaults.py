"""The recipe's defaults for new runs (D-PACE weighting, Muon)."""

import pytest

from common.config import ConfigError, load_config, save_config, to_toml


def test_new_runs_train_with_dpace_and_muon_and_fsdp_with_adamw():
    cfg = load_config(None)
    assert cfg.training.weighting == "dpace" and cfg.training.resolved_optimizer == "muon"
    assert load_config(None, ['training.parallelism="fsdp"']).training.resolved_optimizer == "adamw"
    assert load_config(None, ['training.optimizer="adamw"']).training.resolved_optimizer == "adamw"
    # the fallback is said, where the trainer starts and in check, unless the run names its optimizer
    assert "Muon is not sharded" in load_config(None, ['training.parallelism="fsdp"']).training.optimizer_fallback
    assert (
        load_config(None, ['training.parallelism="fsdp"', 'training.optimizer="adamw"']).training.optimizer_fallback
        is None
    )
    assert load_config(None, []).training.optimizer_fallback is None


def test_a_config_of_a_format_1_run_is_refused_naming_its_key(tmp_path):
    """Configs saved before training.weighting and training.optimizer held training.streak_aware; their runs are
    format 1 (refused as a whole, common/rundir.py), and such a file names its unknown key."""
    today = to_toml(load_config(None))
    (tmp_path / "config.toml").write_text(today.replace('weighting = "dpace"', "streak_aware = false"))
    with pytest.raises(ConfigError, match="streak_aware"):
        load_config(tmp_path / "config.toml")


def test_a_run_saved_now_reads_back_with_its_own_settings(tmp_path):
    save_config(load_config(None, ['training.weighting="streak"']), tmp_path / "config.toml")
    cfg = load_config(tmp_path / "config.toml")
    assert cfg.training.weighting == "streak" and cfg.training.resolved_optimizer == "muon"


def test_every_recipe_of_the_recipe_table_is_a_valid_config_on_the_preset():
    """launch.bench.recipes hands each recipe's overrides to a training run of the SmolLM2 preset: a misspelt key or
    value there would fail on the GPU, minutes into a batch, so it fails here instead."""
    from launch.bench.recipes import RECIPES, overrides_of

    for name in RECIPES:
        run_name, overrides = overrides_of(f"{name}+former@1")
        assert run_name == f"{name}+former-s1" and overrides[-1] == "training.seed=1"
        cfg = load_config("launch/smollm2-135m.toml", overrides)
        assert cfg.training.seed == 1
    assert load_config("launch/smollm2-135m.toml", overrides_of("layers3")[1]).drafter.num_layers == 3
    assert load_config("launch/smollm2-135m.toml", overrides_of("lr_double")[1]).training.lr == 2.4e-3
    former_step = load_config("launch/smollm2-135m.toml", overrides_of("step16k+layers5")[1])
    assert (
        former_step.batching.token_budget,
        former_step.drafter.num_anchors,
        former_step.drafter.num_layers,
        former_step.training.lr,
    ) == (16384, 512, 5, 6e-4)


def test_a_recipe_may_name_its_own_steps_over_the_common_ones():
    """``step16k:2000`` trains 2,000 steps where the call's --steps says 800: the quality run puts the recipe's
    overrides after its own training.max_steps, and the later setting wins."""
    from launch.bench.recipes import overrides_of

    name, overrides = overrides_of("step16k:2000@1")
    assert name == "step16k-2000steps-s1"
    cfg = load_config("launch/smollm2-135m.toml", ["training.max_steps=800", *overrides])
    assert (cfg.training.max_steps, cfg.batching.token_budget, cfg.drafter.num_anchors) == (2000, 16384, 512)
    assert overrides_of("step16k@1")[0] == "step16k-s1"


def test_an_unknown_recipe_stops_naming_it():
    from launch.bench.recipes import overrides_of

    with pytest.raises(SystemExit, match="unknown recipe 'layers4'"):
        overrides_of("dpace+layers4")

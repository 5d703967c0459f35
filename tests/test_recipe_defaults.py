"""The recipe's defaults for new runs (D-PACE weighting, Muon), and older runs keeping theirs."""

from common.config import load_config, save_config, to_toml


def test_new_runs_train_with_dpace_and_muon_and_fsdp_with_adamw():
    cfg = load_config(None)
    assert cfg.training.weighting == "dpace" and cfg.training.resolved_optimizer == "muon"
    assert load_config(None, ['training.parallelism="fsdp"']).training.resolved_optimizer == "adamw"
    assert load_config(None, ['training.optimizer="adamw"']).training.resolved_optimizer == "adamw"


def test_a_run_saved_before_the_recipe_change_keeps_its_recipe(tmp_path):
    """Every saved config from before held training.streak_aware and no weighting or optimizer: it reads back as
    the recipe it was trained with (decay or streak, AdamW), not as today's defaults."""
    today = to_toml(load_config(None))
    older = today.replace('weighting = "dpace"', "streak_aware = false").replace('optimizer = "auto"\n', "")
    assert "streak_aware" in older and "optimizer =" not in older.split("[training]")[1].split("[")[0]
    (tmp_path / "config.toml").write_text(older)
    cfg = load_config(tmp_path / "config.toml")
    assert cfg.training.weighting == "decay" and cfg.training.resolved_optimizer == "adamw"
    (tmp_path / "config.toml").write_text(older.replace("streak_aware = false", "streak_aware = true"))
    assert load_config(tmp_path / "config.toml").training.weighting == "streak"
    # Saved again, it states its recipe, and reads back the same.
    save_config(cfg, tmp_path / "again.toml")
    again = load_config(tmp_path / "again.toml").training
    assert (again.weighting, again.optimizer) == ("decay", "adamw")


def test_a_run_saved_now_reads_back_with_its_own_settings(tmp_path):
    save_config(load_config(None, ['training.weighting="streak"']), tmp_path / "config.toml")
    cfg = load_config(tmp_path / "config.toml")
    assert cfg.training.weighting == "streak" and cfg.training.resolved_optimizer == "muon"

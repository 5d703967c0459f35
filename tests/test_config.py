"""Config tree: TOML + dotted overrides, errors that name the key, resolved config round trip."""

import pytest

from common.config import ConfigError, RunConfig, load_config, save_config, to_dict


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_file_and_overrides(tmp_path):
    path = _write(tmp_path, '[training]\nlr = 1e-3\n[data]\nformat = "synthetic"\nmean_len = 100\n')
    cfg = load_config(
        path,
        [
            "training.lr=2e-4",
            "launch.num_producers=3",
            'launch.producer_devices=["cuda:0", "cuda:1"]',
            "data.tokenizer=/some/path",
        ],
    )
    assert cfg.training.lr == 2e-4
    assert cfg.data.mean_len == 100
    assert cfg.launch.num_producers == 3 and cfg.launch.producer_devices == ["cuda:0", "cuda:1"]
    assert cfg.data.tokenizer == "/some/path"  # not TOML: taken as a string
    assert cfg.drafter.block_size == RunConfig().drafter.block_size


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "target.config_overrides={num_hidden_layers = 3}",
            "drafter.layer_types=[\"sliding_attention\", \"full_attention\"]",
            "drafter.num_layers=2",
            "drafter.sliding_window=64",
        ],
    )
    save_config(cfg, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize(
    "override, key",
    [
        ("training.lr=-1", "training.lr"),
        ("training.lr=\"fast\"", "training.lr"),
        ("training.nope=1", "training.nope"),
        ("nosection.x=1", "nosection"),
        ("ring.heartbeat_timeout_s=0.5", "ring.heartbeat_timeout_s"),
        ("data.format=csv", "data.format"),
        ("logging.progress=1", "logging.progress"),
        ("drafter.layer_types=[\"full_attention\"]", "drafter.layer_types"),
        ("batching.token_budget=100", "batching.token_budget"),
        ("launch.producer_devices=[1, 2]", "launch.producer_devices[0]"),
        ("launch.mps_producer_sm_percent=40", "launch.mps_producer_sm_percent"),  # without launch.mps
        ("launch.mps_trainer_sm_percent=80", "launch.mps_trainer_sm_percent"),  # without launch.mps
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, [override])


def test_missing_file_and_bad_toml_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="run.toml"):
        load_config(_write(tmp_path, "[training\nlr = 1"))
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["justtext"])


def test_an_sm_share_out_of_range_names_the_key():
    with pytest.raises(ConfigError, match=r"launch.mps_producer_sm_percent.*1..100, got 0"):
        load_config(None, ["launch.mps=true", "launch.mps_producer_sm_percent=0"])
    with pytest.raises(ConfigError, match=r"launch.mps_trainer_sm_percent.*1..100, got 101"):
        load_config(None, ["launch.mps=true", "launch.mps_trainer_sm_percent=101"])


def test_a_key_typo_suggests_the_closest_key_and_names_the_file_it_is_in(tmp_path):
    path = _write(tmp_path, '[training]\nlr = 1e-3\n[batching]\ntoken_budgte = 4096\n')
    with pytest.raises(
        ConfigError, match=rf"^{path}: unknown key batching.token_budgte \(did you mean batching.token_budget\?"
    ):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^unknown key training.lrr \(did you mean training.lr\?"):
        load_config(None, ["training.lrr=1"])  # on the command line: no file to name
    with pytest.raises(ConfigError, match=r"^unknown key training.zzzz \(known keys of training: "):
        load_config(None, ["training.zzzz=1"])  # nothing close: no guess
    with pytest.raises(ConfigError, match="target.path: /nonexistent/model does not exist"):
        load_config(None, ["target.path=/nonexistent/model"])


def test_a_saved_config_with_the_retired_pause_keys_still_resumes(tmp_path):
    """Earlier versions saved training.stall_every_steps and stall_s into every run's config.toml: such a run resumes.
    As an override they are unknown keys (the pause is DFLASH_FAULT_DELAY's now)."""
    saved = _write(tmp_path, "[training]\nlr = 0.001\nstall_every_steps = 0\nstall_s = 0.0\n")
    assert load_config(saved).training.lr == 0.001
    with pytest.raises(ConfigError, match="unknown key training.stall_s"):
        load_config(None, ["training.stall_s=1.0"])


def test_a_kinds_options_are_its_own_table_and_round_trip(tmp_path):
    cfg = load_config(None, ['drafter.kind="dflash2"', "drafter.dflash2.selector_rank=64"])
    assert cfg.drafter.options.selector_rank == 64 and cfg.drafter.options.selector_top_k == 16
    save_config(cfg, tmp_path / "c.toml")
    text = (tmp_path / "c.toml").read_text()
    assert "[drafter.dflash2]\n" in text and "selector_rank = 64" in text
    assert to_dict(load_config(tmp_path / "c.toml")) == to_dict(cfg)


def test_a_run_saved_with_flat_kind_options_still_loads(tmp_path):
    """Runs saved before the kinds had tables wrote every kind's options flat in [drafter], at their defaults for
    the kinds they were not: each loads as it trained."""
    saved = tmp_path / "old.toml"
    saved.write_text(
        '[drafter]\nkind = "dflash2"\nselector_rank = 32\nselector_top_k = 8\nconv_kernel_size = 2\n'
        'selector_missing_gold = "exclude"\n'
    )
    options = load_config(saved).drafter.options
    assert (options.selector_rank, options.selector_top_k, options.selector_missing_gold) == (32, 8, "exclude")
    saved.write_text("[drafter]\nselector_rank = 256\nconv_group_size = 16\n")  # a DFlash run of then
    assert load_config(saved).drafter.kind == "dflash"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (['drafter.kind="dflash"', "drafter.dflash2.selector_rank=8"], "drafter.dflash2: options of the dflash2 kind"),
        (["drafter.selector_rank=8"], "drafter.selector_rank: an option of the dflash2 kind, given to a dflash"),
        (['drafter.kind="dflash2"', "drafter.dflash2.selector_rank=0"], "drafter.dflash2.selector_rank: must be"),
        (['drafter.kind="dflash2"', "drafter.dflash2.selector_rnak=8"], "unknown key drafter.dflash2.selector_rnak"),
        (['drafter.kind="dflash9"'], "drafter.kind: must be one of"),
    ],
)
def test_a_kinds_options_given_wrong_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_restart_trainer_may_change_a_kinds_training_options_not_its_shape():
    from launch import runs

    old = load_config(None, ['drafter.kind="dflash2"'])
    new = load_config(None, ['drafter.kind="dflash2"', "drafter.dflash2.selector_loss_alpha=0.5"])
    assert runs.changed_keys(old, new) == ["drafter.dflash2.selector_loss_alpha"]
    assert runs.refused_trainer_changes(runs.changed_keys(old, new)) == []
    new = load_config(None, ['drafter.kind="dflash2"', "drafter.dflash2.selector_rank=64"])
    assert "drafter.dflash2.selector_rank cannot change" in " ".join(
        runs.refused_trainer_changes(runs.changed_keys(old, new))
    )


def test_a_saved_runs_kind_table_at_its_defaults_gives_way_to_another_kind(tmp_path):
    """A run saved as DFlash 2 with its options at their defaults, resumed asking for DFlash: the table is dropped,
    so that the checkpoint's own kind check names the key (trainer/build.py)."""
    cfg = load_config(None, ['drafter.kind="dflash2"'])
    save_config(cfg, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml", ['drafter.kind="dflash"']).drafter.kind == "dflash"
    assert "[drafter.dflash]" not in to_toml_of(load_config(None))  # a kind without options writes no table


def to_toml_of(cfg) -> str:
    from common.config import to_toml

    return to_toml(cfg)

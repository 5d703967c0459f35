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

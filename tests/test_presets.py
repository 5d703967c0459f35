"""Every preset as a user runs it on their own model: only target.path and data.paths changed, the run's data resolves
(training records and the held-out split); a preset never names a file of its authors' machine. A missing held-out
file is named by the key the user wrote."""

from __future__ import annotations

import glob
import json
import logging
from pathlib import Path

import pytest

from common.config import load_config
from producer.data.build import run_sources
from producer.data.files import DataError

ROOT = Path(__file__).resolve().parents[1]
PRESETS = sorted(Path(p).name for p in glob.glob(str(ROOT / "launch" / "*.toml")))


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            messages = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_reads_the_users_data_with_only_target_and_data_paths_changed(preset, chat_file):
    from tests.real_model import smollm2_folder

    target = smollm2_folder()  # a real tokenizer and chat template; the presets' own sizes are not read here
    cfg = load_config(ROOT / "launch" / preset, [f'target.path="{target}"', f'data.paths=["{chat_file}"]'])
    if cfg.data.format == "synthetic":
        pytest.skip("the embedded default makes its own data: no data.paths to give")
    train, held = run_sources(cfg, 49152)
    assert len(train) + len(held) == 200 and len(held) > 0
    # and `check`, the walkthrough's first step, reports on it: the drafter, the optimizer, good records
    from launch.check import check

    report, figures = check(cfg, sample=50, color=False)
    assert figures["good"] == 50 and figures["held_out"] == len(held)
    assert f"optimizer: {cfg.training.resolved_optimizer} (" in report


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_of_several_trainer_ranks_names_the_optimizer_it_runs(preset):
    """training.optimizer "auto" resolves by the parallelism (adamw under FSDP): a preset of several trainer ranks
    says which it runs, so that no text credits it with a recipe it does not train."""
    import tomllib

    settings = tomllib.loads((ROOT / "launch" / preset).read_text())
    if len(settings.get("launch", {}).get("trainer_devices", [])) > 1:
        assert settings.get("training", {}).get("optimizer") in ("adamw", "muon"), preset


def test_check_names_the_optimizer_an_fsdp_config_runs_and_why(capsys, chat_file):
    from launch.check import main
    from tests.real_model import smollm2_folder

    common = [f'target.path="{smollm2_folder()}"', f'data.paths=["{chat_file}"]', "--sample", "20"]
    assert main(["--config", str(ROOT / "launch" / "qwen3-8b-1gpu.toml"), *common, 'training.parallelism="fsdp"']) == 0
    out = capsys.readouterr().out
    assert "optimizer: adamw (AdamW for every trained weight)" in out and "Muon is not sharded" in out
    assert main(["--config", str(ROOT / "launch" / "qwen3-8b-8gpu.toml"), *common]) == 0
    assert 'optimizer: adamw (AdamW for every trained weight): training.optimizer = "adamw"' in capsys.readouterr().out
    assert main(["--config", str(ROOT / "launch" / "qwen3-8b-1gpu.toml"), *common]) == 0
    assert "optimizer: muon (Muon for the drafter's weight matrices" in capsys.readouterr().out
    # check quiets the data's warnings while it runs only: the batch plan's warnings still reach a later caller
    assert logging.getLogger("producer.data.batching").isEnabledFor(logging.WARNING)


def test_a_missing_held_out_file_is_named_as_eval_paths(tmp_path, chat_file):
    from tests.real_model import smollm2_folder

    overrides = [
        f'target.path="{smollm2_folder()}"',
        f'data.paths=["{chat_file}"]',
        f'eval.paths=["{tmp_path / "eval.jsonl"}"]',
    ]
    cfg = load_config(ROOT / "launch" / "qwen3-8b-1gpu.toml", overrides)
    with pytest.raises(DataError, match=r"^eval\.paths: data file not found"):
        run_sources(cfg, 49152)

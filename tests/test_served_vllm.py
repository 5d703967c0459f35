"""An export served by a real server: vLLM's CPU build (launch/setup_vllm.sh makes .venv-vllm) counts the same drafts,
the same accepted tokens per position and generates the same tokens as our evaluator and live decoder
(launch/bench/served.py).

The served test loads vLLM (a minute or two on two cores): it is marked ``served`` and runs only when asked for,
``pytest -m served tests/test_served_vllm.py``, and skips, saying why, without .venv-vllm. The other tests here check
the program's own arithmetic and run by default in well under a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bench import served

ROOT = Path(__file__).resolve().parents[1]


def test_counts_are_vllms_per_position_counters():
    # Four verify forwards that accepted 2, 0, 3 and 1 drafts of a block of 4 (3 drafted tokens each).
    counts = served.counts_of([2, 0, 3, 1], block_size=4)
    assert counts == {"drafts": 4, "draft_tokens": 12, "accepted_per_pos": [3, 2, 1]}
    assert served.tau_of(counts) == 1 + 6 / 4


def test_any_difference_is_named():
    vllm = {"drafts": 4, "draft_tokens": 12, "accepted_per_pos": [3, 2, 1], "tokens": [[5, 6], [7]]}
    assert served.differences(vllm, dict(vllm), "evaluator") == []
    shifted = {**vllm, "accepted_per_pos": [3, 1, 1], "tokens": [[5, 6], [8]]}
    found = served.differences(vllm, shifted, "evaluator")
    assert found == [
        "accepted_per_pos: vLLM [3, 2, 1], evaluator [3, 1, 1]",
        "generated tokens differ for prompts [1] (evaluator)",
    ]
    assert "accepted at pos 3" in served.table({"vLLM": vllm, "evaluator": shifted}, 4)


def test_prompt_formats(tmp_path):
    from tests.real_model import smollm2_folder

    folder = smollm2_folder()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            [
                json.dumps(
                    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "dropped"}]}
                ),
                json.dumps({"prompt": "Once upon a time"}),
                json.dumps({"prompt_token_ids": [1, 2, 3]}),
                "a line of text",
            ]
        )
        + "\n"
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = served.read_prompts(prompts, folder, None)
    assert ids[0] == tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert ids[1:] == [tokenizer("Once upon a time")["input_ids"], [1, 2, 3], tokenizer("a line of text")["input_ids"]]
    assert served.read_prompts(prompts, folder, 2) == ids[:2]


def test_without_the_vllm_venv_it_says_how_to_make_it(tmp_path, capsys):
    code = served.main(
        [
            "--target",
            str(tmp_path),
            "--draft",
            str(tmp_path),
            "--prompts",
            str(tmp_path / "p.jsonl"),
            "--vllm-python",
            str(tmp_path / "no-venv" / "python"),
        ]
    )
    assert code == 2 and "launch/setup_vllm.sh" in capsys.readouterr().err


def random_export(out: Path, target_folder: Path, block_size: int) -> Path:
    """A randomly initialised one-layer drafter of SmolLM2 in the z-lab format (every draft is rejected: the check is
    then of the drafts and the tokens; DFLASH_SERVED_DRAFT names a trained export to check acceptances too)."""
    import torch
    from transformers import AutoConfig

    from common.config import TargetConfig
    from common.drafter.draft_config import DraftConfig
    from common.drafter.export import export_zlab
    from common.drafter.model import DFlashDrafter
    from producer.target import load_target_model
    from producer.verify import target_head_of

    config = DraftConfig.from_target(
        AutoConfig.from_pretrained(target_folder), num_draft_layers=1, mask_token_id=16, block_size=block_size
    )
    head = target_head_of(load_target_model(TargetConfig(path=str(target_folder), dtype="float32", device="cpu")))
    torch.manual_seed(0)
    return export_zlab(DFlashDrafter(config, head), out)


@pytest.mark.served
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serves_an_export_as_our_evaluator_decodes_it(tmp_path):
    if not served.VLLM_PYTHON.is_file():
        pytest.skip("needs vLLM's CPU build in .venv-vllm: run launch/setup_vllm.sh")
    from tests.real_model import smollm2_folder

    folder = smollm2_folder()  # head_dim 64: vLLM's CPU attention refuses the tiny default's 16
    draft = (
        Path(os.environ["DFLASH_SERVED_DRAFT"])
        if os.environ.get("DFLASH_SERVED_DRAFT")
        else random_export(tmp_path / "draft", folder, block_size=8)
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n"
            for text in ("What is 17 times 23?", "Write a haiku about autumn.")
        )
    )
    out = tmp_path / "served.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.bench.served",
            "--target",
            str(folder),
            "--draft",
            str(draft),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=840,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary["equal"] and summary["differences"] == []
    vllm, ours = summary["vLLM"], summary["evaluator"]
    block_size = summary["block_size"]
    assert vllm["drafts"] == ours["drafts"] == summary["live"]["drafts"] > 0
    assert vllm["draft_tokens"] == vllm["drafts"] * (block_size - 1)
    assert vllm["accepted_per_pos"] == ours["accepted_per_pos"] and len(vllm["accepted_per_pos"]) == block_size - 1
    assert vllm["generated_tokens"] == ours["generated_tokens"] > 0

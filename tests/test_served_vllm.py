"""An export served by a real server: vLLM's CPU build (launch/setup_vllm.sh makes .venv-vllm) counts the same drafts,
the same accepted tokens per position and generates the same tokens as our evaluator, live decoder and z-lab's decoder
(launch/bench/served, ``--server vllm``).

The test loads vLLM (a minute or two on two cores): it is marked ``served`` and runs only when asked for,
``pytest -m served tests/test_served_vllm.py``, and skips, saying why, without .venv-vllm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.bench.served import vllm_worker

ROOT = Path(__file__).resolve().parents[1]


def random_export(out: Path, target_folder: Path, block_size: int) -> Path:
    """A randomly initialised one-layer drafter of SmolLM2 in the z-lab format (every draft is rejected: the check is
    then of the drafts and the tokens; DFLASH_SERVED_DRAFT names a trained export to check acceptances too)."""
    import torch
    from transformers import AutoConfig

    from common.config import TargetConfig
    from common.drafter.draft_config import DraftConfig
    from common.drafter.export import export_zlab
    from common.drafter.model import DFlashDrafter
    from producer.target_model.load import load_target_model, target_head_of

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
    if not vllm_worker.VLLM_PYTHON.is_file():
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
            "--server",
            "vllm",
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
    assert summary["agrees"] and summary["differences"] == []
    sides = summary["sides"]
    vllm, ours = sides["vLLM"]["as_run"], sides["evaluator"]["as_run"]
    block_size = summary["block_size"]
    assert vllm["drafts"] == ours["drafts"] == sides["live"]["as_run"]["drafts"] > 0
    assert vllm["draft_tokens"] == vllm["drafts"] * (block_size - 1)
    assert vllm["accepted_per_pos"] == ours["accepted_per_pos"] and len(vllm["accepted_per_pos"]) == block_size - 1
    assert sides["vLLM"]["generated_tokens"] == sides["evaluator"]["generated_tokens"] > 0
    assert sides["z-lab"]["on_schedule"] == sides["evaluator"]["on_schedule"]

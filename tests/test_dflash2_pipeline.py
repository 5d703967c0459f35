"""DFlash 2 through the whole pipeline, in real processes: a run trains, evaluates and exports a DFlash 2 drafter
with its selector metrics in metrics.jsonl and the status; a new run starts from a DFlash checkpoint; a checkpoint
resumed as the other kind, a selector_top_k above the vocabulary and a cut vocabulary stop at once (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from common.drafter.dflash2.model import DFlash2KindHead
from common.drafter.export import load_drafter
from common.drafter.target_head import TargetHead
from tests.drafter_fixtures import tiny_qwen3_target
from tests.test_first_day import stops_with_2
from tests.test_pipeline import ONE_PRODUCER, finish, start

ROOT = Path(__file__).resolve().parents[1]
DFLASH2 = ('drafter.kind="dflash2"', "drafter.dflash2.selector_rank=16", "drafter.dflash2.selector_top_k=8")


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))


def test_a_dflash2_run_trains_evaluates_exports_and_a_dflash_checkpoint_starts_one(short_tmp):
    dflash_run = short_tmp / "dflash"
    finish(start(dflash_run, *ONE_PRODUCER, "training.max_steps=8", "eval.every_steps=0"), dflash_run)
    dflash_checkpoint = _checkpoints(dflash_run)[-1]

    run_dir = short_tmp / "run"
    finish(
        start(
            run_dir,
            *ONE_PRODUCER,
            *DFLASH2,
            "training.max_steps=16",
            "eval.every_steps=16",
            "eval.num_prompts=2",
            "eval.max_new_tokens=8",
            f"drafter.init_from={json.dumps(str(dflash_checkpoint))}",
        ),
        run_dir,
    )
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "starts from the dflash drafter" in trainer_log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    for key in ("unary_tau", "selector/recall", "selector/accuracy", "selector/loss"):
        assert all(key in m for m in trained), key
    assert 0.0 <= trained[-1]["selector/accuracy"] <= trained[-1]["selector/recall"] <= 1.0
    assert any("eval/tau" in m for m in metrics)  # producer 0 decoded with the selector's walk
    status = json.loads((run_dir / "trainer.json").read_text())
    assert status["kind"] == "dflash2" and set(status["kind_metrics"]) == set(DFlash2KindHead.logged_metrics)
    shown = subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), "status", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "dflash2   unary_tau " in shown and "selector/recall " in shown, shown

    checkpoint = _checkpoints(run_dir)[-1]
    config = json.loads((checkpoint / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_rank"] == 16
    export = short_tmp / "export"
    subprocess.run(
        [sys.executable, "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(export)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    hidden = config["hidden_size"]
    head = TargetHead(
        torch.zeros(config["vocab_size"], hidden), torch.zeros(config["vocab_size"], hidden), torch.ones(hidden), 1e-6
    )
    assert isinstance(load_drafter(export, head).head, DFlash2KindHead)

    # The DFlash run's checkpoint resumed as DFlash 2: refused at once, naming the key.
    text, seconds = stops_with_2(dflash_run, *DFLASH2, "training.max_steps=16")
    assert "drafter.kind" in text and "holds a dflash drafter" in text
    assert seconds < 60


def test_a_selector_larger_than_the_vocabulary_stops_the_run_naming_the_key(short_tmp):
    text, seconds = stops_with_2(short_tmp / "run", 'drafter.kind="dflash2"', "drafter.dflash2.selector_top_k=1000000")
    assert "drafter.dflash2.selector_top_k 1000000 must be <= vocab_size" in text
    assert seconds < 60


def test_dflash2_on_a_cut_vocabulary_stops_the_run_naming_the_key(short_tmp):
    """A target whose head was cut below its tokenizer (64 rows for 80 tokens): DFlash 2's selector spans the head."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = short_tmp / "target"
    tiny_qwen3_target(target, vocab_size=64)
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(80)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(target)
    text, seconds = stops_with_2(
        short_tmp / "run",
        f"target.path={target}",
        "target.config_overrides={}",
        'drafter.kind="dflash2"',
        "drafter.mask_token_id=63",
    )
    assert "drafter.kind: dflash2 needs the target's full vocabulary: its tokenizer has 80 tokens, its head 64" in text
    assert seconds < 60


def test_check_describes_the_dflash2_drafter_and_its_vocabulary():
    """What ``run_all.sh check`` prints of the drafter (launch/check.py), in-process."""
    from common.config import load_config
    from launch.check import _drafter_summary

    summary = _drafter_summary(load_config(ROOT / "launch" / "tiny.toml", list(DFLASH2)), None)
    assert (
        "DFlash 2: convolutions of 2 taps in groups of 16, a rank-16 selector over the top 8 of the full vocabulary (64)"
    ) in summary

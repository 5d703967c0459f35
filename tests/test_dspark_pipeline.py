"""DSpark through the whole pipeline, in real processes: the producers ship the target's final hidden state for its
objective, a run trains, evaluates (with a confidence cut, reported beside the uncut decoding) and exports a DSpark
drafter; a checkpoint resumed as another kind and a cut vocabulary stop at once (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.drafter.dspark.model import DSparkKindHead
from tests.drafter_fixtures import tiny_qwen3_target
from tests.test_first_day import stops_with_2
from tests.test_pipeline import ONE_PRODUCER, finish, start

ROOT = Path(__file__).resolve().parents[1]
DSPARK = ('drafter.kind="dspark"',)
"""At its defaults: the Markov rank derived from the tiny target's vocabulary of 64 (the references' 256 is more)."""


def test_a_dspark_run_trains_evaluates_with_a_confidence_cut_and_exports(short_tmp):
    run_dir = short_tmp / "run"
    overrides = ("training.max_steps=16", "eval.every_steps=16", "eval.num_prompts=2", "eval.max_new_tokens=8")
    finish(start(run_dir, *ONE_PRODUCER, *DSPARK, *overrides, "eval.confidence_min=0.5"), run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    for key in DSparkKindHead.logged_metrics:
        assert all(key in m for m in trained), key
    evaluated = next(m for m in metrics if "eval/tau" in m)
    assert evaluated["eval/confidence_min"] == 0.5 and "eval/uncut_tau" in evaluated
    assert evaluated["eval/tau"] <= evaluated["eval/uncut_tau"] + 1e-9  # a cut never accepts more
    status = json.loads((run_dir / "trainer.json").read_text())
    assert status["kind"] == "dspark" and set(status["kind_metrics"]) == set(DSparkKindHead.logged_metrics)

    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    outputs = {}
    for fmt in ("zlab", "speculators"):
        done = subprocess.run(
            [sys.executable, "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(short_tmp / fmt),
             "--format", fmt, "--verifier", "verifier"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[fmt] = done.stdout
    config = json.loads((short_tmp / "speculators" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["markov_rank"] == 64
    # the commands of the servers that serve the kind: vLLM's method dspark, no SGLang
    assert '"method": "dspark"' in outputs["zlab"] and "sglang" not in outputs["zlab"]

    # The DSpark run resumed as DFlash: refused at once, naming the key (its saved [drafter.dspark] table is at its
    # defaults, so the checkpoint tells).
    text, seconds = stops_with_2(run_dir, 'drafter.kind="dflash"', "training.max_steps=32")
    assert "drafter.kind: the run's checkpoint holds a dspark drafter, the configuration asks for dflash" in text
    assert seconds < 60


def test_dspark_on_a_cut_vocabulary_stops_the_run_naming_the_key(short_tmp):
    """A target whose head was cut below its tokenizer (64 rows for 80 tokens): the Markov head spans the head."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = short_tmp / "target"
    tiny_qwen3_target(target, vocab_size=64)
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(80)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(target)
    text, seconds = stops_with_2(
        short_tmp / "run", f"target.path={target}", "target.config_overrides={}", *DSPARK, "drafter.mask_token_id=63"
    )
    assert "drafter.kind: dspark needs the target's full vocabulary: its tokenizer has 80 tokens, its head 64" in text
    assert seconds < 60

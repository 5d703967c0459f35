"""data.regenerate: a training run whose stream has the real target answer each record as it goes, the
captured documents being those answers, each record answered once and trained once per epoch through a
kill -9 of the producer."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from tests.real_model import run_killing_once, smollm2_folder, smollm2_gguf, write_chat

ROOT = Path(__file__).resolve().parents[1]


def test_the_stream_trains_on_the_targets_own_answers_exactly_once_through_a_producer_kill(short_tmp):
    smollm2_folder()
    data = write_chat(short_tmp / "chat.jsonl", 24)
    run_dir = short_tmp / "run"
    command = [
        str(ROOT / "launch" / "run_all.sh"),
        "--run-dir",
        str(run_dir),
        "--config",
        str(ROOT / "launch" / "smollm2-135m.toml"),
        f"target.path={json.dumps(str(smollm2_gguf()))}",
        "target.dtype=float32",
        f"data.paths={json.dumps([str(data)])}",
        "data.regenerate=true",
        "data.max_seq_len=256",
        "batching.token_budget=512",
        "batching.window_docs=8",
        "synthesize.max_new_tokens=8",
        "synthesize.rows=4",
        "drafter.num_layers=1",
        "drafter.num_anchors=16",
        "training.max_steps=0",
        "training.epochs=1",
        "training.checkpoint_every=2",
        "eval.every_steps=0",
        "eval.num_prompts=4",
        "logging.log_every=1",
        'launch.producer_devices=["cpu"]',
        'launch.trainer_devices=["cpu"]',
        "launch.mps=false",
        "launch.restart_backoff_s=0.2",
        "ring.backend=\"host\"",
        "ring.num_slots=2",
    ]
    folder = run_dir / "regenerated"
    out = run_killing_once(command, folder, f"producer.server --run-dir {run_dir}")
    answers = Counter()
    records = {}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            answers[record["id"]] += 1
            records[record["id"]] = record
    held_out = json.loads((run_dir / "held_out.json").read_text())["ids"]
    assert held_out and len(answers) == 24 - len(held_out) and max(answers.values()) == 1, answers  # each once
    assert all(
        r["messages"][-1]["role"] == "assistant" and r["generation"]["max_new_tokens"] == 8 for r in records.values()
    )
    for key, record in records.items():  # the target's words, not the record's own answer
        line = int(key.rsplit(":", 1)[1])
        assert record["messages"][-1]["content"] != f"{line} plus {line} is {2 * line}."
    trained = Counter()
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        trained.update(tuple(s) for s in json.loads(line)["samples"])
    assert len(trained) == len(answers) and max(trained.values()) == 1  # one epoch: every record trained once
    assert "producer 0 killed by SIGKILL" in out or "SIGKILL" in out, out
    kept = re.findall(r"; (\d+) answers kept in", next((run_dir / "logs").glob("producer*0*.log")).read_text())
    assert len(kept) == 2 and kept[0] == "0" and int(kept[1]) > 0, kept  # the restart read the answers kept before


def test_rows_whose_cache_cannot_fit_stop_the_run_with_exit_2_naming_the_key(short_tmp):
    """The online form sizes its static KV cache by synthesize.rows too: one the host cannot hold stops the run at
    the first window, naming the key, instead of a producer the kernel kills at every restart."""
    import subprocess
    import time

    data = write_chat(short_tmp / "chat.jsonl", 12)
    run_dir = short_tmp / "run"
    started = time.monotonic()
    done = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "--run-dir",
            str(run_dir),
            "--config",
            str(ROOT / "launch" / "smollm2-135m.toml"),
            f"target.path={json.dumps(str(smollm2_gguf()))}",
            "target.dtype=float32",
            f"data.paths={json.dumps([str(data)])}",
            "data.regenerate=true",
            "data.max_seq_len=256",
            "batching.token_budget=512",
            "synthesize.rows=100000",
            "drafter.num_layers=1",
            "training.max_steps=4",
            "eval.every_steps=0",
            "eval.num_prompts=2",
            'launch.producer_devices=["cpu"]',
            'launch.trainer_devices=["cpu"]',
            "launch.mps=false",
            "launch.restart_backoff_s=0.2",
            "ring.backend=\"host\"",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = next((run_dir / "logs").glob("producer*0*.log")).read_text()
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "synthesize.rows: a static KV cache of 100000 rows x" in log, log[-3000:]
    assert time.monotonic() - started < 120
    assert not list((run_dir / "regenerated").glob("*.jsonl")) if (run_dir / "regenerated").exists() else True

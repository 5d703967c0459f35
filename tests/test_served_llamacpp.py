"""Our exports served by llama.cpp's llama-server (launch/setup_llamacpp.sh builds it into .llamacpp): for each kind
it serves, ``trainer.export --format gguf`` writes the draft, and ``launch.bench.served --server llamacpp`` finds the
server drafting, accepting and generating on the same schedule as our evaluator, live decoder and z-lab's decoder,
with acceptances at positions 3 and beyond; ``--url`` then measures the running server from its own counters.

The target is the small random-weight Llama of launch/bench/served/small_target.py (SmolLM2's tokenizer, head_dim
64), and the drafter is trained for a minute on its greedy text. A DSpark drafter (one, for both of its cases) is served
without a confidence cut and with one (``--spec-draft-p-min`` and our ``eval.confidence_min``, 0.5, over a confidence
head rescaled to spread about it, ``quick_drafter.spread_confidence``); z-lab's decoder has no DSpark and is left out.
Marked ``served`` (minutes on two cores): ``pytest -m served tests/test_served_llamacpp.py``; skipped, saying why,
without the build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.llamacpp import LlamaCppMissing, converter_ready, server_binary

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8
NEW_TOKENS = 48
QUESTIONS = [
    "What is 17 times 23?",
    "Write a haiku about autumn.",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Name a famous painter.",
    "What is the capital of France?",
    "Describe the colour blue.",
    "Why is the sky blue?",
    "Give me a word that rhymes with cat.",
    "Translate 'thank you' into German.",
    "What does a compiler do?",
]

pytestmark = [pytest.mark.served, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", autouse=True)
def llamacpp_built():
    try:
        server_binary()
        converter_ready()
    except LlamaCppMissing as missing:
        pytest.skip(str(missing))


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    from launch.bench.served.small_target import make_small_target
    from tests.real_model import smollm2_folder

    return make_small_target(tmp_path_factory.mktemp("small") / "target", smollm2_folder())


def chat_prompts(folder: Path, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    from launch.bench.served.prompts import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]


def trained_checkpoint(kind: str, target_dir: Path, out: Path) -> Path:
    """A drafter of ``kind`` trained for a minute on the target's greedy answers to the questions, as a checkpoint's
    drafter/ folder (fp32)."""
    from launch.bench.served.quick_drafter import quick_drafter

    torch.set_num_threads(1)
    fields = {"dflash2": dict(selector_rank=32, selector_top_k=8)}.get(kind, {})
    return quick_drafter(target_dir, kind, chat_prompts(target_dir, QUESTIONS), out, new_tokens=2 * NEW_TOKENS,
                         steps=150, layers=2, block_size=BLOCK, **fields)  # fmt: skip


@pytest.fixture(scope="module")
def dspark_checkpoint(tmp_path_factory, small_target) -> Path:
    """A DSpark drafter (rank-32 Markov head, a confidence head) trained for about 100 s on the target's greedy answers
    (fewer blocks a step than the other kinds: its rows span the vocabulary twice, for the target's distribution), its
    confidence head rescaled so that a cut at 0.5 cuts about half of the slots."""
    from launch.bench.served.quick_drafter import quick_drafter

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("dspark") / "step-100"
    return quick_drafter(small_target, "dspark", chat_prompts(small_target, QUESTIONS), out, new_tokens=2 * NEW_TOKENS,
                         steps=100, layers=2, block_size=BLOCK, num_anchors=32, chunk_rows=128,
                         confidence_spread=2.0, markov_rank=32)  # fmt: skip


def run(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_llamacpp_serves_each_kind_as_our_decoders_do(tmp_path, small_target, kind):
    checkpoint = trained_checkpoint(kind, small_target, tmp_path / "step-150")
    draft = tmp_path / "draft-gguf"
    exported = run(
        "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(draft), "--format", "gguf",
        "--target", str(small_target), "--dtype", "float32",
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert {p.name for p in draft.iterdir()} == {"draft.gguf", "README.md"}, "the unit: the draft and its card"
    assert f"--spec-draft-n-max {BLOCK - 1} --port 8080 --metrics" in exported.stdout

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    out = tmp_path / "served.json"
    checked = run(
        "-m", "launch.bench.served", "--server", "llamacpp", "--target", str(small_target), "--draft",
        str(checkpoint), "--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--json-out", str(out),
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout[-5000:] + checked.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["agrees"] and summary["kind"] == kind and summary["block_size"] == BLOCK
    sides = summary["sides"]
    llama, ours = sides["llama.cpp"], sides["evaluator"]
    assert llama["on_schedule"] == ours["on_schedule"] == sides["live"]["on_schedule"] == sides["z-lab"]["on_schedule"]
    assert all(p["llama.cpp"]["same_tokens"] for p in summary["per_prompt"])
    per_pos = llama["on_schedule"]["accepted_per_pos"]
    assert per_pos[2] > 0 and per_pos[4] > 0, f"positions 3 and 5 never accepted: {per_pos}"
    assert llama["zlab_tau"] == pytest.approx(ours["zlab_tau"])


@pytest.mark.parametrize("cut", [0.0, 0.5], ids=["no-cut", "cut-0.5"])
def test_llamacpp_serves_dspark_as_our_decoders_do(tmp_path, small_target, dspark_checkpoint, cut):
    """llama.cpp's draft-dspark (its Markov walk in the graph, the confidence cut before the first slot below P)
    drafts, verifies and accepts at every verify forward what our evaluator and live decoder do; with the cut, blocks
    cut to no draft are forwards of the given token alone on every side (llama.cpp's own counters leave them out)."""
    if cut == 0.0:  # the export a user serves: its commands name draft-dspark and B - 1 drafts
        draft = tmp_path / "draft-gguf"
        exported = run(
            "-m", "trainer.export", "--checkpoint", str(dspark_checkpoint), "--out", str(draft), "--format", "gguf",
            "--target", str(small_target), "--dtype", "float32",
        )  # fmt: skip
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert (draft / "draft.gguf").is_file()
        assert f"--spec-type draft-dspark --spec-draft-n-max {BLOCK - 1}" in exported.stdout

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    out = tmp_path / "served.json"
    checked = run(
        "-m", "launch.bench.served", "--server", "llamacpp", "--target", str(small_target), "--draft",
        str(dspark_checkpoint), "--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--json-out", str(out),
        "--confidence-min", str(cut),
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout[-5000:] + checked.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["agrees"] and summary["kind"] == "dspark" and summary["block_size"] == BLOCK
    assert summary["confidence_min"] == cut and "DSparkDraftModel" in summary["zlab"]
    sides = summary["sides"]
    assert set(sides) == {"llama.cpp", "evaluator", "live"}
    llama, ours = sides["llama.cpp"], sides["evaluator"]
    assert llama["on_schedule"] == ours["on_schedule"] == sides["live"]["on_schedule"]
    assert ours["as_run"] == sides["live"]["as_run"]
    assert all(p["llama.cpp"]["same_tokens"] and p["live"]["same_tokens"] for p in summary["per_prompt"])
    per_pos = llama["on_schedule"]["accepted_per_pos"]
    assert per_pos[2] > 0 and per_pos[4] > 0, f"positions 3 and 5 never accepted: {per_pos}"
    forwards, drafted = llama["as_run"]["drafts"], llama["as_run"]["draft_tokens"]
    if cut == 0.0:
        assert drafted == forwards * (BLOCK - 1)
    else:  # blocks cut short, some to nothing (forwards llama.cpp's own counters do not count)
        assert drafted < forwards * (BLOCK - 1) / 2, (drafted, forwards)
        assert llama["server_counters"]["drafts"] < forwards
        assert ours["cut_margin"] > 0


def test_a_running_llama_server_is_measured_from_its_own_counters(tmp_path, small_target):
    from common.llamacpp import target_gguf
    from launch.bench.served.llamacpp import LlamaServer

    checkpoint = trained_checkpoint("dflash", small_target, tmp_path / "step-150")
    draft = tmp_path / "draft-gguf"
    assert run(
        "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(draft), "--format", "gguf",
        "--target", str(small_target), "--dtype", "float32",
    ).returncode == 0  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in QUESTIONS))
    out = tmp_path / "measured.json"
    with LlamaServer(
        server_binary(), target_gguf(small_target), draft / "draft.gguf", BLOCK, tmp_path / "server.log"
    ) as server:
        measured = run(
            "-m", "launch.bench.served", "--url", server.url, "--prompts", str(prompts), "--concurrency", "2",
            "--max-new-tokens", str(NEW_TOKENS), "--json-out", str(out),
        )  # fmt: skip
    assert measured.returncode == 0, measured.stdout[-3000:] + measured.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["server"] == "llama.cpp" and result["requests"] == len(QUESTIONS)
    assert 0 < result["output_tokens"] <= len(QUESTIONS) * NEW_TOKENS and result["output_tokens_per_s"] > 0
    counters = result["counters"]
    assert counters["drafts"] > 0 and counters["draft_tokens"] <= counters["drafts"] * (BLOCK - 1)
    assert result["mean_acceptance_length"] > 2, result  # the trained drafter: blocks, not single tokens
    assert len(result["acceptance_per_position"]) == BLOCK - 1 and result["acceptance_per_position"][2] > 0

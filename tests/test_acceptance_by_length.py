"""Acceptance by context length (issue 46, item 3): multi-turn held-out records evaluated at each assistant turn, tau
and per-position acceptance per bucket of context length, the break-even tau timed at each bucket's context, the
`launch.evaluate --by-length` table, and one wandb series per bucket. A tiny random Qwen3 target on the CPU."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from common.acceptance.arithmetic import acceptance_by_length, block_contexts, bucket_labels, bucket_of
from common.batch import Document
from common.config import ConfigError, EvalConfig, load_config, save_config
from common.drafter.export import export_zlab
from common.drafter.model import DFlashDrafter
from common.rundir import RunDir
from launch.evaluate import main
from producer.acceptance.decoder import DraftContext, speculative_decode
from producer.acceptance.evaluator import AcceptanceEvaluator, build_evaluator
from producer.acceptance.held_out import prompt_of, turn_documents
from producer.target_model.load import target_head_of
from tests.drafter_fixtures import tiny_config, tiny_qwen3_target, train_on_transcripts
from tests.test_data_sources import PLAIN_TEMPLATE, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [1, 3]
BLOCK = 4
# Three assistant turns of 30 tokens after user turns of 10, 8 and 6 tokens: prompts of 10, 48 and 84 tokens.
TURNS = [(10, 30), (8, 30), (6, 30)]
EDGES = [32, 64]  # buckets 0-32, 32-64 and 64+: each turn's decoding starts in another one, the first two cross


@pytest.fixture(scope="module")
def target_model(tmp_path_factory):
    return tiny_qwen3_target(tmp_path_factory.mktemp("target"), vocab_size=64, num_layers=6, hidden=32)


def drafter_for(model, vocab_size: int = 64) -> DFlashDrafter:
    torch.manual_seed(0)
    config = tiny_config(
        target_layer_ids=LAYER_IDS, block_size=BLOCK, vocab_size=vocab_size, mask_token_id=vocab_size - 1
    )
    return DFlashDrafter(config, target_head_of(model)).eval()


def conversation(seed: int, turns=TURNS) -> Document:
    """A tokenized multi-turn record: random tokens, each assistant turn a run of supervised tokens."""
    rng = np.random.default_rng(seed)
    mask = np.concatenate([np.r_[np.zeros(user, np.uint8), np.ones(answer, np.uint8)] for user, answer in turns])
    return Document(seed, rng.integers(0, 63, mask.size).astype(np.int32), mask)


def eval_config(**overrides) -> EvalConfig:
    values = dict(max_new_tokens=24, length_buckets=EDGES, batch_prompts=4, timing_repeats=1)
    return EvalConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def trained(target_model):
    """An evaluator over three three-turn records and a drafter trained on the target's greedy text of their prompts
    (it accepts whole blocks, so every bucket's figures are not all ones)."""
    evaluator = AcceptanceEvaluator(
        target_model, [conversation(s) for s in range(3)], eval_config(), LAYER_IDS, num_anchors=16
    )
    drafter = drafter_for(target_model)
    evaluator.evaluate(drafter)
    drafter = train_on_transcripts(drafter, evaluator.reference.transcripts, steps=60)
    return evaluator, drafter, evaluator.evaluate(drafter)


def test_each_assistant_turn_of_a_record_is_a_prompt_of_the_conversation_before_it(target_model):
    record = conversation(7)
    evaluator = AcceptanceEvaluator(target_model, [record], eval_config(), LAYER_IDS, num_anchors=16)
    prompts = [prompt_of(d, 0) for d in evaluator.documents]
    assert [p.numel() for p in prompts] == [10, 48, 84] == evaluator.prompt_lengths
    for p in prompts:  # the conversation itself up to the turn, earlier answers included
        assert p.tolist() == record.input_ids[: p.numel()].tolist()
    assert evaluator.record_of == [0, 0, 0] and len(evaluator.records) == 1
    # Each turn's simulated span is its own answer: supervised on that turn only, cut at its end.
    assert [(len(d), int(d.loss_mask.sum())) for d in evaluator.documents] == [(40, 30), (78, 30), (114, 30)]
    first_only = AcceptanceEvaluator(target_model, [record], eval_config(every_turn=False), LAYER_IDS, num_anchors=16)
    assert first_only.prompt_lengths == [10]
    fixed = AcceptanceEvaluator(target_model, [record], eval_config(prompt_len=5), LAYER_IDS, num_anchors=16)
    assert fixed.prompt_lengths == [5]


def test_at_most_max_turns_spread_from_the_first_turn_to_the_last():
    record = conversation(1, turns=[(4, 3)] * 7)
    starts = [int(np.flatnonzero(d.loss_mask)[0]) for d in turn_documents(record, max_turns=3)]
    assert starts == [4, 4 + 3 * 7, 4 + 6 * 7]  # turns 0, 3 and 6
    assert len(turn_documents(record, max_turns=0)) == 7 == len(turn_documents(record, max_turns=9))


def test_buckets_hold_the_verify_forwards_of_their_context_and_pool_to_the_whole(target_model, trained):
    """Per bucket, the real acceptance of live speculative decoding, each verify forward at its context (prompt and
    tokens generated before its block), from an independent run; the buckets pooled are the whole evaluation."""
    evaluator, drafter, report = trained
    assert report.num_prompts == 9 and report.num_records == 3 and report.tau > 1.5
    by_bucket: dict[int, list[int]] = {}
    prompts_in: dict[int, set[int]] = {}
    with torch.no_grad():
        for i, document in enumerate(evaluator.documents):
            prompt = prompt_of(document, 0)
            live = speculative_decode(DraftContext(drafter), evaluator.target, prompt, 24)
            position = prompt.numel()
            for accepted in live.accepted:
                by_bucket.setdefault(bucket_of(position, EDGES), []).append(accepted)
                prompts_in.setdefault(bucket_of(position, EDGES), set()).add(i)
                position += accepted + 1
    evaluator.target.detach()
    assert [b.label for b in report.by_length] == ["0-32", "32-64", "64+"]
    assert all(len(by_bucket[b]) > 0 for b in range(3)), "every bucket is reached"
    for b, bucket in enumerate(report.by_length):
        assert bucket.blocks == len(by_bucket[b]) and bucket.prompts == len(prompts_in[b])
        assert bucket.tau == pytest.approx(1 + np.mean(by_bucket[b]))
        assert bucket.accept_pos == pytest.approx([np.mean([n >= k for n in by_bucket[b]]) for k in range(1, BLOCK)])
    # Pooled over the buckets: the whole evaluation's tau and acceptance, every verify forward counted once.
    blocks = sum(b.blocks for b in report.by_length)
    assert blocks == report.target_forwards - report.num_prompts
    assert 1 + sum(b.blocks * (b.tau - 1) for b in report.by_length) / blocks == pytest.approx(report.tau)
    for k in range(BLOCK - 1):
        assert sum(b.blocks * b.accept_pos[k] for b in report.by_length) / blocks == pytest.approx(report.accept_pos[k])
    assert len({round(b.tau, 6) for b in report.by_length}) > 1, "the buckets differ: no copy of the overall figure"


def test_zlab_tau_per_bucket_averages_each_prompts_steps_there():
    """z-lab's convention per bucket: a prompt's steps in the bucket (cut at max_new_tokens), averaged per prompt, then
    over prompts; ours pools verify forwards whole."""
    from common.acceptance.arithmetic import Decoded

    decoded = [Decoded(tokens=list(range(10)), accepted=[3, 0, 3, 3]), Decoded(tokens=list(range(4)), accepted=[1, 3])]
    # Prompt 0 (10 tokens): steps 4, 1, 4 (the fourth block adds nothing); contexts 5, 9, 10, 14.
    # Prompt 1 (4 tokens): steps 2, 1 (cut at its 4th token); contexts 20, 22.
    buckets = acceptance_by_length(decoded, [5, 20], [10], BLOCK)
    assert [b.blocks for b in buckets] == [2, 4] and [b.prompts for b in buckets] == [1, 2]
    assert buckets[0].tau == pytest.approx(1 + 3 / 2) and buckets[1].tau == pytest.approx(1 + 10 / 4)
    assert buckets[0].zlab_tau == pytest.approx((4 + 1) / 2)
    assert buckets[1].zlab_tau == pytest.approx((4 / 1 + (2 + 1) / 2) / 2)
    assert block_contexts(5, [3, 0, 3, 3]) == [5, 9, 10, 14]
    assert bucket_labels([2048, 8192, 32768]) == ["0-2K", "2K-8K", "8K-32K", "32K+"] and bucket_labels([]) == ["all"]


def test_the_break_even_tau_is_timed_at_each_buckets_context(target_model, trained):
    """The target's verify (a block) and decode (a token) forwards run after a prefill of exactly the bucket's timing
    context; break-even = (draft + verify) / decode; the target is timed once, and without timing nothing is."""
    evaluator, drafter, report = trained
    contexts = evaluator.timing_contexts
    assert set(contexts) == {0, 1, 2} and contexts[0] < EDGES[0] <= contexts[1] < EDGES[1] <= contexts[2]
    for b, bucket in enumerate(report.by_length):
        costs = bucket.costs
        assert costs.context == contexts[b] and min(costs.draft_seconds, costs.verify_seconds, costs.decode_seconds) > 0
        assert costs.break_even_tau == pytest.approx(
            (costs.draft_seconds + costs.verify_seconds) / costs.decode_seconds
        )
        assert bucket.speedup == pytest.approx(bucket.tau / costs.break_even_tau)
    metrics = report.metrics()
    assert metrics["eval/break_even_tau_by_length/32-64"] == report.by_length[1].costs.break_even_tau

    fresh = AcceptanceEvaluator(
        target_model, [conversation(s) for s in range(3)], eval_config(), LAYER_IDS, num_anchors=16
    )
    calls = []
    hook = target_model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append((kw["input_ids"].shape[1], int(kw["position_ids"][0, 0]))), with_kwargs=True
    )
    try:
        with fresh.evaluation_context():
            fresh.target_costs(BLOCK)
        timed = set(calls)
        calls.clear()
        with fresh.evaluation_context():
            fresh.target_costs(BLOCK)
        assert calls == [], "the target is timed once"
    finally:
        hook.remove()
    for context in contexts.values():
        assert {(context, 0), (BLOCK, context), (1, context)} <= timed  # the prefill, a verify, a decode
    untimed = AcceptanceEvaluator(
        target_model, [conversation(0)], eval_config(timing_repeats=0), LAYER_IDS, num_anchors=16
    ).evaluate(drafter)
    assert all(b.costs is None for b in untimed.by_length)
    assert not any(key.startswith("eval/break_even_tau") for key in untimed.metrics())


def test_sampled_decoding_is_reported_by_length_too(target_model, trained):
    _, drafter, _ = trained
    report = AcceptanceEvaluator(
        target_model, [conversation(0)], eval_config(temperature=0.8, timing_repeats=0), LAYER_IDS, num_anchors=16
    ).evaluate(drafter)
    blocks = sum(b.blocks for b in report.by_length)
    assert blocks == report.target_forwards - report.num_prompts == report.metrics()["eval/target_forwards"] - 3
    assert 1 + sum(b.blocks * (b.tau - 1) for b in report.by_length if b.blocks) / blocks == pytest.approx(report.tau)


def write_chat_records(path) -> None:
    records = [
        [  # three assistant turns
            {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "add 2+2"},
            {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "That makes 6."},
        ],
        [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}, {"role": "assistant", "content": "x"}],
        [{"role": "user", "content": "nobody answers"}],
        [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "ok?"},
            {"role": "assistant", "content": "ok"},
        ],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))


def test_held_out_chat_records_give_one_prompt_per_turn_and_bad_ones_are_counted_skips(tmp_path, caplog):
    """A chat record of three assistant turns gives three prompts, each the conversation rendered up to that turn;
    a record whose turns do not alternate and one without an assistant turn are skipped, counted and named by
    file:line, and the evaluation runs on."""
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    target = tiny_qwen3_target(tmp_path / "target", vocab_size=300, num_layers=6, hidden=32)
    data = tmp_path / "held_out.jsonl"
    write_chat_records(data)
    overrides = [
        "data.format='chat'",
        f"data.paths=[{json.dumps(str(data))}]",
        f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer'))}",
        f"eval.paths=[{json.dumps(str(data))}]",
        "eval.num_prompts=4",
        "eval.max_new_tokens=8",
        "eval.timing_repeats=1",
        "eval.length_buckets=[64, 96]",
    ]
    with caplog.at_level(logging.WARNING):
        evaluator = build_evaluator(load_config(None, overrides), target, LAYER_IDS)
    assert evaluator.record_of == [0, 0, 0, 1]
    conversation_turns = json.loads(data.read_text().splitlines()[0])["messages"]
    for turn, document in enumerate(evaluator.documents[:3]):
        text = tokenizer.apply_chat_template(
            conversation_turns[: 2 * turn + 1], tokenize=False, add_generation_prompt=True
        )
        assert prompt_of(document, 0).tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert evaluator.prompt_lengths[0] < evaluator.prompt_lengths[1] < evaluator.prompt_lengths[2]
    assert [s.split(" ", 1)[0] for s in evaluator.skipped_records] == [f"{data}:2", f"{data}:3"]
    assert "turn_order" in evaluator.skipped_records[0] and "no_loss_tokens" in evaluator.skipped_records[1]
    assert f"{data}:2" in caplog.text

    report = evaluator.evaluate(drafter_for(target, vocab_size=300))
    assert report.num_prompts == 4 and report.num_records == 2
    assert report.metrics()["eval/skipped_records"] == 2
    assert f"{data}:2" in report.by_length_table()
    first_blocks = [bucket_of(n, [64, 96]) for n in evaluator.prompt_lengths[:3]]
    assert first_blocks == sorted(first_blocks) and first_blocks[0] < first_blocks[2]

    first_turns = build_evaluator(load_config(None, [*overrides, "eval.every_turn=false"]), target, LAYER_IDS)
    assert first_turns.record_of == [0, 1, 2] and len(first_turns.skipped_records) == 1  # no turn order required


def test_command_prints_the_by_length_table_and_writes_it_in_json(tmp_path, target_model, capsys):
    run = tmp_path / "run"
    run.mkdir()
    target_model.save_pretrained(tmp_path / "target")
    save_config(
        load_config(
            None,
            [
                "data.num_samples=20",
                "data.mean_len=48",
                "data.min_len=24",
                "data.max_seq_len=96",
                "batching.token_budget=128",
                "drafter.num_anchors=16",
                "eval.num_prompts=3",
                "eval.max_new_tokens=24",
                "eval.length_buckets=[16, 32]",
                "eval.timing_repeats=1",
                f"target.path={json.dumps(str(tmp_path / 'target'))}",
                "target.dtype=float32",
            ],
        ),
        run / "config.toml",
    )
    export_zlab(drafter_for(target_model), run / "checkpoints" / "step-00000010" / "drafter", dtype=None)
    out_json = tmp_path / "eval.json"
    checkpoint = str(run / "checkpoints" / "step-00000010")
    assert main(["--checkpoint", checkpoint, "--by-length", "--json-out", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "acceptance by context length" in printed and "break-even" in printed
    result = json.loads(out_json.read_text())
    assert [b["bucket"] for b in result["by_length"]] == ["0-16", "16-32", "32+"]
    reached = [b for b in result["by_length"] if b["blocks"]]
    assert reached and all(b["break_even_tau"] > 0 and len(b["accept_pos"]) == BLOCK - 1 for b in reached)
    for b in reached:  # each printed row holds its bucket's figures
        row = next(line for line in printed.splitlines() if line.startswith(f"{b['bucket']} "))
        assert f"{b['tau']:.3f}" in row and f"{b['break_even_tau']:.3f}" in row
        assert result[f"tau_by_length/{b['bucket']}"] == b["tau"]
    assert main(["--checkpoint", checkpoint]) == 0
    assert "acceptance by context length" not in capsys.readouterr().out


def test_the_trainer_logs_one_series_per_bucket(tmp_path, trained, caplog):
    """The result of producer 0, through the trainer's evaluation client: metrics.jsonl and wandb get each bucket's
    tau as a series of its own (against eval/step), buckets no verify forward reached get no point."""
    from trainer.acceptance import AcceptanceClient

    _, _, report = trained
    logged = []

    class Run:
        def log(self, values, step):
            logged.append((values, step))

    metrics = report.metrics()
    with open(tmp_path / "metrics.jsonl", "w") as metrics_file:
        client = AcceptanceClient(RunDir(tmp_path), 1, BLOCK, 0.3, False, metrics_file, Run())
        with caplog.at_level(logging.INFO):
            client.record(40, metrics, now_step=44)
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    values, step = logged[0]
    assert step == 44 and values["eval/step"] == 40
    for bucket in report.by_length:
        key = f"eval/tau_by_length/{bucket.label}"
        assert values[key] == line[key] == bucket.tau
        assert values[f"eval/break_even_tau_by_length/{bucket.label}"] == bucket.costs.break_even_tau
    assert client.last["tau_by_length"] == {b.label: b.tau for b in report.by_length}
    assert "by context length: tau 0-32" in caplog.text
    empty = acceptance_by_length([], [], EDGES, BLOCK)
    assert not any("by_length" in key for key in type(report)(**{**report.__dict__, "by_length": empty}).metrics())


def test_length_bucket_settings_are_checked_naming_the_key():
    for override, key in (
        ("eval.length_buckets=[8192, 2048]", "eval.length_buckets"),
        ("eval.length_buckets=[0, 2048]", "eval.length_buckets"),
        ("eval.max_turns=-1", "eval.max_turns"),
        ("eval.timing_repeats=-1", "eval.timing_repeats"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])
    assert load_config(None, ["eval.length_buckets=[]"]).eval.length_buckets == []


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_timed_draft_round_drafts_what_decoding_drafts(target_model, kind):
    """The timed round reads the context's keys and values projected once, as a server's draft cache holds them: its
    drafts are the evaluator's, for either kind, and the drafter's layers are as they were afterwards."""
    from common.drafter.model import build_drafter
    from producer.acceptance.decoder import draft_rows
    from producer.acceptance.timing import _context_kv_cached, time_draft_round
    from tests.test_dflash2 import dflash2_config, trained_like

    torch.manual_seed(0)
    if kind == "dflash":
        drafter = drafter_for(target_model)
    else:
        config = dflash2_config(target_layer_ids=LAYER_IDS, block_size=BLOCK)
        drafter = trained_like(build_drafter(config, target_head_of(target_model)).eval())
    fused = drafter.fuse_context(torch.randn(40, drafter.config.fused_feature_size))
    anchor, position = torch.tensor([5]), torch.tensor([40])
    originals = [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in drafter.layers]
    with torch.no_grad():
        plain = draft_rows(drafter, [fused], anchor, position)
        with _context_kv_cached(drafter, fused):
            assert all(layer.self_attn.k_proj is not k for layer, (k, _) in zip(drafter.layers, originals))
            cached = draft_rows(drafter, [fused], anchor, position)
    assert torch.equal(plain, cached)
    assert [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in drafter.layers] == originals
    assert time_draft_round(drafter, 40, repeats=1) > 0

"""Acceptance evaluation against a tiny random Qwen3 target on CPU: live speculative decoding is lossless, and the
evaluator's replay from the target's reference keeps exactly what live decoding keeps."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from common.acceptance.arithmetic import replay_rows
from common.batch import Document, PackedBatch
from common.config import ConfigError, RunConfig, load_config, save_config
from common.drafter.blocks import build_blocks
from common.drafter.export import export_zlab
from common.drafter.masks import build_masks
from common.drafter.model import DFlashDrafter
from launch.bench.coupled import CoupledAcceptance
from launch.evaluate import main
from producer.acceptance.decoder import DraftContext, DraftRows, greedy_decode, speculative_decode
from producer.acceptance.evaluator import AcceptanceEvaluator, build_evaluator
from producer.acceptance.held_out import held_out_documents, prompt_of
from producer.acceptance.transcripts import greedy_transcripts
from producer.data.build import build_data_source
from producer.target_model.greedy import GreedyTarget
from producer.target_model.load import target_head_of
from tests.drafter_fixtures import tiny_config, tiny_qwen3_target, train_on_transcripts

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER_IDS = [1, 3]
BLOCK = 4
SMALL_DATA = [
    "data.num_samples=20",
    "data.mean_len=48",
    "data.min_len=24",
    "data.max_seq_len=96",
    "batching.token_budget=128",
    "drafter.num_anchors=16",
    "eval.num_prompts=3",
    "eval.max_new_tokens=24",
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    tiny_qwen3_target(directory, vocab_size=64, num_layers=6, hidden=32)
    return directory


@pytest.fixture(scope="module")
def target_model(target_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(target_dir).eval()


@pytest.fixture(scope="module")
def target(target_model) -> GreedyTarget:
    return GreedyTarget(target_model, LAYER_IDS)


def random_drafter(target_model, **overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    config = tiny_config(**{"target_layer_ids": LAYER_IDS, "block_size": BLOCK, **overrides})
    return DFlashDrafter(config, target_head_of(target_model)).eval()


class OracleContext:
    """A constructed drafter that proposes the target's own greedy continuation, except at the slots
    ``corrupt`` picks (then a wrong token), so acceptance lengths can be steered. It keeps the features
    it is given, to check what enters the drafter's context."""

    def __init__(self, prompt_len: int, reference: list[int], block_size: int = BLOCK, corrupt=lambda: False):
        self.prompt_len, self.reference, self.block_size, self.corrupt = prompt_len, reference, block_size, corrupt
        self.features: list[torch.Tensor] = []

    def extend(self, features: torch.Tensor) -> None:
        self.features.append(features)

    def propose(self, token: int, position: int) -> torch.Tensor:
        start = position + 1 - self.prompt_len  # index in the generated text of the token after the anchor
        right = self.reference[start : start + self.block_size - 1]
        return torch.tensor([(t + 1) % 64 if self.corrupt() else t for t in right])


def prompt(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 63, (length,), generator=torch.Generator().manual_seed(seed))


def test_greedy_decode_matches_hf_generate(target_model, target):
    """The reference itself: our cached greedy loop is Hugging Face's greedy generate."""
    ids = prompt(0)
    expected = target_model.generate(ids[None], max_new_tokens=20, do_sample=False, pad_token_id=0)[0, 12:]
    assert greedy_decode(target, ids, 20) == expected.tolist()


def test_lossless_with_random_and_partially_right_drafters(target_model, target):
    flips = torch.Generator().manual_seed(1)
    seen = set()
    for seed in range(3):
        ids = prompt(seed)
        plain = greedy_decode(target, ids, 40)
        random_run = speculative_decode(DraftContext(random_drafter(target_model)), target, ids, 40)
        assert random_run.tokens == plain
        # Every acceptance length 0..B-1, so the caches are cropped by every amount.
        oracle = OracleContext(
            len(ids),
            greedy_decode(target, ids, 40 + BLOCK),
            corrupt=lambda: bool(torch.rand(1, generator=flips) < 0.25),
        )
        partial = speculative_decode(oracle, target, ids, 40)
        assert partial.tokens == plain
        seen.update(partial.accepted)
    assert seen == set(range(BLOCK))


def test_lossless_stops_after_the_stop_token(target_model, target):
    ids = prompt(3)
    plain = greedy_decode(target, ids, 30)
    stop = frozenset({plain[9]})
    expected = plain[: plain.index(plain[9]) + 1]
    assert greedy_decode(target, ids, 30, stop) == expected
    assert speculative_decode(DraftContext(random_drafter(target_model)), target, ids, 30, stop).tokens == expected


def test_drafter_context_is_the_kept_tokens_features(target):
    """After rejections the drafter's context holds the features of exactly the kept tokens, in order:
    those a single forward over the final text gives."""
    ids = prompt(6)
    flips = torch.Generator().manual_seed(2)
    oracle = OracleContext(
        len(ids), greedy_decode(target, ids, 40 + BLOCK), corrupt=lambda: bool(torch.rand(1, generator=flips) < 0.3)
    )
    decoded = speculative_decode(oracle, target, ids, 40)
    assert 0 < sum(decoded.accepted) < (BLOCK - 1) * len(decoded.accepted)  # some rejected, some accepted
    text = torch.cat([ids, torch.tensor(decoded.tokens)])
    target.reset()
    _, expected = target.forward(text[:-1], 0, logits=False)  # every kept token but the last (the next anchor)
    torch.testing.assert_close(torch.cat(oracle.features)[: len(text) - 1], expected, atol=1e-5, rtol=1e-5)


def test_oracle_drafter_reaches_tau_b(target):
    ids = prompt(4)
    new_tokens = 41
    decoded = speculative_decode(
        OracleContext(len(ids), greedy_decode(target, ids, new_tokens + BLOCK)), target, ids, new_tokens
    )
    assert decoded.tokens == greedy_decode(target, ids, new_tokens)
    assert decoded.accepted == [BLOCK - 1] * 10  # the prefill gives 1 token, each verify forward B = 4
    assert 1 + sum(decoded.accepted) / len(decoded.accepted) == BLOCK


def test_random_drafter_stays_near_one(target_model, target_dir):
    cfg = load_config(
        None,
        [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.num_prompts=4", "eval.max_new_tokens=32"],
    )
    drafter = random_drafter(target_model)
    report = build_evaluator(cfg, target_model, LAYER_IDS).evaluate(drafter)
    assert 1.0 <= report.tau < 1.15
    assert 1.0 <= report.sim_tau < 1.15
    assert report.tau == pytest.approx(1 + sum(report.accept_pos))
    assert report.greedy_forwards == report.generated_tokens == 4 * 32
    assert 0.0 <= report.forwards_saved < 0.15  # about one token per target forward: nothing saved
    metrics = report.metrics()
    assert metrics["eval/tau_gap"] == pytest.approx(report.tau - report.sim_tau)
    assert report.gap_within(0.1)
    assert not dataclasses.replace(report, tau=1.2, sim_tau=2.5).gap_within(0.25)  # 1.3 > 0.25 * (B - 1)
    assert {f"eval/accept_pos_{k}" for k in range(1, BLOCK)} <= metrics.keys()


@pytest.mark.parametrize("in_block_causality", ["sliding_causal", "bidirectional", "causal"])
@pytest.mark.parametrize(
    "layer_types,window",
    [(None, None), (["sliding_attention", "full_attention"], 5), (["sliding_attention", "sliding_attention"], 3)],
)
def test_decoding_drafter_sees_what_training_showed_it(target_model, target, layer_types, window, in_block_causality):
    """Proposals while decoding equal the training forward's argmax on the same anchors: same context
    (every token strictly before the anchor), same positions, same sliding window (3: smaller than the
    block, so it bounds the block's own keys too), same in-block causality."""
    overrides = {"layer_types": layer_types, "sliding_window": window} if layer_types else {}
    overrides["in_block_causality"] = in_block_causality
    drafter = random_drafter(target_model, **overrides)
    for name, weight in drafter.named_parameters():  # larger weights, so the argmaxes depend on the context
        if name.endswith("proj.weight") or name == "fc.weight":
            torch.nn.init.normal_(weight, std=0.3)
    ids = prompt(5, length=24)
    target.reset()
    _, features = target.forward(ids, 0, logits=False)
    batch = PackedBatch(
        input_ids=ids.int(),
        loss_mask=torch.ones(24, dtype=torch.uint8),
        cu_seqlens=torch.tensor([0, 24], dtype=torch.int32),
        sample_ids=torch.tensor([0]),
        aux_hidden=features,
    )
    config = drafter.config
    blocks = build_blocks(batch, 24, BLOCK, config.mask_token_id, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = drafter(features, blocks, build_masks(blocks, config, dense=True))
        trained = (hidden[:, 1:] @ drafter.target_head.lm_head_weight.T).argmax(-1)
        for j, anchor in enumerate(blocks.anchors[blocks.valid].tolist()):
            context = DraftContext(drafter)
            context.extend(features[:anchor])
            assert torch.equal(context.propose(int(ids[anchor]), anchor), trained[j]), f"anchor {anchor}"
    assert blocks.valid.sum() == 23


def test_held_out_split_is_disjoint_and_deterministic():
    cfg = load_config(None, SMALL_DATA)
    documents = held_out_documents(cfg, vocab_size=64)
    extended = build_data_source(dataclasses.replace(cfg.data, vocab_size=63, num_samples=23))
    # the synthetic documents after data.num_samples: training uses ids 0 .. 19
    assert all((d.input_ids == extended.get(20 + i).input_ids).all() for i, d in enumerate(documents))
    again = held_out_documents(cfg, vocab_size=64)
    assert all((a.input_ids == b.input_ids).all() for a, b in zip(documents, again))
    training = build_data_source(dataclasses.replace(cfg.data, vocab_size=63))
    assert len(training) == 20
    for held_out in documents:  # and none repeats a training document
        assert all(not (training.get(i).input_ids[:24] == held_out.input_ids[:24]).all() for i in range(20))


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"^eval\.num_prompts"):
        load_config(None, ["eval.num_prompts=0"])
    with pytest.raises(ConfigError, match=r"^eval\.gap_tolerance"):
        load_config(None, ["eval.gap_tolerance=0"])
    with pytest.raises(ConfigError, match=r"^eval\.every_steps: must be a multiple of logging\.log_every"):
        load_config(None, ["eval.every_steps=15", "logging.log_every=10"])
    # Tokenized or chat data without eval.paths is evaluated on records held out of it (producer/data/build.py run_sources).
    assert (
        load_config(None, ["eval.every_steps=10", "data.format=tokenized", "data.paths=['x.jsonl']"]).eval.paths == []
    )
    assert RunConfig().eval.every_steps == 0  # off unless asked for
    assert load_config("launch/tiny.toml").eval.every_steps > 0


def test_training_evaluation_logs_when_due(tmp_path, target_dir, target_model):
    cfg = load_config(
        None,
        [
            *SMALL_DATA,
            f"target.path={json.dumps(str(target_dir))}",
            "target.dtype=float32",
            "eval.every_steps=4",
            "logging.log_every=2",
        ],
    )
    drafter = random_drafter(target_model).train()
    evaluation = CoupledAcceptance(cfg, target_model, LAYER_IDS)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "w") as f:
        for step in (2, 4, 6, 8):
            evaluation.maybe_log(step, drafter, f, None)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, 8]
    assert 1.0 <= lines[0]["eval/tau"] <= BLOCK and "eval/tau_gap" in lines[0] and "eval/accept_pos_3" in lines[0]
    assert drafter.training  # the drafter goes back to training mode


def test_training_evaluation_refuses_another_target(tmp_path, target_dir, target_model):
    cfg = load_config(
        None,
        [
            *SMALL_DATA,
            f"target.path={json.dumps(str(target_dir))}",
            "target.dtype=float32",
            "eval.every_steps=2",
            "logging.log_every=2",
        ],
    )
    other = tiny_qwen3_target(tmp_path / "other", vocab_size=64, num_layers=6, hidden=32, seed=1)
    drafter = random_drafter(other)
    evaluation = CoupledAcceptance(cfg, target_model, LAYER_IDS)
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "w") as f:
        evaluation.maybe_log(2, drafter, f, None)
    assert evaluation.disabled and metrics.read_text() == ""


def test_command_evaluates_a_run_checkpoint(tmp_path, target_dir, target_model, capsys):
    run = tmp_path / "run"
    run.mkdir()
    save_config(
        load_config(None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "target.dtype=float32"]),
        run / "config.toml",
    )
    export_zlab(random_drafter(target_model), run / "checkpoints" / "step-00000010" / "drafter", dtype=None)
    out_json = tmp_path / "eval.json"
    assert main(["--checkpoint", str(run / "checkpoints" / "step-00000010"), "--json-out", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "tau (real)" in printed and "tau (simulated)" in printed
    result = json.loads(printed.strip().splitlines()[-1])
    assert result == json.loads(out_json.read_text())
    assert result["num_prompts"] == 3 and 1.0 <= result["tau"] < 1.2 and result["generated_tokens"] == 3 * 24


def run_with_checkpoints(tmp_path, target_dir, drafters: dict) -> Path:
    """A run of the small data on ``target_dir`` holding each of ``drafters`` as a checkpoint named by its key."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(
        load_config(None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "target.dtype=float32"]),
        run / "config.toml",
    )
    for name, drafter in drafters.items():
        export_zlab(drafter, run / "checkpoints" / name / "drafter", dtype=None)
    return run


def two_drafters(tmp_path, target_dir, target_model) -> list[Path]:
    """The checkpoints of a run holding a random drafter and one whose drafts depend on the context."""
    torch.manual_seed(0)
    drafters = {"step-00000010": random_drafter(target_model), "step-00000020": strong_drafter(target_model)}
    run = run_with_checkpoints(tmp_path, target_dir, drafters)
    return [run / "checkpoints" / name for name in drafters]


def test_command_evaluates_several_checkpoints_against_one_reference(tmp_path, target_dir, target_model, caplog):
    """Two drafters in one command: the target's reference is made once, and each result is what the command
    reports for that drafter alone."""
    checkpoints = two_drafters(tmp_path, target_dir, target_model)
    alone = []
    for checkpoint in checkpoints:
        assert main(["--checkpoint", str(checkpoint), "--json-out", str(tmp_path / "alone.json")]) == 0
        alone.append(json.loads((tmp_path / "alone.json").read_text()))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        together_args = [arg for checkpoint in checkpoints for arg in ("--checkpoint", str(checkpoint))]
        assert main([*together_args, "--json-out", str(tmp_path / "together.json")]) == 0
    assert caplog.text.count("evaluation reference:") == 1
    together = json.loads((tmp_path / "together.json").read_text())
    assert [r["checkpoint"] for r in together] == [str(c) for c in checkpoints]
    for one, both in zip(alone, together):
        for key in ("tau", "zlab_tau", "sim_tau", "generated_tokens", "target_forwards"):
            assert both[key] == one[key], key
    assert together[0]["tau"] != together[1]["tau"]


def test_the_benchmarks_evaluate_several_checkpoints_in_one_process(tmp_path, target_dir, target_model):
    """``launch.bench.quality.evaluate`` (the peers' and the kinds' tables): one ``launch.evaluate`` process for the
    checkpoints of an evaluation, each one's result in order; one checkpoint's, as before."""
    from launch.bench.quality import evaluate

    checkpoints = two_drafters(tmp_path, target_dir, target_model)
    run = checkpoints[0].parents[1]
    results = evaluate(checkpoints, run, tmp_path / "eval-both.log", "eval.num_prompts=2")
    assert [r["checkpoint"] for r in results] == [str(c) for c in checkpoints]
    assert (tmp_path / "eval-both.log").read_text().count("evaluation reference:") == 1
    (alone,) = evaluate(checkpoints[1:], run, tmp_path / "eval-one.log", "eval.num_prompts=2")
    assert alone["tau"] == results[1]["tau"] and alone["num_prompts"] == 2


def test_command_refuses_an_unreadable_checkpoint_before_evaluating_any(
    tmp_path, target_dir, target_model, caplog, capsys
):
    run = run_with_checkpoints(tmp_path, target_dir, {"step-00000010": random_drafter(target_model)})
    broken = run / "checkpoints" / "step-00000020"
    broken.mkdir()
    with caplog.at_level(logging.INFO):
        code = main(["--checkpoint", str(run / "checkpoints" / "step-00000010"), "--checkpoint", str(broken)])
    assert code == 2 and "evaluation reference:" not in caplog.text
    assert f"{broken}: not a drafter this command can read" in capsys.readouterr().err


def test_command_refuses_a_target_that_is_not_the_runs(tmp_path, capsys):
    """A random-weight target rebuilt from the run's config must be the producers' (their head is in RUN/target)."""
    from producer.target_model.load import load_target_model

    run = tmp_path / "run"
    cfg = load_config(None, [*SMALL_DATA, "target.config_overrides={vocab_size = 64}", "target.dtype=float32"])
    (run / "checkpoints" / "step-00000010" / "drafter").mkdir(parents=True)
    save_config(cfg, run / "config.toml")
    other = load_target_model(dataclasses.replace(cfg.target, seed=1, device="cpu"))
    other.save_pretrained(run / "target")
    assert main(["--checkpoint", str(run / "checkpoints" / "step-00000010")]) == 2
    assert "not the run's" in capsys.readouterr().err


def test_command_refuses_a_target_whose_lm_head_alone_differs(tmp_path, capsys):
    """The embedding is not all the drafter shares: an lm_head (or final norm) that differs is refused too."""
    from producer.target_model.load import load_target_model

    run = tmp_path / "run"
    cfg = load_config(None, [*SMALL_DATA, "target.config_overrides={vocab_size = 64}", "target.dtype=float32"])
    (run / "checkpoints" / "step-00000010" / "drafter").mkdir(parents=True)
    save_config(cfg, run / "config.toml")
    same = load_target_model(dataclasses.replace(cfg.target, device="cpu"))
    with torch.no_grad():
        same.lm_head.weight.add_(1e-3)
    same.save_pretrained(run / "target")
    assert main(["--checkpoint", str(run / "checkpoints" / "step-00000010")]) == 2
    assert "lm_head_weight differ" in capsys.readouterr().err


def steered_drafts(reference: list[int], prompt_len: int, position: int, row: int) -> list[int]:
    """The target's own continuation after ``position``, wrong at the slots a fixed rule picks: acceptance
    lengths of every size, the same whether a prompt is decoded alone or with others."""
    start = position + 1 - prompt_len
    right = reference[start : start + BLOCK - 1]

    def wrong(slot: int) -> bool:  # about one slot in three, by a fixed draw per (position, slot, row)
        return float(torch.rand(1, generator=torch.Generator().manual_seed(1000 * position + 10 * slot + row))) < 0.35

    return [(t + 1) % 64 if wrong(slot) else t for slot, t in enumerate(right)]


class SteeredContext(OracleContext):
    def __init__(self, prompt_len: int, reference: list[int], row: int) -> None:
        super().__init__(prompt_len, reference)
        self.row = row

    def propose(self, token: int, position: int) -> torch.Tensor:
        return torch.tensor(steered_drafts(self.reference, self.prompt_len, position, self.row))


class SteeredRows:
    """DraftRows' interface over steered drafts: what the replay asks of a drafter, row by row."""

    def __init__(self, transcripts) -> None:
        self.transcripts = transcripts
        self.block_size = BLOCK

    def propose(self, rows, tokens, positions):
        return [
            steered_drafts(self.transcripts[r].continuation, self.transcripts[r].prompt_len, p, r)
            for r, p in zip(rows, positions)
        ]


@pytest.fixture(scope="module")
def sliding_target(tmp_path_factory) -> GreedyTarget:
    """A Qwen3 whose first layers attend through a 6-token window: its cache keeps only the window's slots."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=6,
        use_sliding_window=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    directory = tmp_path_factory.mktemp("sliding")
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return GreedyTarget(Qwen3ForCausalLM.from_pretrained(directory).eval(), LAYER_IDS)


@pytest.mark.parametrize("together", [4, 1])
def test_transcripts_are_greedy_decoding_and_the_features_of_its_text(target, together):
    """The target's reference: each prompt's continuation is plain greedy decoding, and its features are those
    a single forward over the text gives (rows of different lengths decoded together, or one at a time)."""
    prompts = [prompt(30, 5), prompt(31, 13), prompt(32, 9), prompt(33, 11)]
    transcripts = greedy_transcripts(target, prompts, 20, together)
    for p, transcript in zip(prompts, transcripts):
        assert transcript.prompt_len == len(p) and transcript.tokens[: len(p)] == p.tolist()
        assert transcript.continuation == greedy_decode(target, p, 20)
        target.reset()
        _, expected = target.forward(torch.tensor(transcript.tokens[:-1]), 0, logits=False)
        torch.testing.assert_close(transcript.features, expected, atol=1e-5, rtol=1e-5)
    target.detach()


@pytest.mark.parametrize("kind", ["plain", "sliding"])
def test_the_replay_keeps_exactly_what_live_decoding_keeps(target, sliding_target, kind):
    """Rows of different prompt lengths and acceptance patterns (every length 0..B-1), one stopping early at a stop
    token it accepted mid-block: the replay from the reference keeps, round by round, what live decoding with the
    target's KV cache keeps, and its text is plain greedy decoding."""
    greedy = target if kind == "plain" else sliding_target
    prompts = [prompt(10, 7), prompt(11, 12), prompt(12, 17), prompt(13, 9)]
    new_tokens = 40
    transcripts = greedy_transcripts(greedy, prompts, new_tokens + BLOCK - 1, 4)
    stop = frozenset({transcripts[3].continuation[14]})  # the last prompt stops early
    replayed = replay_rows(SteeredRows(transcripts), transcripts, new_tokens, stop)
    for r, (p, transcript) in enumerate(zip(prompts, transcripts)):
        live = speculative_decode(SteeredContext(len(p), transcript.continuation, r), greedy, p, new_tokens, stop)
        assert replayed[r].tokens == live.tokens == greedy_decode(greedy, p, new_tokens, stop), f"row {r}"
        assert replayed[r].accepted == live.accepted, f"row {r}"
    assert len(replayed[3].tokens) < new_tokens and {n for d in replayed for n in d.accepted} == set(range(BLOCK))
    greedy.detach()


def test_one_drafter_forward_for_all_rows_equals_each_row_alone(target_model, target):
    """The packed proposal (every block sees only its own row's context, windows and in-block causality as
    trained) gives each row the drafts it gets alone, over the prefix of its features that a position asks for."""
    drafter = random_drafter(
        target_model, layer_types=["sliding_attention", "full_attention"], sliding_window=3, in_block_causality="causal"
    )
    for name, weight in drafter.named_parameters():
        if name.endswith("proj.weight") or name == "fc.weight":
            torch.nn.init.normal_(weight, std=0.3)
    features = []
    for r, length in enumerate((5, 11, 8)):
        target.reset()
        features.append(target.forward(prompt(20 + r, length), 0, logits=False)[1])
    target.detach()
    rows = DraftRows(drafter, features)
    tokens, positions = [3, 17, 40], [5, 9, 8]  # row 1 drafts over the first 9 of its 11 tokens' features
    with torch.no_grad():
        together = rows.propose([0, 1, 2], tokens, positions)
        for r in range(3):
            single = DraftContext(drafter)
            single.extend(features[r][: positions[r]])
            assert together[r] == single.propose(tokens[r], positions[r]).tolist(), f"row {r}"
        assert rows.propose([2, 0], [40, 3], [8, 5]) == [together[2], together[0]]


def strong_drafter(target_model, **overrides) -> DFlashDrafter:
    """A random drafter with larger weights, so that its drafts depend on the context."""
    drafter = random_drafter(target_model, **overrides)
    for name, weight in drafter.named_parameters():
        if name.endswith("proj.weight") or name == "fc.weight":
            torch.nn.init.normal_(weight, std=0.3)
    return drafter


def live_and_replayed_drafts(evaluator: AcceptanceEvaluator, drafter: DFlashDrafter, monkeypatch) -> tuple[list, list]:
    """Every block the drafter drafted, as (prompt, anchor position, drafts), in live decoding of each held-out
    prompt and in the evaluator's replay: equal lists mean equal contexts, positions and rounds."""
    live, replayed = [], []
    original_single, original_rows = DraftContext.propose, DraftRows.propose

    def single(self, token, position):
        drafts = original_single(self, token, position)
        live.append((self.row, position, drafts.tolist()))
        return drafts

    def rows(self, row_ids, tokens, positions):
        drafts = original_rows(self, row_ids, tokens, positions)
        replayed.extend((self.first + r, p, d) for r, p, d in zip(row_ids, positions, drafts))
        return drafts

    monkeypatch.setattr(DraftContext, "propose", single)
    monkeypatch.setattr(DraftRows, "propose", rows)
    original_init = DraftRows.__init__
    groups = []

    def init(self, drafter_, features, confidence_min=0.0):
        original_init(self, drafter_, features, confidence_min)
        self.first = sum(groups)
        groups.append(len(features))

    monkeypatch.setattr(DraftRows, "__init__", init)
    with torch.no_grad():
        for r, document in enumerate(evaluator.documents):
            context = DraftContext(drafter)
            context.row = r
            speculative_decode(
                context,
                evaluator.target,
                prompt_of(document, evaluator.config.prompt_len),
                evaluator.config.max_new_tokens,
                evaluator.stop_token_ids,
            )
    evaluator.target.detach()
    report = evaluator.evaluate(drafter)
    return sorted(live), sorted(replayed), report


def test_the_evaluator_drafts_what_live_decoding_drafts(target_model, target_dir, monkeypatch):
    """The real drafter, end to end: every block of the evaluator's replay (prompts in groups of 2) is the block
    live decoding drafts, at the same anchor, over the same context."""
    cfg = load_config(
        None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.num_prompts=5", "eval.batch_prompts=2"]
    )
    drafter = strong_drafter(target_model, layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
    live, replayed, report = live_and_replayed_drafts(evaluator, drafter, monkeypatch)
    assert live == replayed and len(live) == report.target_forwards - report.num_prompts


def test_an_evaluation_after_the_first_runs_no_target_forward(target_model, target_dir):
    """The target's half is made once: a second drafter's evaluation runs the drafter only. With no room to keep the
    documents' features, each evaluation runs the target over the documents alone, and reports the same."""
    forwards = []
    hook = target_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        cfg = load_config(None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.num_prompts=4"])
        evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
        first = evaluator.evaluate(random_drafter(target_model))
        made = len(forwards)
        assert made > 0 and first.reference_seconds > 0
        second = evaluator.evaluate(strong_drafter(target_model))
        assert len(forwards) == made and second.reference_seconds == 0.0
        assert second.metrics()["eval/reference_seconds"] == 0.0
        # The phases add up: the reference, the decoding, and the simulated acceptance after it.
        for report in (first, second):
            assert 0 < report.decode_seconds < report.seconds - report.reference_seconds
            assert report.metrics()["eval/decode_seconds"] == report.decode_seconds
        no_room = build_evaluator(
            load_config(
                None,
                [
                    *SMALL_DATA,
                    f"target.path={json.dumps(str(target_dir))}",
                    "eval.num_prompts=4",
                    "eval.reference_cache_gb=0",
                ],
            ),
            target_model,
            LAYER_IDS,
        )
        assert no_room.evaluate(strong_drafter(target_model)).tau == second.tau
        forwards.clear()
        again = no_room.evaluate(strong_drafter(target_model))
        assert len(forwards) == len(no_room.documents) and (again.tau, again.sim_tau) == (second.tau, second.sim_tau)
    finally:
        hook.remove()


def test_a_drafter_with_a_larger_block_gets_longer_continuations(target_model, target_dir):
    cfg = load_config(None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.max_new_tokens=10"])
    evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
    evaluator.evaluate(random_drafter(target_model))
    assert evaluator.reference.continuation_length == 10 + BLOCK - 1
    larger = random_drafter(target_model, block_size=8)
    assert evaluator.evaluate(larger).reference_seconds > 0
    assert evaluator.reference.continuation_length == 10 + 8 - 1


def test_evaluation_of_prompts_together_reports_what_one_at_a_time_reports(target_model, target_dir):
    overrides = [
        *SMALL_DATA,
        f"target.path={json.dumps(str(target_dir))}",
        "eval.num_prompts=5",
        "eval.max_new_tokens=24",
    ]
    drafter = strong_drafter(target_model)
    batched = build_evaluator(
        load_config(None, [*overrides, "eval.batch_prompts=4"]), target_model, LAYER_IDS
    ).evaluate(drafter)
    single = build_evaluator(load_config(None, [*overrides, "eval.batch_prompts=1"]), target_model, LAYER_IDS).evaluate(
        drafter
    )
    assert (batched.tau, batched.accept_pos, batched.generated_tokens, batched.target_forwards) == (
        single.tau,
        single.accept_pos,
        single.generated_tokens,
        single.target_forwards,
    )


def test_the_simulated_tau_is_scored_on_the_span_decoding_produces(target_model, target_dir):
    """Real decoding of a held-out prompt stops at eval.max_new_tokens; the simulation scores blocks at the anchors
    of the same span of each document (from the prefill's token to the one before the max_new_tokens-th), not at
    the rest of a longer answer."""
    from producer.acceptance.simulated import decoded_span, simulated_acceptance
    from producer.acceptance.transcripts import document_features

    cfg = load_config(
        None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.num_prompts=4", "eval.max_new_tokens=8"]
    )
    evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
    drafter = strong_drafter(target_model)
    report = evaluator.evaluate(drafter)
    spans, anchors = zip(*(decoded_span(d, 0, 8, BLOCK) for d in evaluator.documents))
    starts = [prompt_of(d, 0).numel() for d in evaluator.documents]
    assert all(len(s) == n + 8 + BLOCK - 2 < len(d) for s, n, d in zip(spans, starts, evaluator.documents))
    assert all(a.tolist() == list(range(n, n + 7)) for a, n in zip(anchors, starts))
    # The answer's first token comes from the prefill, never from a block: it is no label, so no block ends the prompt.
    assert all(s.loss_mask[: n + 1].sum() == 0 and s.loss_mask[n + 1 :].all() for s, n in zip(spans, starts))
    with torch.no_grad():
        whole_features = [document_features(evaluator.target, d) for d in evaluator.documents]
        on_spans, _ = simulated_acceptance(drafter, spans, whole_features, cfg.drafter.num_anchors, anchors=anchors)
        on_documents, _ = simulated_acceptance(drafter, evaluator.documents, whole_features, cfg.drafter.num_anchors)
    assert report.sim_tau == pytest.approx(on_spans)
    assert on_spans != pytest.approx(on_documents)


def test_the_last_blocks_of_the_decoded_span_are_scored_whole():
    """The decoding's last block counts its acceptance whole, past eval.max_new_tokens; so does the simulation's:
    a block anchored near the span's end keeps every label the document has (cutting them capped its streak, and
    a perfect drafter scored 14.3 of 16)."""
    from producer.acceptance.simulated import decoded_span

    block, max_new = 4, 8
    document = Document(0, np.arange(105, dtype=np.int32), np.r_[np.zeros(5), np.ones(100)].astype(np.uint8))
    span, anchors = decoded_span(document, 0, max_new, block)
    assert anchors.tolist() == list(range(5, 5 + max_new - 1))
    batch = PackedBatch(
        input_ids=torch.as_tensor(span.input_ids),
        loss_mask=torch.as_tensor(span.loss_mask),
        cu_seqlens=torch.tensor([0, len(span)], dtype=torch.int32),
        sample_ids=torch.tensor([0]),
    )
    blocks = build_blocks(batch, 0, block, 99, None, anchors)
    assert blocks.label_mask.all(), "every block of the span supervised in all its slots"
    short = Document(0, document.input_ids[:12], document.loss_mask[:12])  # an answer shorter than the blocks read
    span, anchors = decoded_span(short, 0, max_new, block)
    assert len(span) == 12 and anchors.tolist() == list(range(5, 11))


def test_the_simulated_tau_counts_each_blocks_own_streak():
    """tau = 1 + the mean over blocks of each block's leading correct slots, not 1 + the sum of products of per-slot
    marginals: here the two differ (2.0 against 2.25)."""
    from common.drafter.blocks import DraftBlocks
    from common.drafter.loss import draft_metrics

    label_mask = torch.ones(2, 3, dtype=torch.bool)
    blocks = DraftBlocks(
        anchors=torch.tensor([0, 5]),
        valid=torch.tensor([True, True]),
        doc_start=torch.zeros(2, dtype=torch.long),
        block_ids=torch.zeros(2, 4, dtype=torch.long),
        block_positions=torch.zeros(2, 4, dtype=torch.long),
        label_index=torch.zeros(2, 3, dtype=torch.long),
        label_ids=torch.zeros(2, 3, dtype=torch.long),
        label_mask=label_mask,
        context_doc_ids=torch.zeros(10, dtype=torch.int32),
        context_positions=torch.arange(10),
    )
    correct = torch.tensor([[True, True, False], [False, True, True]])
    metrics = draft_metrics(blocks, torch.zeros(2, 3), correct)
    assert metrics["tau"] == pytest.approx(2.0)
    accuracy = metrics["acc"]
    assert accuracy.tolist() == [0.5, 1.0, 0.5]
    assert 1 + torch.cumprod(accuracy, 0).sum() == pytest.approx(2.25)


def test_decoding_anchors_are_where_the_replay_started_its_blocks(target):
    """The walk of anchors that the simulation re-scores is the replay's own: the prefill's token first, then each
    round's anchor after its kept drafts and the target's token (acceptance lengths of every size)."""
    from common.acceptance.arithmetic import decoding_anchors

    prompts = [prompt(40, 7), prompt(41, 12)]
    transcripts = greedy_transcripts(target, prompts, 40 + BLOCK - 1, 2)
    target.detach()
    asked = []

    class Recorded(SteeredRows):
        def propose(self, rows, tokens, positions):
            asked.extend(zip(rows, positions))
            return super().propose(rows, tokens, positions)

    decoded = replay_rows(Recorded(transcripts), transcripts, 40)
    assert {n for d in decoded for n in d.accepted} == set(range(BLOCK))
    for r, (transcript, one) in enumerate(zip(transcripts, decoded)):
        assert decoding_anchors(transcript, one) == [p for row, p in asked if row == r]


def test_the_simulation_at_the_decodings_anchors_is_real_tau_and_the_rest_is_split(target_model, target_dir):
    """A drafter trained on the target's greedy text accepts whole blocks; the training forward at the anchors the
    decoding visited gives real tau exactly (serving runs what training trained); every anchor of the same text,
    and documents that are not the target's text, give figures of their own."""
    cfg = load_config(
        None,
        [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.num_prompts=6", "eval.max_new_tokens=40"],
    )
    evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
    drafter = random_drafter(target_model)
    evaluator.evaluate(drafter)  # makes the target's reference: the greedy texts to train on
    transcripts = evaluator.reference.transcripts
    report = evaluator.evaluate(train_on_transcripts(drafter, transcripts, steps=150))
    assert report.tau > 1.5, "the drafter accepts whole blocks: the comparison is not all zeros"
    assert report.sim_tau_walk == pytest.approx(report.tau, abs=1e-6)
    assert report.sim_tau_greedy != pytest.approx(report.sim_tau_walk)
    assert report.sim_tau != pytest.approx(report.sim_tau_greedy)  # the held-out documents are random text
    metrics = report.metrics()
    assert (metrics["eval/sim_tau_greedy"], metrics["eval/sim_tau_walk"]) == (
        report.sim_tau_greedy,
        report.sim_tau_walk,
    )

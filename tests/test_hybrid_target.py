"""Hybrid Gated-DeltaNet targets (Qwen3.5 / Qwen3.6): loading, packed capture, head, preset, refusal."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from common.batch import PackedBatch
from common.config import TargetConfig
from common.drafter.draft_config import DraftConfig
from common.drafter.target_head import load_target_head
from common.hf import target_identity, text_config_of
from common.status import ProducerStatus
from producer.target_model.capture import Target, compiles_by_default
from producer.target_model.load import UnsupportedTarget
from tests.hybrid_fixtures import FORMS, reference_model, tiny_qwen35

LAYER_IDS = [0, 2, 3, 5]  # linear and full-attention layers (layer_types: 3 linear, then 1 full)


@pytest.fixture(scope="module", params=FORMS)
def saved(request, tmp_path_factory):
    return request.param, tiny_qwen35(tmp_path_factory.mktemp(request.param), request.param)


def packed(lengths: list[int], vocab: int = 128, seed: int = 0) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=gen, dtype=torch.int32),
        loss_mask=torch.ones(total, dtype=torch.uint8),
        cu_seqlens=cu,
        sample_ids=torch.arange(len(lengths)),
    )


def test_loads_the_language_model_only_with_fields_from_the_text_config(saved):
    form, path = saved
    target = Target.load(TargetConfig(path=str(path), dtype="float32"), LAYER_IDS)
    assert type(target.model).__name__ in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    assert target.hybrid and target.linear == "per_document"
    assert not any("visual" in name for name, _ in target.model.named_parameters())
    assert target.model.config.num_hidden_layers == 8 and target.hidden_size == 64
    # The trainer reads the same text config and the head from the same checkpoint: identities agree.
    head = load_target_head(path)
    config = text_config_of(AutoConfig.from_pretrained(path))
    assert target_identity(config, head.embed_weight) == target.identity
    tensors = target.head_tensors()
    assert torch.equal(head.embed_weight, tensors["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head_weight, tensors["lm_head.weight"])
    assert torch.equal(head.norm_weight, tensors["model.norm.weight"])


@pytest.mark.parametrize("lengths", [[37, 5, 60, 1, 22], [128]])
def test_packed_capture_equals_each_documents_own_forward(saved, lengths):
    """Every layer type keeps documents apart: the linear layers' convolution and recurrent state restart
    at each boundary, so packed features equal hidden_states[k + 1] of each document alone."""
    _, path = saved
    target = Target.load(TargetConfig(path=str(path), dtype="float32"), LAYER_IDS, capture_last_hidden=True)
    batch = packed(lengths)
    features = target.capture(batch)
    reference = reference_model(path)
    bounds = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            out = reference(batch.input_ids[None, start:end].long(), output_hidden_states=True)
            expected = torch.cat([out.hidden_states[k + 1][0] for k in LAYER_IDS], dim=-1)
            torch.testing.assert_close(features.aux_hidden[start:end], expected, rtol=1e-4, atol=1e-4)
            # last_hidden is before the final norm; the trainer's head applies Qwen3.5's zero-centred norm.
            head = load_target_head(path)
            torch.testing.assert_close(
                head.final_norm(features.last_hidden[start:end]), out.hidden_states[-1][0], rtol=1e-4, atol=1e-4
            )
    # Sanity: run as one sequence, the packed row's later documents differ well beyond the tolerance
    # (so the comparison above would see a state or convolution leaking across a boundary).
    if len(lengths) > 1:
        with torch.no_grad():
            leaked = reference(batch.input_ids[None].long(), output_hidden_states=True).hidden_states[
                LAYER_IDS[-1] + 1
            ][0]
        deepest = features.aux_hidden[:, -64:]
        assert (leaked[bounds[1] :] - deepest[bounds[1] :]).abs().max() > 1e-2


def test_drafter_preset_is_the_released_drafts_shape():
    """From Qwen3.6-27B's config (random weights cannot be had; its config can be built): the shape of
    z-lab's Qwen3.6-27B-DFlash."""
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    config = DraftConfig.from_target(Qwen3_5Config(text_config=text), mask_token_id=248070)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (5, 5120, 17408)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.vocab_size == 248320 and config.num_target_layers == 64
    assert config.target_layer_ids == [1, 16, 31, 46, 61]
    assert config.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and config.sliding_window == 2048
    assert config.in_block_causality == "sliding_causal"
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e7}
    assert config.mask_token_id == 248070 and config.block_size == 16


def test_other_targets_keep_todays_rule():
    from transformers import Qwen3Config

    config = DraftConfig.from_target(
        Qwen3Config(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        mask_token_id=151669,
    )
    assert config.layer_types == ["full_attention"] * 5 and config.target_layer_ids == [1, 9, 17, 25, 33]
    assert (config.num_attention_heads, config.intermediate_size) == (32, 12288)


def test_a_target_without_a_known_token_mixer_is_refused(tmp_path):
    """LFM2's convolution layers have no self_attn: capture could not keep documents apart in them."""
    from transformers import AutoConfig as Auto
    from transformers import AutoModelForCausalLM

    config = Auto.for_model(
        "lfm2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedTarget, match=r"'lfm2': layer 0 .*neither self_attn nor a Gated-DeltaNet"):
        Target.load(TargetConfig(path=str(tmp_path), dtype="float32"), [1])
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "lfm2"


@pytest.mark.parametrize("form", FORMS)
def test_a_mixture_of_experts_target_is_not_compiled_unless_asked(tmp_path, form):
    """On an H200 the compiled decoder layer of the tiny Qwen3.5-MoE target was still compiling after minutes
    (the GPU capture test below hung on it), with transformers' grouped_mm experts in the graph or kept out of
    it; uncompiled it captured at once. So on CUDA a MoE target runs its layers uncompiled by default, and a
    dense one of the same family compiles."""
    model = reference_model(tiny_qwen35(tmp_path, form))
    cuda = torch.device("cuda")  # only the decision: nothing is put on a GPU
    assert compiles_by_default(model, cuda, host_loop=False, sharded=False) == (form != "moe")
    assert not compiles_by_default(model, torch.device("cpu"), host_loop=False, sharded=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["multimodal", "moe"])
def test_gpu_packed_capture_with_fla_varlen_kernels(tmp_path, form):
    """On GPU the linear layers run flash-linear-attention's varlen kernels over cu_seqlens (one launch for
    every document); in bf16 they agree with each document's own HF forward within bf16 rounding, and with
    the exact per-document path. Relative Frobenius errors: in bf16 a mixture-of-experts router may pick
    another expert for a token whose scores nearly tie, which a max-abs comparison would blow up."""
    path = tiny_qwen35(tmp_path, form)
    target = Target.load(TargetConfig(path=str(path), dtype="bfloat16", device="cuda"), LAYER_IDS)
    assert target.linear == "fla", "flash-linear-attention must be installed on GPU machines"
    batch = packed([300, 17, 700, 1, 90])
    fla = target.capture(batch).aux_hidden.float()
    exact = Target(target.model, LAYER_IDS, attention="sdpa", compile=False)
    exact.linear = "per_document"
    per_document = exact.capture(batch).aux_hidden.float()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    bounds = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            out = reference(batch.input_ids[None, start:end].long().cuda(), output_hidden_states=True)
            expected = torch.cat([out.hidden_states[k + 1][0] for k in LAYER_IDS], dim=-1).float()
            for name, got in (("fla", fla), ("per_document", per_document)):
                error = float((got[start:end] - expected).norm() / expected.norm())
                print(f"{form} document at {start}: {name} relative error {error:.2e}")
                assert error < 2e-2, (name, start, error)
    assert float((fla - per_document).norm() / per_document.norm()) < 2e-2


def remembering_target(path):
    """The tiny Qwen3.5 with slowly decaying Gated-DeltaNet states that weigh on the output, so that a state
    that ran over rejected tokens changes the greedy text (random init forgets within a few tokens)."""
    model = reference_model(path)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-6.0)
                layer.linear_attn.out_proj.weight.mul_(8)
    return model


def test_speculative_decoding_against_a_hybrid_target_is_lossless(tmp_path):
    """Rejected drafts ran through the linear layers' state, which cannot be cropped like a KV cache: the
    state before the block is kept and the kept tokens replayed, so the text equals plain greedy decoding."""
    from producer.acceptance.decoder import greedy_decode, speculative_decode
    from producer.target_model.greedy import GreedyTarget
    from tests.test_evaluate import OracleContext

    target = GreedyTarget(remembering_target(tiny_qwen35(tmp_path, "text")), [1, 3])
    assert target.recurrent
    naive_mismatches, seen = 0, set()
    for seed in range(4):
        ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(seed))
        longer = greedy_decode(target, ids, 44)  # the oracle's text: a block past the end (one decode, 4 s a prompt)
        plain = longer[:40]

        def oracle():
            flips = torch.Generator().manual_seed(seed)
            return OracleContext(len(ids), longer, corrupt=lambda: bool(torch.rand(1, generator=flips) < 0.3))

        decoded = speculative_decode(oracle(), target, ids, 40)
        assert decoded.tokens == plain
        assert decoded.replayed and all(1 <= n < 4 for n in decoded.replayed)
        seen.update(decoded.accepted)
        target.recurrent = False  # what cropping alone does: the state keeps the rejected tokens
        naive_mismatches += speculative_decode(oracle(), target, ids, 40).tokens != plain
        target.recurrent = True
    assert seen == {0, 1, 2, 3}
    assert naive_mismatches >= 3, "the test must be able to see a state that was not put back"


def test_the_evaluator_on_a_hybrid_target_drafts_what_live_decoding_drafts(tmp_path, monkeypatch):
    """Live decoding of a hybrid target puts its state back and replays the kept tokens after each rejection; the
    evaluator's replay from the target's reference (continuations decoded one prompt at a time, drafted together)
    drafts every block live decoding drafts, at the same anchors."""
    import numpy as np

    from common.batch import Document
    from common.config import EvalConfig
    from common.drafter.model import DFlashDrafter
    from producer.acceptance.evaluator import AcceptanceEvaluator
    from tests.test_evaluate import live_and_replayed_drafts

    path = tiny_qwen35(tmp_path, "multimodal")
    model = remembering_target(path)
    head = load_target_head(path)
    config = DraftConfig.from_target(model.config, num_draft_layers=2, mask_token_id=127, block_size=4)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, head).eval()
    for name, weight in drafter.named_parameters():  # drafts that depend on the context
        if name.endswith("proj.weight") or name == "fc.weight":
            torch.nn.init.normal_(weight, std=0.3)
    documents = [
        Document(
            sample_id=i,
            input_ids=np.random.default_rng(i).integers(0, 127, 40).astype(np.int32),
            loss_mask=np.r_[np.zeros(12, np.uint8), np.ones(28, np.uint8)],
        )
        for i in range(3)
    ]
    evaluator = AcceptanceEvaluator(
        model, documents, EvalConfig(max_new_tokens=24), config.target_layer_ids, num_anchors=8
    )
    assert evaluator.target.recurrent and not evaluator.target.batchable
    live, replayed, report = live_and_replayed_drafts(evaluator, drafter, monkeypatch)
    assert live == replayed and len(live) == report.target_forwards - 3 and report.reference_seconds > 0
    # A producer evaluates between its batches with the very modules it captures with: nothing may stay hooked.
    assert not any(layer._forward_hooks for layer in model.model.layers)


def test_pipeline_trains_and_evaluates_a_drafter_for_a_saved_qwen35(short_tmp):
    """The real job in small: run_all.sh with target.path at a multimodal Qwen3.5 checkpoint, real producers
    and trainer, the drafter preset (sliding layers, window 2048), and a real evaluation at the end."""
    from common.rundir import RunDir
    from tests.test_pipeline import finish, start

    path = tiny_qwen35(short_tmp / "qwen35", "multimodal")
    run_dir = short_tmp / "run"
    finish(
        start(
            run_dir,
            f"target.path={path}",
            "target.config_overrides={}",
            "training.max_steps=12",
            "eval.every_steps=12",
            "eval.num_prompts=2",
            "eval.max_new_tokens=16",
        ),
        run_dir,
        timeout=300,
    )
    run = RunDir(run_dir)
    drafter = json.loads((run.latest_checkpoint() / "drafter" / "config.json").read_text())
    assert drafter["layer_types"] == ["sliding_attention", "full_attention"] and drafter["sliding_window"] == 2048
    assert drafter["num_attention_heads"] == 32 and drafter["head_dim"] == 128
    assert json.loads((run.latest_checkpoint() / "trainer_state.json").read_text())["step"] == 12
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    evaluated = [m for m in metrics if "eval/tau" in m]
    assert evaluated and 1.0 <= evaluated[-1]["eval/tau"] <= 4 and 0 < evaluated[-1]["eval/generated_tokens"] <= 2 * 16
    statuses = ProducerStatus.read_all(run)
    assert {s.id for s in statuses} == {0, 1}
    assert all(s.kernels["linear_attention"] == "per_document" for s in statuses)


def test_pipeline_stops_at_once_for_a_target_it_cannot_capture(short_tmp):
    """An unusable target is an error that repeats on every try: exit 2 within seconds, naming the model type,
    and no restart loop."""
    import time

    from transformers import AutoConfig as Auto
    from transformers import AutoModelForCausalLM

    from tests.test_pipeline import ONE_PRODUCER, start

    config = Auto.for_model(
        "lfm2",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention"] * 4,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(short_tmp / "lfm2")
    run_dir = short_tmp / "run"
    began = time.monotonic()
    launcher = start(run_dir, *ONE_PRODUCER, f"target.path={short_tmp / 'lfm2'}", "target.config_overrides={}")
    code = launcher.wait(timeout=120)
    output = (run_dir.parent / "launcher.out").read_text()
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("producer*.log"))
    assert code == 2, output[-2000:]
    assert "'lfm2'" in logs and "neither self_attn nor a Gated-DeltaNet" in logs
    assert time.monotonic() - began < 90
    assert "restarting" not in output.lower(), output[-2000:]


@pytest.mark.parametrize(
    "name",
    [
        "qwen3.6-27b-1gpu.toml",
        "qwen3.6-27b-8gpu.toml",
        "qwen3-8b-1gpu.toml",
        "qwen3-8b-8gpu.toml",
        "llama-3.1-8b-instruct.toml",
    ],
)
def test_example_configs_load(tmp_path, name):
    from pathlib import Path

    from common.config import load_config

    root = Path(__file__).resolve().parents[1]
    target = tiny_qwen35(tmp_path / "target", "multimodal")
    data = tmp_path / "train.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n"
    )
    cfg = load_config(
        root / "launch" / name, [f"target.path={target}", f'data.paths=["{data}"]', f'eval.paths=["{data}"]']
    )
    assert cfg.data.format == "chat" and cfg.target.dtype == "bfloat16" and cfg.drafter.block_size == 16
    devices = len(cfg.launch.producer_devices) + len(cfg.launch.trainer_devices)
    assert devices == (8 if "8gpu" in name else 2)

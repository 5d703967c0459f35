"""The target side: loading, the packed capture and its exactness against a plain HF forward."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from common.batch import PackedBatch
from common.config import TargetConfig
from common.hf import target_identity
from producer.target_model.capture import CapturedFeatures, Target
from producer.target_model.flops import flops_per_document
from producer.target_model.load import load_target_model

ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS = 6
LAYER_IDS = [1, 3]  # drafter numbering: outputs of decoder layers 1 and 3 == HF hidden_states[2], [4]
TIGHT = dict(atol=1e-5, rtol=1e-5)
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    fields = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3Config(**fields)


@pytest.fixture(scope="module")
def saved_target_dir(tmp_path_factory):
    """A tiny Qwen3 with random weights saved with save_pretrained (fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(saved_target_dir) -> Target:
    cfg = TargetConfig(path=str(saved_target_dir), dtype="float32", device="cpu")
    return Target.load(cfg, LAYER_IDS, capture_last_hidden=True)


def make_batch(lengths: list[int], vocab: int = 512, seed: int = 0) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return PackedBatch(
        input_ids=torch.randint(0, vocab, (total,), generator=generator, dtype=torch.int32),
        loss_mask=torch.ones(total, dtype=torch.uint8),
        cu_seqlens=cu,
        sample_ids=torch.arange(len(lengths)),
    )


def documents(batch: PackedBatch):
    bounds = batch.cu_seqlens.tolist()
    return [(start, end, batch.input_ids[start:end].long()) for start, end in zip(bounds[:-1], bounds[1:])]


def hf_reference(model, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Plain HF forward of one document: (hidden_states tuple, output of the last decoder layer)."""
    seen = []
    hook = model.model.layers[-1].register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    last_layer_output = seen[0][0] if isinstance(seen[0], tuple) else seen[0]
    return out.hidden_states, last_layer_output[0]


def test_loaded_from_disk_in_requested_dtype(target: Target):
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    assert target.model.config.num_hidden_layers == NUM_LAYERS
    assert target.attention == "sdpa" and not target.compiled


def test_capture_equals_hf_hidden_states_per_document(target: Target):
    batch = make_batch([7, 19, 1, 33])
    features = target.capture(batch)
    hidden = target.hidden_size
    for start, end, ids in documents(batch):
        hidden_states, _ = hf_reference(target.model, ids)
        for slot, layer_id in enumerate(LAYER_IDS):
            expected = hidden_states[layer_id + 1][0]  # layer k's output is hidden_states[k + 1]
            got = features.aux_hidden[start:end, slot * hidden : (slot + 1) * hidden]
            torch.testing.assert_close(got, expected, **TIGHT)


def test_last_hidden_is_last_layer_output_before_final_norm(target: Target):
    batch = make_batch([12, 25], seed=1)
    features = target.capture(batch)
    for start, end, ids in documents(batch):
        hidden_states, last_layer_output = hf_reference(target.model, ids)
        torch.testing.assert_close(features.last_hidden[start:end], last_layer_output, **TIGHT)
        # transformers ties hidden_states[-1] to the NORMED output: it is norm(last_hidden), not last_hidden.
        torch.testing.assert_close(hidden_states[-1][0], target.base.norm(features.last_hidden[start:end]), **TIGHT)
        assert not torch.allclose(hidden_states[-1][0], features.last_hidden[start:end])


def test_packing_equals_each_document_alone(target: Target):
    lengths = [5, 40, 2, 17]
    packed = make_batch(lengths, seed=2)
    together = target.capture(packed)
    for start, end, _ in documents(packed):
        alone = make_batch([end - start])
        alone.input_ids = packed.input_ids[start:end].clone()
        single = target.capture(alone)
        torch.testing.assert_close(together.aux_hidden[start:end], single.aux_hidden, **TIGHT)
        torch.testing.assert_close(together.last_hidden[start:end], single.last_hidden, **TIGHT)


def test_capture_writes_into_caller_buffers(target: Target):
    batch = make_batch([9, 14], seed=3)
    reference = target.capture(batch)
    slot = torch.zeros(64, target.aux_width + target.hidden_size, dtype=torch.bfloat16)
    aux_view, last_view = slot[: batch.num_tokens, : target.aux_width], slot[: batch.num_tokens, target.aux_width :]
    result = target.capture(batch, out_aux=aux_view, out_last=last_view)
    assert result.aux_hidden.data_ptr() == aux_view.data_ptr()
    torch.testing.assert_close(aux_view, reference.aux_hidden.to(torch.bfloat16))
    torch.testing.assert_close(last_view, reference.last_hidden.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_aux"):
        target.capture(batch, out_aux=torch.empty(3, target.aux_width))


def test_early_stop_runs_no_later_layer_no_norm_no_head(saved_target_dir):
    cfg = TargetConfig(path=str(saved_target_dir), dtype="float32", device="cpu")
    target = Target.load(cfg, LAYER_IDS, capture_last_hidden=False)
    calls: dict[str, int] = {}

    def counter(name):
        return lambda *_: calls.__setitem__(name, calls.get(name, 0) + 1)

    modules = {f"layer{i}": layer for i, layer in enumerate(target.base.layers)}
    modules.update(norm=target.base.norm, lm_head=target.model.lm_head)
    hooks = [module.register_forward_hook(counter(name)) for name, module in modules.items()]
    try:
        features = target.capture(make_batch([6, 10]))
    finally:
        for hook in hooks:
            hook.remove()
    assert isinstance(features, CapturedFeatures) and features.last_hidden is None
    assert calls == {f"layer{i}": 1 for i in range(LAYER_IDS[-1] + 1)}  # later layers, norm, head: 0 calls


def test_sliding_window_layers_are_honoured():
    # Qwen3 with sliding-window layers: the per-document kernel must apply the same window as HF.
    config = tiny_qwen3_config(use_sliding_window=True, sliding_window=4, max_window_layers=2)
    cfg = TargetConfig(dtype="float32", device="cpu", config_overrides=config.to_diff_dict())
    target = Target.load(cfg, [0, 4], capture_last_hidden=True)
    assert "sliding_attention" in target.model.config.layer_types
    batch = make_batch([11, 3], seed=4)
    features = target.capture(batch)
    for start, end, ids in documents(batch):
        hidden_states, last = hf_reference(target.model, ids)
        torch.testing.assert_close(features.aux_hidden[start:end, 64:], hidden_states[5][0], **TIGHT)
        torch.testing.assert_close(features.last_hidden[start:end], last, **TIGHT)


@pytest.mark.parametrize("tile", [16, 128])
@pytest.mark.parametrize("window", [None, 5, 40, 300])
@pytest.mark.parametrize("seed", range(3))
def test_the_packed_causal_mask_lists_exactly_the_tiles_with_visible_pairs(tile, window, seed):
    """The flex path's document-causal mask takes its tiles from the documents' bounds (a CPU flex forward
    evaluates every pair, so only the tiles can tell): pooled from the dense mask, the listed tiles are exactly
    those with a visible pair, and a full one is visible throughout."""
    import torch.nn.functional as F

    from common.batch import document_ids
    from producer.target_model.attention import document_causal_block_mask, document_causal_tiles

    lengths = torch.randint(1, 300, (7,), generator=torch.Generator().manual_seed(seed))
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    doc = document_ids(cu_seqlens)
    position = torch.arange(doc.numel())
    dense = (doc[:, None] == doc[None, :]) & (position[:, None] >= position[None, :])
    if window is not None:
        dense &= position[:, None] - position[None, :] < window
    pad = -doc.numel() % tile
    pooled = lambda m: m.view(m.shape[0] // tile, tile, m.shape[1] // tile, tile)
    some = pooled(F.pad(dense, (0, pad, 0, pad), value=False)).any(3).any(1)
    every = pooled(F.pad(dense, (0, pad, 0, pad), value=True)).all(3).all(1)
    partial, full = document_causal_tiles(doc, window, tile)
    assert torch.equal(partial | full, some) and not (partial & full).any()
    assert not (full & ~every).any()
    if window is None and tile == 16:
        assert full.any()  # documents of up to 300 tokens span whole tiles: the full path is exercised
    ours = document_causal_block_mask(doc, window, tile)
    assert torch.equal(ours.to_dense()[0, 0].bool(), some)
    # The same four tile lists as flex attention's own create_block_mask (key side and the query side that the
    # backward reads), evaluated here at every pair of tokens.
    from torch.nn.attention.flex_attention import create_block_mask

    from tests.drafter_fixtures import listed_tiles

    theirs = create_block_mask(ours.mask_mod, None, None, doc.numel(), doc.numel(), device="cpu", BLOCK_SIZE=tile)
    for name in ("kv", "full_kv", "q", "full_q"):
        assert torch.equal(listed_tiles(ours, name), listed_tiles(theirs, name)), name


def test_the_packed_causal_mask_of_65536_tokens_costs_megabytes():
    """65,536 packed tokens are 4.3 G token pairs: finding the tiles by evaluating the mask at each (flex
    attention's create_block_mask) needs tens of GiB. In a process of its own under an 8 GiB address-space limit,
    the resident memory that building the mask adds is measured."""
    import sys

    code = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
import torch
from common.batch import document_ids
from producer.target_model.attention import document_causal_block_mask
doc = document_ids(torch.arange(0, 65537, 1024, dtype=torch.int32))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
mask = document_causal_block_mask(doc, 4096)
print(tuple(mask.shape[-2:]), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("(65536, 65536)") and int(done.stdout.split()[-1]) < 256, done.stdout


def test_random_target_is_deterministic_given_seed():
    first = load_target_model(TargetConfig(dtype="float32", device="cpu", seed=7))
    second = load_target_model(TargetConfig(dtype="float32", device="cpu", seed=7))
    other = load_target_model(TargetConfig(dtype="float32", device="cpu", seed=8))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    embed = lambda m: m.get_input_embeddings().weight  # noqa: E731
    assert not torch.equal(embed(first), embed(other))
    assert target_identity(first.config, embed(first)) == target_identity(second.config, embed(second))


def test_identity_changes_with_weights_and_config(saved_target_dir, target: Target):
    from transformers import AutoConfig

    config = target.model.config
    weight = target.base.embed_tokens.weight
    identity = target.identity
    assert identity.startswith("qwen3-L6-H64-")
    # The same model loaded again (another process, another attention setting) has the same identity.
    reloaded = AutoConfig.from_pretrained(saved_target_dir)
    assert target_identity(reloaded, weight) == identity
    nudged = weight.clone()
    nudged[3, 5] += 1e-3
    assert target_identity(config, nudged) != identity
    assert target_identity(config, weight.to(torch.bfloat16)) != identity
    changed = AutoConfig.from_pretrained(saved_target_dir, rms_norm_eps=1e-3)
    assert target_identity(changed, weight) != identity


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        TargetConfig(dtype="int8")
    with pytest.raises(ValueError, match="attention"):
        TargetConfig(attention="paged")
    with pytest.raises(ValueError, match="path"):
        TargetConfig(path=str(tmp_path))
    with pytest.raises(ValueError, match="config_json"):
        TargetConfig(config_json=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="seed"):
        TargetConfig(seed=-1)
    with pytest.raises(ValueError, match="device"):
        TargetConfig(device="tpu:banana")


def test_random_target_from_config_json_at_given_shapes(tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(tiny_qwen3_config(num_hidden_layers=3).to_dict()))
    target = Target.load(TargetConfig(config_json=str(config_path), device="cpu", dtype="float32"), [0, 1])
    assert len(target.base.layers) == 3 and target.num_layers_run == 2
    assert target.capture(make_batch([4, 4])).aux_hidden.shape == (8, 128)


def test_config_overrides_apply_to_a_loaded_target(saved_target_dir):
    cfg = TargetConfig(
        path=str(saved_target_dir), dtype="float32", device="cpu", config_overrides={"num_hidden_layers": 4}
    )
    target = Target.load(cfg, [1, 2])
    assert len(target.base.layers) == 4 and target.model.config.num_hidden_layers == 4


def test_an_override_that_changes_stored_weight_shapes_is_refused_naming_the_key(saved_target_dir):
    cfg = TargetConfig(path=str(saved_target_dir), dtype="float32", device="cpu", config_overrides={"vocab_size": 64})
    with pytest.raises(
        ValueError, match=r"target.config_overrides.vocab_size=64 contradicts the stored target's vocab_size=512"
    ):
        load_target_model(cfg)


def test_a_run_with_target_path_and_the_tiny_defaults_override_stops_with_exit_2(saved_target_dir, short_tmp):
    """launch/tiny.toml sets vocab_size=64 for its random target. Before the check, a stored target with
    another vocabulary failed inside transformers, and the launcher restarted the producers for minutes."""
    run_dir = short_tmp / "run"
    result = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "--run-dir",
            str(run_dir),
            f'target.path="{saved_target_dir}"',
            "logging.wandb_mode=disabled",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    # The first producer to fail stops the run: the other may be stopped before it gets to its own error.
    logs = [(run_dir / "logs" / f"producer-{i}.log").read_text() for i in (0, 1)]
    assert any("target.config_overrides.vocab_size=64" in log and "target.config_overrides={}" in log for log in logs)
    assert [log.count(f"==== producer-{i} start") for i, log in enumerate(logs)] == [1, 1], (
        "a configuration error is not restarted"
    )


def test_flop_count_of_qwen3_8b_shape():
    config = tiny_qwen3_config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    )
    per_token_params = (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288) * 34
    assert flops_per_document(config, 34, 1) == 2.0 * per_token_params + 34 * 2 * 1 * 2 * 32 * 128


@pytest.mark.gpu
@cuda_only
@pytest.mark.parametrize("attention", ["varlen", "flex", "sdpa"])
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_packed_kernels_match_reference(saved_target_dir, attention, compiled):
    if attention == "sdpa" and compiled:
        pytest.skip("sdpa is never compiled")
    cfg = TargetConfig(
        path=str(saved_target_dir), dtype="bfloat16", device="cuda", attention=attention, compile=compiled
    )
    target = Target.load(cfg, LAYER_IDS, capture_last_hidden=True)
    assert next(target.model.parameters()).is_cuda
    reference = Target(target.model, LAYER_IDS, capture_last_hidden=True, attention="sdpa", compile=False)
    for seed, lengths in enumerate([[300, 17, 1, 700], [129, 128, 5], [1024]]):
        batch = make_batch(lengths, seed=seed)
        got, want = target.capture(batch), reference.capture(batch)
        torch.testing.assert_close(got.aux_hidden.float(), want.aux_hidden.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(got.last_hidden.float(), want.last_hidden.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda_only
def test_cuda_random_target_is_built_on_device_and_deterministic():
    first = load_target_model(TargetConfig(device="cuda", seed=3))
    second = load_target_model(TargetConfig(device="cuda", seed=3))
    assert all(p.is_cuda for p in first.parameters())
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)

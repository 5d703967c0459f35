"""Long documents (issue 46): anchors over the whole document, drafter masks and memory linear in its length for
sliding layers, the producer's capture of one long packed row, ring slots that hold it, a clear skip or stop for a
document longer than a batch, and the presets."""

from __future__ import annotations

import dataclasses
import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.batch import PackedBatch, SlotDims, slot_shapes
from common.codec import bytes_needed, plan_layout, read_tensors
from common.config import BatchingConfig, ConfigError, DataConfig, load_config
from common.drafter.blocks import build_blocks, sample_anchors
from common.drafter.masks import build_masks, dense_reference_mask, tiled_mask
from common.drafter.model import DFlashDrafter
from producer.data.batching import LONGER_THAN_BATCH, BatchPlan
from producer.data.build import build_data_source
from producer.data.files import DataError
from producer.data.order import OrderConfig, ShardOrder
from tests.drafter_fixtures import random_batch, random_head, tiny_config

ROOT = Path(__file__).resolve().parents[1]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_document(length: int, supervised_from: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_mask, cu_seqlens) of one document supervised from ``supervised_from`` on."""
    loss_mask = torch.zeros(length, dtype=torch.uint8)
    loss_mask[supervised_from:] = 1
    return loss_mask, torch.tensor([0, length], dtype=torch.int32)


# -- anchors over the whole document ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_anchors_cover_a_64k_document_evenly_from_its_start_to_its_end(seed):
    """512 anchors over one 65,536-token document: each sixteenth of it holds its 32 (a uniform draw of 512 puts
    32 +- 6 there), no two neighbours are more than two strata apart, and the first and last strata are reached."""
    total, count = 65536, 512
    loss_mask, cu_seqlens = one_document(total)
    anchors, valid = sample_anchors(loss_mask, cu_seqlens, count, generator(seed))
    assert bool(valid.all()) and anchors.unique().numel() == count
    per_sixteenth = torch.bincount(anchors // (total // 16), minlength=16)
    assert (per_sixteenth - 32).abs().max() <= 1, per_sixteenth.tolist()
    stratum = (total - 2) / count  # candidates per anchor
    assert int(torch.diff(anchors).max()) < 2 * stratum + 1
    assert int(anchors[0]) < stratum + 1 and int(anchors[-1]) >= total - stratum - 2


def test_anchors_spread_over_the_supervised_stretches_and_no_position_is_favoured():
    """Anchors need a supervised next token: on a conversation supervised only in its two answers, every anchor is
    in an answer and both get their share. Over many draws every candidate is as likely (flat within 15%)."""
    loss_mask = torch.zeros(4096, dtype=torch.uint8)
    loss_mask[1000:2000] = 1
    loss_mask[3000:4096] = 1
    cu_seqlens = torch.tensor([0, 4096], dtype=torch.int32)
    counts = torch.zeros(4096)
    for seed in range(200):
        anchors, valid = sample_anchors(loss_mask, cu_seqlens, 64, generator(seed))
        assert bool(loss_mask[anchors + 1].all())
        first_answer = int(((anchors >= 999) & (anchors < 2000)).sum())
        assert 29 <= first_answer <= 31  # 999 of its 2,094 candidates: 30.5 of 64
        counts[anchors] += 1
    per_stretch = torch.stack([counts[999 + 128 * i : 999 + 128 * (i + 1)].sum() for i in range(7)])
    per_stretch = torch.cat(
        [per_stretch, torch.stack([counts[2999 + 128 * i : 2999 + 128 * (i + 1)].sum() for i in range(8)])]
    )
    assert float(per_stretch.max() / per_stretch.min()) < 1.15, per_stretch.tolist()


# -- the drafter's masks: tiled == dense, and linear for sliding layers --------------------------------------------


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("window", [None, 3, 37])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [16, 128])
def test_the_tiled_mask_holds_exactly_the_dense_reference(block_size, window, causal, tile):
    """Every visible pair of the dense reference lies in its tile's stretch and the tile's mask; nothing else does."""
    config = tiny_config(block_size=block_size)
    batch = random_batch([300, 2, 90, 1, 500], config, seed=block_size, supervised_fraction=0.7)
    blocks = build_blocks(batch, 60, block_size, config.mask_token_id, generator(0))
    dense = dense_reference_mask(blocks, window, causal)
    mask = tiled_mask(blocks, window, causal, tile=tile)
    rebuilt = torch.zeros_like(dense)
    context = blocks.num_context
    for index, (q_start, q_end, kv_start, kv_end) in enumerate(mask.tiles):
        assert (q_end - q_start) % block_size == 0
        tile_mask = mask.tile_mask(index)
        rebuilt[q_start:q_end, kv_start:kv_end] = tile_mask[:, : kv_end - kv_start]
        rebuilt[q_start:q_end, context + q_start : context + q_end] = tile_mask[:, kv_end - kv_start :]
    assert torch.equal(rebuilt, dense)


@pytest.mark.parametrize("causality", ["sliding_causal", "bidirectional", "causal"])
def test_the_tiled_step_equals_the_dense_step_in_loss_and_gradients(causality):
    """The CPU training path (tiles) against SDPA with the dense masks: same loss, same gradients, for sliding and
    full layers, a window smaller than the block, and several documents."""
    config = tiny_config(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
        block_size=8,
        in_block_causality=causality,
    )
    batch = random_batch([300, 90, 500, 3], config, seed=2, supervised_fraction=0.9)
    results = []
    for backend in ("tiled", "sdpa"):
        torch.manual_seed(0)
        drafter = DFlashDrafter(config, random_head(config), attention_backend=backend)
        blocks, masks = drafter.prepare(batch, 64, generator(0))
        assert all(isinstance(m, torch.Tensor) for m in masks.values()) == (backend == "sdpa")
        loss, _ = drafter.forward_train(batch, 64, generator(0), prepared=(blocks, masks))
        loss.backward()
        results.append(
            (loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        )
    (tiled_loss, tiled_grads), (dense_loss, dense_grads) = results
    torch.testing.assert_close(tiled_loss, dense_loss, rtol=1e-5, atol=1e-6)
    assert tiled_grads.keys() == dense_grads.keys() and len(tiled_grads) > 10
    for name in tiled_grads:
        torch.testing.assert_close(tiled_grads[name], dense_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_layers_on_the_cpu_compile_once_whatever_each_batchs_tiles():
    """training.compile=true on the CPU: a tile's bounds are host ints of each batch's anchors, so the compiled layers
    leave the tiled attention out. Traced through, every batch recompiled every layer: a tiny step took 8.4 s against
    0.41 s eager, until dynamo's recompile limit sent the layers back to eager."""
    from torch._dynamo.testing import CompileCounter

    config = tiny_config()
    drafter = DFlashDrafter(config, random_head(config), attention_backend="tiled")
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in drafter.layers:
        layer.compile(backend=counter, dynamic=False)
    compiled = []
    for seed in range(3):  # the same shapes, other anchors: other tiles
        batch = random_batch([200, 90, 230], config, seed=seed)
        blocks, masks = drafter.prepare(batch, 16, generator(seed))
        drafter(batch.aux_hidden, blocks, masks).sum().backward()
        compiled.append(counter.frame_count)
    torch._dynamo.reset()
    assert compiled[0] > 0 and compiled[1:] == [compiled[0]] * 2, compiled


def attended_pairs(doc_len: int, tokens: int, anchors: int, layer_type: str, window: int = 256) -> tuple[int, int]:
    """(query-key pairs the tiles attend over, the largest tile mask) of one step's masks at these shapes."""
    config = tiny_config(block_size=16, layer_types=[layer_type, layer_type], sliding_window=window)
    cu_seqlens = torch.arange(0, tokens + 1, doc_len, dtype=torch.int32)
    loss_mask = torch.ones(tokens, dtype=torch.uint8)
    loss_mask[cu_seqlens[:-1].long()] = 0
    batch = PackedBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=cu_seqlens,
        sample_ids=torch.arange(tokens // doc_len),
    )
    blocks = build_blocks(batch, anchors, 16, config.mask_token_id, generator(0))
    mask = build_masks(blocks, config, form="tiled")[layer_type]
    sizes = [
        (q_end - q_start) * (kv_end - kv_start + q_end - q_start) for q_start, q_end, kv_start, kv_end in mask.tiles
    ]
    return sum(sizes), max(sizes)


def test_a_sliding_layer_attends_as_much_at_64k_tokens_a_document_as_at_4k():
    """At equal tokens and anchors per step, the pairs a sliding layer's tiles attend over (its work and the memory
    of its masks) do not depend on the documents' length, and no tile's mask holds more than a tile of queries by
    the window and the tile's span; a full layer's pairs grow with the document, as each block sees it whole."""
    sliding = {doc_len: attended_pairs(doc_len, 65536, 512, "sliding_attention") for doc_len in (4096, 65536)}
    assert 0.9 < sliding[65536][0] / sliding[4096][0] < 1.1, sliding
    queries_per_tile, span = 128, 8 * (65536 // 512)
    assert sliding[65536][1] <= queries_per_tile * (256 + span + 2 * queries_per_tile)
    full = {doc_len: attended_pairs(doc_len, 65536, 512, "full_attention")[0] for doc_len in (4096, 65536)}
    assert full[65536] / full[4096] > 10  # about 16: each block sees about half its document
    dense_pairs = 512 * 16 * (65536 + 512 * 16)
    assert sliding[65536][0] < dense_pairs / 30  # what one dense mask over the packed row holds


STEP_MEMORY = """
import ctypes, gc, json, sys
import torch
from common.batch import PackedBatch
from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import random_head, tiny_config
torch.set_num_threads(1)
length, anchors = int(sys.argv[1]), int(sys.argv[2])
config = tiny_config(block_size=16, layer_types=["sliding_attention"] * 2, sliding_window=256, head_dim=16)
loss_mask = torch.ones(length, dtype=torch.uint8)
loss_mask[0] = 0
batch = PackedBatch(
    input_ids=torch.randint(0, 60, (length,), dtype=torch.int32), loss_mask=loss_mask,
    cu_seqlens=torch.tensor([0, length], dtype=torch.int32), sample_ids=torch.arange(1),
    aux_hidden=torch.randn(length, config.fused_feature_size),
)
drafter = DFlashDrafter(config, random_head(config))
def step():
    loss, _ = drafter.forward_train(batch, anchors, torch.Generator().manual_seed(0))
    loss.backward()
    drafter.zero_grad(set_to_none=True)
def status(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))
step()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
step()
print(json.dumps({"peak_kib": status("VmHWM") - before}))
"""


def step_peak_kib(length: int, anchors: int) -> int:
    done = subprocess.run(
        [sys.executable, "-c", STEP_MEMORY, str(length), str(anchors)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_kib"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's clear_refs to reset the peak")
def test_a_training_step_on_one_document_4x_longer_takes_about_4x_the_memory_not_16x():
    """One document of 8K tokens with 128 anchors, then of 32K tokens with 512 (the same anchors per token), sliding
    layers, forward and backward on the CPU: the step's peak resident memory (a process each) grows about 4x; one
    dense mask over the packed row, queries x keys, would grow 16x (from 20 MiB to 320 MiB as bools alone)."""
    short, long = step_peak_kib(8192, 128), step_peak_kib(32768, 512)
    assert 2.5 < long / short < 6, (short, long)


# -- the producer's capture of one long document ------------------------------------------------------------------


def sliding_target(window: int, layer_types: list[str]):
    from common.config import TargetConfig
    from producer.target_model.capture import Target
    from tests.test_target import tiny_qwen3_config

    config = tiny_qwen3_config(
        num_hidden_layers=len(layer_types),
        use_sliding_window=True,
        sliding_window=window,
        layer_types=layer_types,
        max_position_embeddings=65536,
    )
    cfg = TargetConfig(dtype="float32", device="cpu", config_overrides=config.to_diff_dict())
    return Target.load(cfg, list(range(len(layer_types))), capture_last_hidden=True)


def test_sliding_capture_in_chunks_equals_the_reference_forward():
    """Documents longer than the query chunk and the window, packed with short ones: each document's features are
    those of the plain HF forward of that document alone (whose mask is the whole [L, L])."""
    from tests.test_target import TIGHT, documents, hf_reference, make_batch

    target = sliding_target(48, ["sliding_attention", "full_attention", "sliding_attention"])
    batch = make_batch([1300, 7, 600, 49], seed=5)
    features = target.capture(batch)
    for start, end, ids in documents(batch):
        hidden_states, last = hf_reference(target.model, ids)  # HF's last hidden state is normed: compare ``last``
        for slot, expected in enumerate([hidden_states[1][0], hidden_states[2][0], last]):
            torch.testing.assert_close(features.aux_hidden[start:end, slot * 64 : (slot + 1) * 64], expected, **TIGHT)
        torch.testing.assert_close(features.last_hidden[start:end], last, **TIGHT)


def test_the_capture_of_one_32k_document_attends_without_anything_quadratic(monkeypatch):
    """One 32,768-token document in one packed row through a sliding and a full layer: no attention call gets a
    mask, or a query-key product, of more than a chunk by chunk plus window (one mask over the document would be
    1 Gi pairs), and the full layer runs unmasked (flash attention, linear memory)."""
    import producer.target_model.attention as target_module

    target = sliding_target(128, ["sliding_attention", "full_attention"])
    largest = {"mask": 0, "pairs": 0, "unmasked_pairs": 0}
    original = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        pairs = query.shape[-2] * key.shape[-2]
        if attn_mask is not None:
            largest["mask"] = max(largest["mask"], attn_mask.numel())
            largest["pairs"] = max(largest["pairs"], pairs)
        else:
            assert kwargs.get("is_causal"), "an unmasked call must be causal"
            largest["unmasked_pairs"] = max(largest["unmasked_pairs"], pairs)
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(target_module.F, "scaled_dot_product_attention", spy)
    total = 32768
    batch = PackedBatch(
        input_ids=torch.randint(0, 512, (total,), dtype=torch.int32),
        loss_mask=torch.ones(total, dtype=torch.uint8),
        cu_seqlens=torch.tensor([0, total], dtype=torch.int32),
        sample_ids=torch.arange(1),
    )
    features = target.capture(batch)
    chunk = target_module.SLIDING_QUERY_CHUNK
    assert 0 < largest["mask"] <= chunk * (chunk + 128) and largest["pairs"] <= chunk * (chunk + 128)
    assert largest["unmasked_pairs"] == total * total  # the full layer: one causal flash call
    assert features.aux_hidden.shape == (total, 128) and bool(torch.isfinite(features.aux_hidden).all())


def test_a_document_of_token_budget_tokens_is_captured_into_one_ring_slot():
    """The slot is sized from batching.token_budget: bytes per token constant (4x the budget, 4x the slot), and a
    batch of one document of the whole budget lays out in it and is captured straight into its views."""
    from common.ring import create_ring

    target = sliding_target(64, ["sliding_attention", "sliding_attention"])

    def shapes(tokens: int, docs: int):
        dims = SlotDims(tokens=tokens, docs=docs, aux_width=target.aux_width, hidden_size=target.hidden_size)
        return slot_shapes(dims, target.dtype, {"last_hidden": False})

    budget = 8192
    slot_bytes = bytes_needed(shapes(budget, budget))
    assert 3.95 < bytes_needed(shapes(4 * budget, 4 * budget)) / slot_bytes < 4.05
    ring = create_ring("host", num_slots=1, slot_bytes=slot_bytes, run_tag=f"long{id(target)}", role="p0")
    try:
        batch = PackedBatch(
            input_ids=torch.randint(0, 512, (budget,), dtype=torch.int32),
            loss_mask=torch.ones(budget, dtype=torch.uint8),
            cu_seqlens=torch.tensor([0, budget], dtype=torch.int32),
            sample_ids=torch.arange(1),
        )
        views = read_tensors(ring.slot(0), plan_layout(shapes(budget, 1), slot_bytes))
        target.capture(batch, out_aux=views["aux_hidden"])
        expected = target.capture(batch).aux_hidden
        torch.testing.assert_close(views["aux_hidden"], expected)
    finally:
        del views
        ring.close()


# -- a document longer than a batch ---------------------------------------------------------------------------------


def tokenized_plan(tmp_path: Path, lengths: list[int], token_budget: int) -> BatchPlan:
    """A plan over a tokenized file whose source makes documents longer than ``token_budget``: none of ours does
    (data.max_seq_len <= batching.token_budget, and longer records are cut or dropped), so the source's limit is
    raised after the plan is made, as a source that does not hold to it would."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [i % 50 + 1] * n}) + "\n" for i, n in enumerate(lengths)))
    source = build_data_source(DataConfig(format="tokenized", paths=[str(path)], max_seq_len=token_budget))
    plan = BatchPlan(source, ShardOrder(len(source), OrderConfig(seed=0)), BatchingConfig(token_budget=token_budget))
    source.config = dataclasses.replace(source.config, max_seq_len=10 * token_budget)
    return plan


def test_a_document_longer_than_the_token_budget_is_skipped_counted_and_named_by_file_line(tmp_path, caplog):
    plan = tokenized_plan(tmp_path, [100, 900, 50, 700, 60], token_budget=512)
    trained = []
    for cursor, sample_ids in plan.iter_batches():
        if cursor.epoch == 2:  # the second epoch meets the long ones again and counts nothing more
            break
        trained.extend(sample_ids)
    assert sorted(trained) == [0, 0, 2, 2, 4, 4]
    stats = plan.source.stats
    assert stats.bad[LONGER_THAN_BATCH] == 2 and stats.documents == 3
    assert any(
        f"long.jsonl:2 {LONGER_THAN_BATCH}: 900 tokens > batching.token_budget=512" in b for b in stats.first_bad
    )
    assert "long.jsonl:4" in caplog.text and "batching.token_budget" in caplog.text


def test_a_shard_of_documents_too_long_for_any_batch_stops_naming_batching_token_budget(tmp_path):
    plan = tokenized_plan(tmp_path, [900, 700], token_budget=512)
    with pytest.raises(DataError, match=r"^batching\.token_budget: .*long\.jsonl:1 longer_than_token_budget"):
        next(plan.iter_batches())


def test_every_record_dropped_as_longer_than_max_seq_len_stops_naming_data_max_seq_len(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"input_ids": [1] * 900}) + "\n")
    data = DataConfig(format="tokenized", paths=[str(path)], max_seq_len=512, too_long="drop")
    source = build_data_source(data)
    plan = BatchPlan(source, ShardOrder(len(source), OrderConfig(seed=0)), BatchingConfig(token_budget=512))
    with pytest.raises(DataError, match=r"^data\.max_seq_len: .*long\.jsonl:1 too_long"):
        next(plan.iter_batches())


def test_a_budget_smaller_than_the_longest_document_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^batching\.token_budget: must be >= data\.max_seq_len \(32768\)"):
        load_config(None, ["data.max_seq_len=32768", "batching.token_budget=16384"])


# -- presets ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(Path(p).name for p in glob.glob(str(ROOT / "launch" / "*.toml"))))
def test_every_preset_loads(preset, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # target.path must be a model folder; the presets name /models/...
    cfg = load_config(ROOT / "launch" / preset, [f'target.path="{tmp_path}"'])
    assert cfg.batching.token_budget >= cfg.data.max_seq_len


@pytest.mark.parametrize(
    "preset, max_seq_len, layers",
    [
        ("qwen3.6-27b-long-1gpu.toml", 32768, 5),
        ("qwen3.6-27b-long-8gpu.toml", 32768, 5),
        ("smollm2-135m-long.toml", 8192, 8),
    ],
)
def test_the_long_presets_train_long_multi_turn_documents_with_sliding_layers(preset, max_seq_len, layers, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config(ROOT / "launch" / preset, [f'target.path="{tmp_path}"'])
    assert cfg.data.max_seq_len == max_seq_len and cfg.batching.token_budget >= max_seq_len
    assert cfg.drafter.layer_types == ["sliding_attention"] * layers and cfg.drafter.sliding_window == 2048
    assert cfg.synthesize.turns == "all"
    if preset.startswith("qwen"):
        assert cfg.synthesize.enable_thinking and cfg.synthesize.prompts == "data"
        assert cfg.drafter.num_anchors * 16384 == 512 * cfg.batching.token_budget  # the short preset's density
    else:
        assert cfg.synthesize.magpie_turns > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_flex_step_memory_of_a_sliding_drafter_does_not_grow_with_the_document():
    """The trainer's CUDA path (compiled flex attention, block masks from tiles) at 65,536 tokens and 512 blocks a
    step: the peak memory of a step over one 64K-token document is that over sixteen 4K ones, within 25%, and the
    loss equals the dense reference's on a smaller batch."""
    config = tiny_config(block_size=16, head_dim=16, layer_types=["sliding_attention"] * 2, sliding_window=256)
    drafter = DFlashDrafter(config, random_head(config)).cuda()
    peaks = {}
    for doc_len in (4096, 65536):
        tokens = 65536
        cu_seqlens = torch.arange(0, tokens + 1, doc_len, dtype=torch.int32)
        batch = random_batch([doc_len] * (tokens // doc_len), config, seed=1, supervised_fraction=0.9).to("cuda")
        assert torch.equal(batch.cu_seqlens.cpu(), cu_seqlens)
        for repeat in range(2):  # the first compiles
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            loss, _ = drafter.forward_train(batch, 512, torch.Generator(device="cuda").manual_seed(0))
            loss.backward()
            drafter.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            peaks[doc_len] = torch.cuda.max_memory_allocated() - before
    assert 0.8 < peaks[65536] / peaks[4096] < 1.25, peaks
    small = random_batch([3000, 900], config, seed=2, supervised_fraction=0.9).to("cuda")
    blocks, flex = drafter.prepare(small, 64, torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        hidden = drafter(small.aux_hidden, blocks, flex)
        reference = drafter(small.aux_hidden, blocks, build_masks(blocks, config, dense=True))
    torch.testing.assert_close(hidden, reference, rtol=2e-3, atol=2e-3)


def test_the_evaluators_teacher_forced_pass_builds_no_dense_mask(monkeypatch):
    """The simulated acceptance of a held-out document attends through tiles as training does: a dense mask of a
    long document's blocks against its every token is never built, and the figures are the dense path's."""
    import numpy as np

    import common.drafter.masks as masks
    from common.batch import Document
    from common.drafter.loss import LossConfig
    from producer.acceptance import simulated as evaluate
    from producer.acceptance.transcripts import DocumentFeatures

    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    drafter = DFlashDrafter(config, random_head(config)).eval()
    length = 4096
    ids = torch.randint(0, config.vocab_size, (length,), generator=generator(0))
    document = Document(0, ids.numpy().astype(np.int32), np.ones(length, dtype=np.int32))
    features = DocumentFeatures(torch.randn(length, config.fused_feature_size, generator=generator(1)))
    anchors = torch.arange(1, length - config.block_size, 97)

    def dense_is_not_built(*_args, **_kwargs):
        raise AssertionError("a dense mask was built")

    with torch.no_grad(), monkeypatch.context() as patch:
        # The reference: the same pass with dense masks.
        patch.setattr(
            evaluate, "build_masks", lambda blocks, config, **_: masks.build_masks(blocks, config, dense=True)
        )
        _, dense = evaluate.teacher_forced(drafter, LossConfig(), document, features, 0, None, anchors)
    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(masks, "dense_reference_mask", dense_is_not_built)
        _, tiled = evaluate.teacher_forced(drafter, LossConfig(), document, features, 0, None, anchors)
    for key in ("tau", "acc"):
        torch.testing.assert_close(tiled[key], dense[key])

"""DFlash 2: the convolutions stay inside their block, a warm start from DFlash proposes what DFlash did, the
selector's loss options, its teacher-forced streak equals the free walk, and our export loads into z-lab's own
reference model with the same forward and proposals."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.drafter.blocks import build_blocks
from common.drafter.dflash2.model import DFlash2KindHead, GroupedDynamicCausalConv
from common.drafter.export import (
    config_from_export,
    export_speculators,
    export_zlab,
    load_drafter,
    speculators_config,
    zlab_config,
)
from common.drafter.masks import build_masks
from common.drafter.model import DFlashDrafter, build_drafter
from producer.acceptance.decoder import draft_rows, propose_rows
from tests.drafter_fixtures import random_batch, random_head, tiny_config


def dflash2_config(**overrides):
    values = dict(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)
    values.update(overrides)
    return tiny_config(**values)


def trained_like(drafter: DFlashDrafter, seed: int = 1) -> DFlashDrafter:
    """Every added weight away from its identity / no-op start, as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return drafter


def test_convolution_equals_a_loop_over_taps_and_never_crosses_a_block():
    torch.manual_seed(0)
    conv = GroupedDynamicCausalConv(hidden_size=16, kernel_size=3, group_size=4)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(5, 6, 16)  # 5 blocks of 6 slots
    deltas = conv.deltas(x)
    out = conv.convolve(x, deltas, side=1)
    expected = torch.zeros_like(x)
    for t in range(6):
        for offset in range(3):
            if t - offset < 0:
                continue  # before the block's first slot: nothing
            kernel = conv.base_kernel[1, offset] + deltas[:, t, 1, offset].repeat_interleave(4, dim=-1)
            expected[:, t] += kernel * x[:, t - offset]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    changed = x.clone()
    changed[2] += 10.0  # block 2 only
    other = conv.convolve(changed, conv.deltas(changed), side=1)
    torch.testing.assert_close(other[[0, 1, 3, 4]], out[[0, 1, 3, 4]])
    assert not torch.allclose(other[2], out[2])


def test_a_fresh_dflash2_drafter_is_a_dflash_drafter_with_identity_convolutions():
    config = dflash2_config()
    head = random_head(config)
    torch.manual_seed(0)
    dflash = DFlashDrafter(tiny_config(), head)
    dflash2 = build_drafter(config, head)
    dflash2.warm_start(dflash.state_dict())
    batch = random_batch([20, 13, 9], config)
    blocks = build_blocks(batch, 8, config.block_size, config.mask_token_id, torch.Generator().manual_seed(0))
    masks = build_masks(blocks, config, dense=True)
    torch.testing.assert_close(dflash2(batch.aux_hidden, blocks, masks), dflash(batch.aux_hidden, blocks, masks))
    # Decoding: the no-op selector's greedy walk equals the DFlash argmax, block by block.
    contexts = [dflash.fuse_context(batch.aux_hidden[:20]), dflash.fuse_context(batch.aux_hidden[20:33])]
    tokens, positions = torch.tensor([5, 7]), torch.tensor([20, 13])
    assert torch.equal(
        propose_rows(dflash2, contexts, tokens, positions), propose_rows(dflash, contexts, tokens, positions)
    )
    # And after training the backbone in the same way, the walk is no longer the argmax alone.
    trained_like(dflash2, seed=5)  # a draw whose selector moves a pick off the argmax at these tiny sizes
    assert not torch.equal(
        propose_rows(dflash2, contexts, tokens, positions), propose_rows(dflash, contexts, tokens, positions)
    )


def test_warm_start_refuses_another_shape():
    head = random_head(dflash2_config())
    dflash2 = build_drafter(dflash2_config(), head)
    other = DFlashDrafter(tiny_config(num_hidden_layers=3), head)
    with pytest.raises(ValueError, match="not a DFlash or DFlash 2 drafter"):
        dflash2.warm_start(other.state_dict())
    with pytest.raises(RuntimeError):
        DFlashDrafter(tiny_config(), head).warm_start(dflash2.state_dict())  # DFlash from DFlash 2: no


def _objective(drafter: DFlashDrafter, seed: int = 0):
    batch = random_batch([24, 17, 11], drafter.config, seed=seed)
    return drafter.forward_train(batch, 10, torch.Generator().manual_seed(seed))


def test_the_selector_loss_trains_backbone_and_selector_and_its_metrics():
    config = dflash2_config()
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    loss, metrics = _objective(drafter)
    loss.backward()
    for name in (
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.1.mlp_conv.base_kernel",
        "fc.weight",
    ):
        assert dict(drafter.named_parameters())[name].grad.abs().sum() > 0, name
    for key in drafter.logged_metrics:
        assert torch.isfinite(metrics[key]), key
    assert 0.0 <= float(metrics["selector/accuracy"]) <= float(metrics["selector/recall"]) <= 1.0
    # With every candidate of the vocabulary, the gold is always among them.
    full = trained_like(build_drafter(dflash2_config(selector_top_k=64), random_head(config)))
    _, metrics = _objective(full)
    assert float(metrics["selector/recall"]) == 1.0


def test_stop_gradient_leaves_the_backbone_to_the_dflash_loss():
    config = dflash2_config()
    head = random_head(config)
    torch.manual_seed(0)
    stopped = trained_like(build_drafter(dflash2_config(selector_stop_gradient=True), head))
    unary_only = build_drafter(dflash2_config(selector_loss_alpha=0.0), head)
    unary_only.load_state_dict(stopped.state_dict())
    for drafter in (stopped, unary_only):
        loss, _ = _objective(drafter)
        loss.backward()
    grads = dict(unary_only.named_parameters())
    for name, param in stopped.named_parameters():
        if "candidate_selector" not in name:
            torch.testing.assert_close(param.grad, grads[name].grad, msg=name)
    assert stopped.candidate_selector.successor_codebook.grad.abs().sum() > 0


def test_missing_gold_injected_or_excluded():
    """K = 2 of a 64-token vocabulary: the gold is often not a candidate. Injected, it takes the second candidate's
    place and every supervised slot trains the selector; excluded, only the slots whose gold is a candidate do."""
    config = dflash2_config(selector_top_k=2)
    head = random_head(config)
    torch.manual_seed(0)
    inject = trained_like(build_drafter(config, head))
    exclude = build_drafter(dflash2_config(selector_top_k=2, selector_missing_gold="exclude"), head)
    exclude.load_state_dict(inject.state_dict())
    _, injected = _objective(inject)
    _, excluded = _objective(exclude)
    assert float(injected["selector/recall"]) < 1.0  # some gold tokens are missing from the top-2
    assert float(injected["selector/loss"]) != pytest.approx(float(excluded["selector/loss"]))
    # The path metrics are honest either way: a slot whose gold is not among the top-K is never right.
    assert float(injected["selector/accuracy"]) == pytest.approx(float(excluded["selector/accuracy"]))
    assert float(injected["selector/accuracy"]) <= float(injected["selector/recall"])


def test_teacher_forced_path_streak_equals_the_free_walk():
    """The training tau of DFlash 2 is its greedy walk's: each block's leading correct picks, teacher-forced, equal the
    leading matches of the selector walking freely from the block's given token."""
    config = dflash2_config()
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)), seed=3)
    batch = random_batch([40, 31], config, supervised_fraction=1.0)
    blocks = build_blocks(batch, 12, config.block_size, config.mask_token_id, torch.Generator().manual_seed(0))
    hidden = drafter(batch.aux_hidden, blocks, build_masks(blocks, config, dense=True))
    _, metrics = drafter.objective(hidden, blocks)
    walked = drafter.propose(hidden, blocks.block_ids[:, 0]).tokens
    matches = ((walked == blocks.label_ids) & blocks.label_mask).long().cumprod(1).sum(1).float() * blocks.valid
    torch.testing.assert_close(metrics["block_streaks"], matches)


def test_export_round_trip_keeps_the_kind_and_its_fields(tmp_path):
    config = dflash2_config(selector_rank=8, selector_top_k=3, conv_kernel_size=3)
    head = random_head(config)
    drafter = trained_like(build_drafter(config, head))
    exported = zlab_config(config)
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert {
        k: exported["dflash_config"][k]
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    } == {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 3}
    assert config_from_export(exported) == config
    for fmt, write in (
        ("zlab", lambda d: export_zlab(drafter, d, dtype=None)),
        ("speculators", lambda d: export_speculators(drafter, d, "verifier", dtype=None)),
    ):
        loaded = load_drafter(write(tmp_path / fmt), head)
        assert isinstance(loaded.head, DFlash2KindHead) and loaded.config == config, fmt
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (fmt, name)


def test_a_speculators_dflash2_config_without_the_causality_flag_reads_as_speculators_defaults_it():
    """speculators' dflash2 config defaults sliding_window_non_causal to True (dflash: False): an export written
    elsewhere that leaves it out trained its sliding layers bidirectional inside the block."""
    config = dflash2_config(
        layer_types=["sliding_attention", "sliding_attention"], sliding_window=8, in_block_causality="bidirectional"
    )
    exported = speculators_config(config, "verifier")
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["sliding_window_non_causal"] is True
    for key in ("sliding_window_non_causal", "in_block_causality"):
        del exported[key]
    assert config_from_export(exported).causal_per_layer == [False, False]
    dflash = speculators_config(
        tiny_config(
            layer_types=["sliding_attention", "sliding_attention"], sliding_window=8, in_block_causality="causal"
        ),
        "verifier",
    )
    for key in ("sliding_window_non_causal", "in_block_causality"):
        del dflash[key]
    assert config_from_export(dflash).causal_per_layer == [True, True]


reference = pytest.mark.skipif(
    importlib.util.find_spec("dflash") is None,
    reason="z-lab's reference package is missing: pip install --no-deps dflash==0.1.0 (launch/setup.sh installs it)",
)


@reference
@pytest.mark.parametrize("trained", [False, True])
def test_our_forward_and_proposals_equal_the_reference_model_loaded_from_our_export(tmp_path, trained):
    from dflash.model import DFlash2DraftModel

    config = dflash2_config(selector_top_k=8)
    head = random_head(config)
    torch.manual_seed(0)
    drafter = build_drafter(config, head)
    if trained:
        trained_like(drafter)
    else:  # random backbone, identity additions, no-op selector: still a forward to compare
        drafter.reset_parameters(0.2)
    export_zlab(drafter, tmp_path, dtype=torch.float32)
    ref = DFlash2DraftModel.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, 11, config.fused_feature_size, generator=gen)
    anchor = torch.tensor([9])
    ours = draft_rows(drafter, [drafter.fuse_context(features[0])], anchor, torch.tensor([11]))
    block = torch.full((1, config.block_size), config.mask_token_id)
    block[0, 0] = anchor
    with torch.no_grad():
        theirs = ref(
            position_ids=torch.arange(11 + config.block_size)[None],
            target_hidden=features,
            noise_embedding=head.embed(block),
        )[:, 1:]
    torch.testing.assert_close(ours[:, 1:], theirs, rtol=1e-4, atol=1e-4)
    output_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    output_head.weight.data = head.lm_head_weight.clone()
    with torch.no_grad():
        ref_tokens, _, _ = ref.propose(theirs, anchor, output_head, 0.0)
    assert torch.equal(drafter.propose(ours, anchor).tokens, ref_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compiled_dflash2_step_equals_the_dense_eager_step(exact_fp32_matmul):
    """The trainer's CUDA path for DFlash 2 (compiled layers, compiled flex attention, block masks) and the eager
    CUDA layers with the dense masks (the convolution compiled alone) against the CPU's eager step: the same loss,
    selector metrics and gradients."""
    from common.batch import PackedBatch

    config = dflash2_config(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, block_size=8, head_dim=16
    )
    torch.manual_seed(0)
    reference = trained_like(build_drafter(config, random_head(config)))
    drafters = []
    for compile_layers in (False, True):
        drafter = build_drafter(config, random_head(config)).cuda()
        drafter.load_state_dict(reference.state_dict())
        if compile_layers:
            for layer in drafter.layers:
                layer.compile(dynamic=False)
        drafters.append(drafter)
    host_batch = random_batch([300, 90, 500], config, seed=2, supervised_fraction=0.9)
    results = []
    for drafter, dense in ((reference, True), (drafters[0], True), (drafters[1], False)):
        device = next(drafter.parameters()).device
        batch = PackedBatch(
            **{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(host_batch).items()}
        )
        blocks = build_blocks(batch, 64, 8, config.mask_token_id, torch.Generator().manual_seed(0))
        hidden = drafter(batch.aux_hidden, blocks, build_masks(blocks, config, dense=dense))
        loss, metrics = drafter.objective(hidden, blocks)
        loss.backward()
        results.append((loss.cpu(), metrics, {n: p.grad.cpu() for n, p in drafter.named_parameters()}))
    loss_a, metrics_a, grads_a = results[0]
    for loss_b, metrics_b, grads_b in results[1:]:
        torch.testing.assert_close(loss_b, loss_a, rtol=2e-3, atol=2e-3)
        for key in ("tau", "unary_tau", "selector/recall"):
            torch.testing.assert_close(metrics_b[key].cpu(), metrics_a[key], rtol=0.02, atol=0.02)
        for name, grad in grads_a.items():
            torch.testing.assert_close(grads_b[name], grad, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("width", [64, 151936, 49152, 5000])
def test_the_two_pass_top_k_equals_topk(width):
    from common.drafter.loss import top_k_indices

    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(37, width, generator=gen)
    logits[0, -3:] = 50.0  # the largest in the short last group
    logits[1, :20] = 40.0 + torch.arange(20.0)  # many of the largest in one group
    ours = top_k_indices(logits, 16)
    torch.testing.assert_close(logits.gather(1, ours), logits.topk(16, dim=-1).values)
    assert all(len(set(row)) == 16 for row in ours.tolist())

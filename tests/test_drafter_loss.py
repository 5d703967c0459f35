"""Chunked head + loss equals the plain computation (values and gradients); weights and metrics."""

import math

import pytest
import torch
import torch.nn.functional as F

from common.drafter.blocks import build_blocks
from common.drafter.loss import LossConfig, chunked_head_rows, draft_loss, draft_metrics, slot_weights
from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import host_reads, random_batch, random_head, tiny_config


def inputs(rows=37, width=16, vocab=50, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    target = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    row_weights = torch.rand(rows, generator=gen, dtype=torch.float64)
    return hidden, weight, labels, target, row_weights


@pytest.mark.parametrize("chunk_rows", [1, 5, 37, 100])
def test_chunked_ce_equals_unchunked(chunk_rows):
    hidden, weight, labels, _, row_weights = inputs()
    h1 = hidden.clone().requires_grad_()
    rows = chunked_head_rows(h1, weight, labels=labels, chunk_rows=chunk_rows)
    row_loss, argmax, used = rows.loss, rows.draft_argmax, rows.label_used
    (row_loss.double() * row_weights).sum().backward()
    h2 = hidden.clone().requires_grad_()
    logits = h2 @ weight.T
    ref = F.cross_entropy(logits, labels, reduction="none")
    (ref * row_weights).sum().backward()
    torch.testing.assert_close(row_loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)  # fp32 softmax inside
    assert torch.equal(argmax, logits.argmax(-1)) and torch.equal(used, labels)


@pytest.mark.parametrize("soft", [False, True])
def test_chunked_target_labels_equal_unchunked(soft):
    hidden, weight, _, target, row_weights = inputs(seed=1)
    h1 = hidden.clone().requires_grad_()
    rows = chunked_head_rows(h1, weight, target_hidden=target, soft=soft, chunk_rows=6)
    row_loss, used = rows.loss, rows.label_used
    (row_loss.double() * row_weights).sum().backward()
    h2 = hidden.clone().requires_grad_()
    log_q = torch.log_softmax(h2 @ weight.T, -1)
    target_logits = target @ weight.T
    if soft:
        ref = F.kl_div(log_q, torch.log_softmax(target_logits, -1), log_target=True, reduction="none").sum(-1)
    else:
        ref = F.nll_loss(log_q, target_logits.argmax(-1), reduction="none")
    (ref * row_weights).sum().backward()
    torch.testing.assert_close(row_loss.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)  # fp32 softmax inside
    assert torch.equal(used, target_logits.argmax(-1))


def test_draft_loss_equals_reference_through_the_model():
    """End to end on a small vocabulary: the drafter's loss == plain full-logit decay-weighted CE."""
    config = tiny_config()
    drafter = DFlashDrafter(config, random_head(config), LossConfig(chunk_rows=7)).double()
    batch = random_batch([30, 20, 9], config, seed=2)
    gen = torch.Generator().manual_seed(0)
    blocks, masks = drafter.prepare(batch, 16, gen)
    hidden = drafter(batch.aux_hidden, blocks, masks)
    loss, metrics = draft_loss(hidden, blocks, drafter.target_head.lm_head_weight.double(), drafter.loss_config)
    grads = torch.autograd.grad(loss, list(drafter.parameters()), retain_graph=True)

    logits = hidden[:, 1:] @ drafter.target_head.lm_head_weight.double().T
    ce = F.cross_entropy(logits.reshape(-1, config.vocab_size), blocks.label_ids.reshape(-1), reduction="none")
    gamma = 2.0  # the default for B = 4: on the line through the published (8, 4) and (10, 5)
    decay = torch.exp(-torch.arange(config.block_size - 1, dtype=torch.float64) / gamma)
    weights = (decay[None] * blocks.label_mask).reshape(-1)
    ref = (weights * ce).sum() / weights.sum()
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))
    # The loss is accumulated in fp32 by design (bf16 training); compare it at fp32 tolerance.
    torch.testing.assert_close(loss, ref.float())
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)
    assert metrics["acc"].shape == (config.block_size - 1,)


def test_decay_and_streak_weights():
    config = tiny_config(block_size=16)
    batch = random_batch([64], config, supervised_fraction=1.0)
    blocks = build_blocks(batch, 4, 16, config.mask_token_id, torch.Generator().manual_seed(0))
    row_loss = torch.zeros(4 * 15)
    decay = slot_weights(blocks, LossConfig(), row_loss)
    k = torch.arange(1, 16, dtype=torch.float32)
    expected = torch.exp(-(k - 1) / 7.0)[None] * blocks.label_mask
    torch.testing.assert_close(decay, expected)
    # Streak weights: q = exp(-CE), q~ = (1 - a) q + a, w_k = sum_{m >= k} prod_{i <= m} q~_i.
    ce = torch.full((4, 15), math.log(2.0))
    blocks.label_mask[:] = True
    streak = slot_weights(blocks, LossConfig(weighting="streak", streak_alpha=0.5), ce.reshape(-1))
    q = 0.5 * 0.5 + 0.5
    expected_row = [sum(q ** (m + 1) for m in range(k, 15)) for k in range(15)]
    torch.testing.assert_close(streak[0], torch.tensor(expected_row))


def test_metrics_acceptance_length_and_accuracy():
    config = tiny_config(block_size=4)
    batch = random_batch([40], config, supervised_fraction=1.0)
    blocks = build_blocks(batch, 3, 4, config.mask_token_id, torch.Generator().manual_seed(0))
    blocks.valid = torch.tensor([True, True, False])
    blocks.label_mask = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    correct = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    metrics = draft_metrics(blocks, torch.zeros(3, 3), correct)
    # block 0: 2 leading correct; block 1: 2 (slot 3 unsupervised); block 2 is padding.
    assert float(metrics["tau"]) == pytest.approx(3.0)
    torch.testing.assert_close(metrics["acc"], torch.tensor([1.0, 1.0, 0.0]))
    assert all(isinstance(v, torch.Tensor) for v in metrics.values())


def test_feature_noise_schedule():
    config = LossConfig(feature_noise=0.2)
    assert config.noise_scale(0.0) == pytest.approx(0.2)
    assert config.noise_scale(0.5) == pytest.approx(0.1)
    assert config.noise_scale(1.0) == pytest.approx(0.0)
    model_config = tiny_config()
    drafter = DFlashDrafter(model_config, random_head(model_config), config)
    aux = torch.randn(10, model_config.fused_feature_size)
    noisy = drafter.noisy_features(aux, torch.Generator().manual_seed(0), 0.0)
    assert not torch.equal(noisy, aux)
    assert torch.equal(drafter.noisy_features(aux, torch.Generator().manual_seed(0), 1.0), aux)
    assert torch.equal(drafter.eval().noisy_features(aux, torch.Generator().manual_seed(0), 0.0), aux)


@pytest.mark.parametrize("label_mode", ["target_hard", "target_soft"])
def test_target_label_modes_train(label_mode):
    config = tiny_config()
    drafter = DFlashDrafter(config, random_head(config), LossConfig(label_mode=label_mode, chunk_rows=8))
    batch = random_batch([30, 20], config, with_last_hidden=True)
    loss, metrics = drafter.forward_train(batch, 12, torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and drafter.fc.weight.grad.abs().sum() > 0
    batch.last_hidden = None
    with pytest.raises(ValueError, match="last_hidden"):
        drafter.forward_train(batch, 12, torch.Generator().manual_seed(0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_chunk_rows_read_nothing_on_the_host():
    """The LK objective's weight (a float) is a constant of the compiled chunk function, not a host scalar that each
    chunk reads with item(): the rows and their gradient read nothing on the host."""
    hidden, weight, target, row_weights = (t.float().cuda() for t in inputs(vocab=1000) if t.is_floating_point())
    h = hidden.requires_grad_()

    def step():
        rows = chunked_head_rows(h, weight, target_hidden=target, soft=True, objective="lk", chunk_rows=8)
        torch.autograd.grad((rows.loss * row_weights).sum(), h)

    assert host_reads(step) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "labels_from, objective",
    [("data", "ce"), ("target_hard", "lk_hybrid"), ("target_soft", "ce"), ("target_soft", "lk"), ("data", "lk")],
)
def test_gpu_compiled_chunk_rows_equal_the_eager_ones(labels_from, objective, exact_fp32_matmul):
    """On CUDA each chunk's rows run compiled: in fp32 the same losses, CE, acceptance, picks, top tokens and gradient
    as the CPU's eager code, over chunks of unequal sizes (the last chunk's rows are a new shape)."""
    hidden, weight, labels, target, row_weights = (
        t.float() if t.is_floating_point() else t for t in inputs(vocab=1000)
    )
    options = {"labels": labels} if labels_from == "data" else {"target_hidden": target}
    options.update(soft=labels_from == "target_soft", objective=objective, with_acceptance=True, top_k=4)
    results = []
    for device in ("cpu", "cuda"):
        h = hidden.to(device).requires_grad_()
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
        rows = chunked_head_rows(h, weight.to(device), chunk_rows=8, **moved)
        (grad,) = torch.autograd.grad((rows.loss * row_weights.to(device)).sum(), h)
        results.append([t.cpu() for t in (*rows, grad)])
    for name, cpu, cuda in zip((*rows._fields, "grad"), *results):
        torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")

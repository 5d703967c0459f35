"""Recipe options of the DFlash objective: D-PACE position weights (arXiv 2605.18810) and the LK losses
(arXiv 2602.23881), checked against plain full-logit references."""

import math

import pytest
import torch
import torch.nn.functional as F

from common.drafter.blocks import build_blocks
from common.drafter.loss import LossConfig, chunked_head_rows, draft_loss, slot_weights
from tests.drafter_fixtures import random_batch, tiny_config

LABEL_MODES = ("data", "target_hard", "target_soft")


def head_inputs(label_mode: str, rows: int = 37, width: int = 16, vocab: int = 50, seed: int = 0):
    """Hidden rows, a head, the kwargs that pick the label mode, and the dense target distribution."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64) * 0.5
    if label_mode == "data":
        labels = torch.randint(0, vocab, (rows,), generator=gen)
        return hidden, weight, dict(labels=labels), F.one_hot(labels, vocab).double()
    target_hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    target_logits = target_hidden @ weight.T
    if label_mode == "target_hard":
        target_probs = F.one_hot(target_logits.argmax(-1), vocab).double()
    else:
        target_probs = torch.softmax(target_logits, -1)
    return hidden, weight, dict(target_hidden=target_hidden, soft=label_mode == "target_soft"), target_probs


def dense_rows(
    logits: torch.Tensor, target_probs: torch.Tensor, objective: str, lk_eta: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row loss, CE, acceptance) from full logits: the textbook formulas, autograd for the gradient."""
    draft_p = torch.softmax(logits, -1)
    ce = (torch.special.xlogy(target_probs, target_probs) - target_probs * torch.log_softmax(logits, -1)).sum(-1)
    acceptance = torch.minimum(draft_p, target_probs).sum(-1)
    if objective == "ce":
        loss = ce
    elif objective == "lk":
        loss = -torch.log(acceptance)
    else:
        ce_share = torch.exp(-lk_eta * acceptance).detach()
        loss = ce_share * ce + (1.0 - ce_share) * (1.0 - acceptance)
    return loss, ce, acceptance


def small_blocks(label_mask: torch.Tensor):
    """Blocks of B = label_mask.shape[1] + 1 slots with the given supervision pattern."""
    num_blocks, num_slots = label_mask.shape
    config = tiny_config(block_size=num_slots + 1)
    batch = random_batch([40], config, supervised_fraction=1.0)
    blocks = build_blocks(batch, num_blocks, num_slots + 1, config.mask_token_id, torch.Generator().manual_seed(0))
    blocks.label_mask = label_mask
    return blocks


def test_dpace_weights_match_hand_computation():
    blocks = small_blocks(torch.tensor([[True, True, True], [True, False, True]]))
    acceptance = torch.tensor([0.8, 0.5, 0.2, 0.9, 0.3, 0.4], requires_grad=True)
    weights = slot_weights(blocks, LossConfig(weighting="dpace", dpace_alpha=0.5), torch.zeros(6), acceptance)
    # q~ = 0.5 a + 0.5. Block 0: q~ = .9, .75, .6; C = .9, .675, .405; w_k = sum_{m >= k} C_m.
    # Block 1: slot 2 is unsupervised: q~ = .95, (1), .7; C = .95, -, .665.
    expected = torch.tensor([[0.9 + 0.675 + 0.405, 0.675 + 0.405, 0.405], [0.95 + 0.665, 0.0, 0.665]])
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad
    assert weights[1, 1] == 0.0

    # dpace_alpha = 1 ignores the confidences: w_k counts the supervised slots from k on.
    flat = slot_weights(blocks, LossConfig(weighting="dpace", dpace_alpha=1.0), torch.zeros(6), acceptance)
    torch.testing.assert_close(flat, torch.tensor([[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]]))

    decay = slot_weights(blocks, LossConfig(), torch.zeros(6))
    assert not torch.allclose(weights, decay)
    # Unlike "streak", the skipped slot adds nothing to the weights of the slots before it.
    streak = slot_weights(blocks, LossConfig(weighting="streak"), -torch.log(acceptance.detach()))
    assert streak[1, 0] > weights[1, 0] + 0.9


def test_dpace_needs_acceptance():
    blocks = small_blocks(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="acceptance"):
        slot_weights(blocks, LossConfig(weighting="dpace"), torch.zeros(6))


@pytest.mark.parametrize("chunk_rows", [5, 64])
@pytest.mark.parametrize("objective", ["lk", "lk_hybrid"])
@pytest.mark.parametrize("label_mode", LABEL_MODES)
def test_lk_rows_and_gradient_equal_dense_reference(label_mode, objective, chunk_rows):
    hidden, weight, label_kwargs, target_probs = head_inputs(label_mode)
    row_weights = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    h1 = hidden.clone().requires_grad_()
    rows = chunked_head_rows(h1, weight, objective=objective, lk_eta=2.5, chunk_rows=chunk_rows, **label_kwargs)
    (rows.loss.double() * row_weights).sum().backward()

    h2 = hidden.clone().requires_grad_()
    ref_loss, ref_ce, ref_acceptance = dense_rows(h2 @ weight.T, target_probs, objective, lk_eta=2.5)
    (ref_loss * row_weights).sum().backward()
    torch.testing.assert_close(rows.loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)  # fp32 softmax inside
    torch.testing.assert_close(rows.ce.double(), ref_ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rows.acceptance.double(), ref_acceptance, rtol=1e-5, atol=1e-6)
    assert torch.equal(rows.label_used, target_probs.argmax(-1))
    # The LK objective is not the CE in disguise (except "lk" on a one-hot target, where -log q(label) is it).
    assert torch.allclose(rows.loss, rows.ce) == (objective == "lk" and label_mode != "target_soft")


def test_lk_soft_stays_exact_when_the_overlap_is_tiny():
    """Sharp, disagreeing distributions (acceptance down to ~1e-9): -log a and its gradient, no floor."""
    hidden, weight, label_kwargs, _ = head_inputs("target_soft", seed=7)
    hidden, target_hidden = 5 * hidden, 5 * label_kwargs["target_hidden"]
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    rows = chunked_head_rows(h1, weight, target_hidden=target_hidden, soft=True, objective="lk", chunk_rows=8)
    rows.loss.sum().backward()
    ref_loss, _, ref_acceptance = dense_rows(h2 @ weight.T, torch.softmax(target_hidden @ weight.T, -1), "lk")
    ref_loss.sum().backward()
    assert ref_acceptance.min() < 1e-6
    torch.testing.assert_close(rows.loss.double(), ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("label_mode", LABEL_MODES)
def test_lk_hybrid_is_its_stated_mix(label_mode):
    hidden, weight, label_kwargs, _ = head_inputs(label_mode, seed=4)
    ce_rows = chunked_head_rows(hidden, weight, with_acceptance=True, chunk_rows=8, **label_kwargs)
    hybrid = chunked_head_rows(hidden, weight, objective="lk_hybrid", lk_eta=3.0, chunk_rows=8, **label_kwargs)
    ce_share = torch.exp(-3.0 * ce_rows.acceptance)
    torch.testing.assert_close(hybrid.loss, ce_share * ce_rows.loss + (1 - ce_share) * (1 - ce_rows.acceptance))
    torch.testing.assert_close(hybrid.ce, ce_rows.loss)
    torch.testing.assert_close(hybrid.acceptance, ce_rows.acceptance)

    # eta = 0 leaves all of every row to the CE: the same values and the same gradient.
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    pure_ce = chunked_head_rows(h1, weight, objective="lk_hybrid", lk_eta=0.0, chunk_rows=8, **label_kwargs)
    pure_ce.loss.sum().backward()
    chunked_head_rows(h2, weight, chunk_rows=8, **label_kwargs).loss.sum().backward()
    torch.testing.assert_close(pure_ce.loss, ce_rows.loss)
    torch.testing.assert_close(h1.grad, h2.grad)


@pytest.mark.parametrize("label_mode", LABEL_MODES)
def test_ce_objective_is_unchanged(label_mode):
    hidden, weight, label_kwargs, target_probs = head_inputs(label_mode, seed=5)
    h1, h2, h3 = (hidden.clone().requires_grad_() for _ in range(3))
    rows = chunked_head_rows(h1, weight, chunk_rows=6, **label_kwargs)
    rows.loss.sum().backward()
    assert LossConfig().objective == "ce" and rows.acceptance is None
    # Asking for the acceptance (as D-PACE does) leaves the CE rows and their gradient bit for bit alone.
    with_acceptance = chunked_head_rows(h2, weight, with_acceptance=True, chunk_rows=6, **label_kwargs)
    with_acceptance.loss.sum().backward()
    assert torch.equal(rows.loss, with_acceptance.loss) and torch.equal(h1.grad, h2.grad)

    ref_loss, _, _ = dense_rows(h3 @ weight.T, target_probs, "ce")
    ref_loss.sum().backward()
    torch.testing.assert_close(rows.loss.double(), ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1.grad, h3.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(rows.ce, rows.loss.detach())


def draft_setup(seed: int = 0):
    """Blocks over a packed batch, a head and final-normed target states: inputs of draft_loss."""
    config = tiny_config(block_size=5)
    batch = random_batch([30, 22, 12], config, seed=seed, supervised_fraction=0.85)
    blocks = build_blocks(batch, 12, 5, config.mask_token_id, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    weight = torch.randn(config.vocab_size, config.hidden_size, generator=gen, dtype=torch.float64) * 0.3
    target_hidden = torch.randn(batch.input_ids.shape[0], config.hidden_size, generator=gen, dtype=torch.float64)
    return blocks, weight, target_hidden


def dense_target_probs(blocks, weight, target_hidden, label_mode: str) -> torch.Tensor:
    """[M, V] target distribution of every draft row (one-hot for the hard label modes)."""
    if label_mode == "data":
        return F.one_hot(blocks.label_ids.reshape(-1), weight.shape[0]).double()
    target_logits = target_hidden[(blocks.label_index - 1).reshape(-1)] @ weight.T
    if label_mode == "target_hard":
        return F.one_hot(target_logits.argmax(-1), weight.shape[0]).double()
    return torch.softmax(target_logits, -1)


@pytest.mark.parametrize("label_mode", LABEL_MODES)
def test_draft_loss_with_lk_hybrid_and_dpace_equals_dense_reference(label_mode):
    blocks, weight, target_hidden = draft_setup(seed=1)
    config = LossConfig(label_mode=label_mode, objective="lk_hybrid", weighting="dpace", dpace_alpha=0.4, chunk_rows=7)
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(blocks.num_blocks, 5, weight.shape[1], generator=gen, dtype=torch.float64)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    loss, metrics = draft_loss(h1, blocks, weight, config, target_hidden)
    loss.backward()

    target_probs = dense_target_probs(blocks, weight, target_hidden, label_mode)
    row_loss, row_ce, acceptance = dense_rows(
        h2[:, 1:].reshape(-1, weight.shape[1]) @ weight.T, target_probs, "lk_hybrid"
    )
    mask = blocks.label_mask.double()
    confidence = torch.where(blocks.label_mask, 0.6 * acceptance.detach().view_as(mask) + 0.4, 1.0)
    reach = torch.cumprod(confidence, 1) * mask
    weights = (reach.flip(1).cumsum(1).flip(1) * mask).reshape(-1)
    ref = (weights * row_loss).sum() / weights.sum()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    # The "ce" metric stays the unweighted CE of the supervised slots, whatever the objective.
    expected_ce = (row_ce.view_as(mask) * mask).sum() / mask.sum()
    torch.testing.assert_close(metrics["ce"].double(), expected_ce, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "label_mode,objective", [("target_soft", "lk"), ("target_soft", "lk_hybrid"), ("target_hard", "lk_hybrid")]
)
def test_lk_objective_trains_the_acceptance_rate(label_mode, objective):
    """A linear drafter h = x A, where the target's states are x A_true, learns to be accepted."""
    blocks, weight, _ = draft_setup(seed=3)
    gen = torch.Generator().manual_seed(4)
    num_positions, feature_width, width = blocks.num_context, 8, weight.shape[1]
    features = torch.randn(num_positions, feature_width, generator=gen, dtype=torch.float64)
    true_map = torch.randn(feature_width, width, generator=gen, dtype=torch.float64)
    target_hidden = features @ true_map
    slot_features = torch.cat(
        [torch.zeros(blocks.num_blocks, 1, feature_width, dtype=torch.float64), features[blocks.label_index - 1]], dim=1
    )  # slot 0 is the given token
    draft_map = (0.1 * torch.randn(feature_width, width, generator=gen, dtype=torch.float64)).requires_grad_()
    config = LossConfig(label_mode=label_mode, objective=objective, chunk_rows=16)
    target_probs = dense_target_probs(blocks, weight, target_hidden, label_mode)
    mask = blocks.label_mask.reshape(-1)

    def mean_acceptance() -> float:
        with torch.no_grad():
            draft_p = torch.softmax(slot_features[:, 1:].reshape(-1, feature_width) @ draft_map @ weight.T, -1)
            return float(torch.minimum(draft_p, target_probs).sum(-1)[mask].mean())

    before = mean_acceptance()
    optimizer = torch.optim.Adam([draft_map], lr=0.05)
    for _ in range(40):
        loss, _ = draft_loss(slot_features @ draft_map, blocks, weight, config, target_hidden)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = mean_acceptance()
    assert before < 0.1 and after > 0.6, f"acceptance {before:.3f} -> {after:.3f}"


@pytest.mark.parametrize(
    "field,value",
    [
        ("weighting", "pace"),
        ("objective", "tv"),
        ("dpace_alpha", 0.0),
        ("dpace_alpha", 1.5),
        ("lk_eta", -1.0),
        ("lk_eta", math.nan),
        ("lk_eta", math.inf),
    ],
)
def test_invalid_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})

"""LiLiCorr: the reranker's scores equal the reference's on its own fixed inputs, a fresh or warm-started drafter
proposes what its DFlash backbone does, the objective is the DFlash loss plus the reference's three terms and trains
every weight, the teacher-forced streak is the free walk's, sampled decoding stays lossless, the exports round-trip
and bad options name their key (common/drafter/lilicorr/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.batch import PackedBatch
from common.config import ConfigError, load_config
from common.drafter.blocks import build_blocks
from common.drafter.export import config_from_export, export_speculators, export_zlab, load_drafter, zlab_config
from common.drafter.lilicorr.model import LiLiCorrHead, LiLiCorrKindHead, LogSumExpRows, chain_rows
from common.drafter.loss import LossConfig, chunked_head_rows, draft_loss
from common.drafter.masks import build_masks
from common.drafter.model import build_drafter
from common.drafter.sampling import Sampling
from producer.acceptance.decoder import DraftContext
from tests.drafter_fixtures import random_batch, random_head, tiny_config

HEAD_NAMES = {
    "slot_embedding",
    "rank_embedding",
    "relative_slot_bias",
    "same_slot_bias",
    "token_proj.weight",
    "token_proj.bias",
    "pass_hidden_proj.weight",
    "pass_hidden_proj.bias",
    "feature_mlp.0.weight",
    "feature_mlp.0.bias",
    "feature_mlp.1.weight",
    "feature_mlp.1.bias",
    "feature_mlp.3.weight",
    "feature_mlp.3.bias",
    "context_proj.weight",
    "context_proj.bias",
    "output_norm.weight",
    "anchor_norm.weight",
    "factor_input_proj.weight",
    "factor_input_proj.bias",
    *(f"{name}.{part}" for name in ("out_head", "in_head", "anchor_out_head") for part in ("weight", "bias")),
    *(
        f"layers.{i}.{name}"
        for i in range(2)
        for name in (
            "attn_norm.weight",
            "attn.in_proj_weight",
            "attn.in_proj_bias",
            "attn.out_proj.weight",
            "attn.out_proj.bias",
            "mlp_norm.weight",
            "mlp.0.weight",
            "mlp.0.bias",
            "mlp.2.weight",
            "mlp.2.bias",
        )
    ),
}
"""The reranker's tensors as Model-Optimizer's exporter writes them (under ``lilicorr.``) and SGLang's loader requires
them, for a head narrower than the draft (``token_proj`` a Linear) with two layers."""


def lilicorr_config(**overrides):
    values = dict(
        kind="lilicorr",
        lilicorr_hidden_size=16,
        lilicorr_factor_dim=8,
        lilicorr_num_heads=2,
        lilicorr_candidate_topk=32,  # half the vocabulary: labels are often candidates, even for a random drafter
    )
    values.update(overrides)
    return tiny_config(**values)


def trained_like(drafter, seed: int = 1, scale: float = 0.3):
    """Every reranker weight away from its start (in_head no longer zero), as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith("lilicorr."):
                param.add_(scale * torch.randn(param.shape, generator=gen))
    return drafter


def blocks_and_hidden(drafter, seed: int = 0, anchors: int = 16):
    config = drafter.config
    batch = random_batch([40, 31], config, seed=seed, supervised_fraction=1.0, with_last_hidden=True)
    blocks = build_blocks(batch, anchors, config.block_size, config.mask_token_id, torch.Generator().manual_seed(seed))
    hidden = drafter(batch.aux_hidden, blocks, build_masks(blocks, config, dense=True))
    context = drafter.block_context(batch.aux_hidden, blocks)  # each block's context row, the reranker's anchor
    return batch, blocks, hidden, drafter.target_head.final_norm(batch.last_hidden), context


# -- the reranker -------------------------------------------------------------------------------


def test_the_head_scores_what_the_reference_scores_on_its_fixed_inputs():
    """TensorRT-LLM's test of its LiLiCorr head (tests/unittest/_torch/speculative/test_lilicorr.py) against "a frozen
    Model Optimizer reference": the same geometry, every parameter sin(arange(numel) 0.17 + sum(bytes of its name)
    0.013) 0.2 under TensorRT-LLM's names (its feature_norm / up_proj / down_proj for the reference's Sequential
    indices; the flat order of each tensor is the same), the same inputs; the expected factors are its own."""
    config = lilicorr_config(
        hidden_size=32,
        rms_norm_eps=1e-5,
        block_size=4,
        lilicorr_hidden_size=8,
        lilicorr_num_layers=2,
        lilicorr_num_heads=2,
        lilicorr_mlp_ratio=2.0,
        lilicorr_candidate_topk=3,
        lilicorr_factor_dim=8,
        lilicorr_vector_eps=1e-4,
        lilicorr_logit_scale=8.0,
    )
    head = LiLiCorrHead(config).eval()
    renames = (
        ("feature_mlp.0.", "feature_norm."),
        ("feature_mlp.1.", "feature_mlp.up_proj."),
        ("feature_mlp.3.", "feature_mlp.down_proj."),
        (".mlp.0.", ".mlp.up_proj."),
        (".mlp.2.", ".mlp.down_proj."),
    )
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            theirs = name
            for ours, trt in renames:
                theirs = theirs.replace(ours, trt)
            values = torch.arange(parameter.numel(), dtype=torch.float32).reshape(parameter.shape)
            parameter.copy_(torch.sin(values * 0.17 + sum(theirs.encode()) * 0.013) * 0.2)
    embeddings = torch.linspace(-1.2, 1.3, 512).reshape(16, 32)
    ids = torch.tensor([[[2, 5, 9], [6, 3, 1], [4, 7, 8]]])
    logs = torch.tensor([[[-0.4, -1.5, -3.0], [-0.6, -1.7, -2.7], [-0.2, -2.1, -3.4]]])
    hidden = torch.linspace(-0.7, 0.9, 96).reshape(1, 3, 32)
    anchor = torch.linspace(-0.5, 0.4, 32).reshape(1, 32)
    with torch.no_grad():
        start, pairs = head(embeddings[ids], logs, hidden, anchor)
    expected_start = torch.tensor([[-2.00565147, -2.00631571, -2.01010752]])
    expected_pairs = torch.tensor(
        [
            [
                [[1.16437435, 1.16812551, 1.15701485], [1.16656375, 1.17030466, 1.15921211]]
                + [[1.17068172, 1.17445230, 1.16334319]],
                [[1.14806044, 1.14459574, 1.12698877], [1.14481199, 1.14134955, 1.12373281]]
                + [[1.14475155, 1.14125943, 1.12357390]],
            ]
        ]
    )
    torch.testing.assert_close(start, expected_start, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pairs, expected_pairs, atol=2e-5, rtol=2e-5)
    # An invalid anchor is zeroed after its projection (context_proj's bias does not leak), as the reference does.
    with torch.no_grad():
        invalid = head(embeddings[ids], logs, hidden, anchor, torch.tensor([False]))
        zero_anchor = head.context_proj.bias.clone()
        head.context_proj.bias.zero_()
        zeroed = head(embeddings[ids], logs, hidden, torch.zeros_like(anchor))
        head.context_proj.bias.copy_(zero_anchor)
    torch.testing.assert_close(invalid, zeroed)


def test_the_state_dict_carries_the_reference_names_and_shapes():
    config = lilicorr_config(block_size=5)
    drafter = build_drafter(config, random_head(config))
    state = drafter.state_dict()
    head = {name.removeprefix("lilicorr."): t.shape for name, t in state.items() if name.startswith("lilicorr.")}
    assert set(head) == HEAD_NAMES
    slots, k, h, f = 4, 32, 16, 8
    assert head["slot_embedding"] == (1, 1, slots, 1, h) and head["rank_embedding"] == (1, 1, 1, k, h)
    assert head["relative_slot_bias"] == (2, 2 * 5 - 1) and head["same_slot_bias"] == (2,)
    assert head["factor_input_proj.weight"] == (h, 3 * h) and head["in_head.weight"] == (f, h)
    assert head["layers.0.attn.in_proj_weight"] == (3 * h, h) and head["layers.0.mlp.0.weight"] == (2 * h, h)
    assert head["token_proj.weight"] == (h, 32) and head["feature_mlp.1.weight"] == (h, 5)
    assert set(state) - {f"lilicorr.{n}" for n in HEAD_NAMES} == set(
        build_drafter(tiny_config(), random_head(config)).state_dict()
    )
    # As wide as the draft (lilicorr_hidden_size 0): token_proj is the identity, with no tensors (the reference's).
    same = build_drafter(lilicorr_config(lilicorr_hidden_size=0), random_head(config)).state_dict()
    assert not any(name.startswith("lilicorr.token_proj.") for name in same)
    assert same["lilicorr.pass_hidden_proj.weight"].shape == (32, 32)


# -- the start: what DFlash proposes --------------------------------------------------------------


def test_a_fresh_or_warm_started_drafter_proposes_what_its_dflash_backbone_does():
    """in_head starts at zero: every factor is exactly 0, so the greedy walk takes each slot's most likely token (the
    DFlash argmax, token for token) and a sampled walk draws uniformly from the DFlash top-K."""
    config = lilicorr_config(lilicorr_candidate_topk=8)
    head = random_head(config)
    torch.manual_seed(0)
    dflash = build_drafter(tiny_config(), head)
    with torch.no_grad():
        for param in dflash.parameters():
            param.normal_(std=0.3)
    drafter = build_drafter(config, head)
    drafter.warm_start(dflash.state_dict())
    _, blocks, hidden, _, context = blocks_and_hidden(dflash)
    anchors = blocks.block_ids[:, 0]
    assert torch.equal(
        drafter.propose(hidden, anchors, context=context).tokens,
        dflash.propose(hidden, anchors, context=context).tokens,
    )
    sampled = drafter.propose(
        hidden, anchors, Sampling(temperature=0.8), torch.Generator().manual_seed(3), context=context
    )
    torch.testing.assert_close(sampled.probs, torch.full_like(sampled.probs, 1 / 8))
    top = dflash.logits(hidden[:, 1:]).topk(8, dim=-1).indices
    assert torch.equal(sampled.candidates, top)
    assert (sampled.tokens[..., None] == top).any(-1).all()
    dense = sampled.dense(config.vocab_size).probs
    torch.testing.assert_close(dense.sum(-1), torch.ones(dense.shape[:-1]))

    # A fresh drafter is its own backbone's DFlash drafter too, and a reset keeps it so.
    fresh = build_drafter(config, head)
    fresh.reset_parameters(0.3)
    _, blocks, hidden, _, context = blocks_and_hidden(fresh, seed=1)
    anchors = blocks.block_ids[:, 0]
    assert torch.equal(fresh.propose(hidden, anchors, context=context).tokens, fresh.logits(hidden[:, 1:]).argmax(-1))

    # Its own weights load whole; anything else but a DFlash drafter's is refused.
    trained = trained_like(build_drafter(config, head))
    drafter.warm_start(trained.state_dict())
    for name, tensor in trained.state_dict().items():
        assert torch.equal(drafter.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="not a DFlash or LiLiCorr drafter"):
        drafter.warm_start({"unknown.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="not a DFlash or LiLiCorr drafter"):
        drafter.warm_start({k: v for k, v in dflash.state_dict().items() if k != "fc.weight"})


def test_a_fresh_reranker_is_no_saddle():
    """At the start only in_head has a gradient (every other weight feeds the zero in vectors' partners); one step
    later every weight of the reranker has one."""
    config = lilicorr_config(lilicorr_w_margin=0.125)
    torch.manual_seed(0)
    drafter = build_drafter(config, random_head(config))
    batch = random_batch([30, 25], config, seed=0, supervised_fraction=1.0, with_last_hidden=True)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    for step in range(2):
        optimizer.zero_grad()
        loss, _ = drafter.forward_train(batch, 16, torch.Generator().manual_seed(0))
        loss.backward()
        moved = {n for n, p in drafter.named_parameters() if n.startswith("lilicorr.") and p.grad.abs().sum() > 0}
        if step == 0:
            assert moved == {"lilicorr.in_head.weight", "lilicorr.in_head.bias"}
        else:
            assert moved == {f"lilicorr.{name}" for name in HEAD_NAMES}
        optimizer.step()


# -- the objective --------------------------------------------------------------------------------


def test_the_objective_trains_every_weight_and_logs_finite_metrics():
    config = lilicorr_config(lilicorr_w_ce=0.125, lilicorr_w_margin=0.125)  # the reference's "margin" variant
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    batch = random_batch([24, 17, 31], config, seed=0, supervised_fraction=1.0, with_last_hidden=True)
    loss, metrics = drafter.forward_train(batch, 16, torch.Generator().manual_seed(0))
    loss.backward()
    for name, param in drafter.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    for key in ("loss", "tau", "acc", "ce", "block_streaks", *drafter.logged_metrics):
        assert torch.isfinite(metrics[key]).all(), key
    for key in ("lilicorr/ce", "lilicorr/margin", "lilicorr/penalty", "lilicorr/oracle_prefix"):
        assert float(metrics[key]) > 0, key
    assert float(metrics["lilicorr/selected_prefix"]) <= float(metrics["lilicorr/oracle_prefix"])
    assert 0 <= float(metrics["lilicorr/slot_gt_in_lattice"]) <= 1


def test_the_loss_is_the_dflash_loss_plus_the_three_terms_written_out():
    """loss = the DFlash loss + w_ce CE + w_margin hinge + w_pen penalty, the three written out here block by block
    from whole-vocabulary log-softmaxes: a slot counts while the label is a candidate there and at every slot before,
    in blocks supervised whole; its row is the pair row of the previous label's candidate."""
    config = lilicorr_config(block_size=5, lilicorr_w_ce=0.125, lilicorr_w_margin=0.125, lilicorr_margin=3.0)
    options = config.options
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    batch, blocks, hidden, target_hidden, context = blocks_and_hidden(drafter)
    loss, metrics = drafter.objective(hidden, blocks, target_hidden, context=context)
    dflash, _ = draft_loss(hidden, blocks, drafter.target_head.lm_head_weight, drafter.loss_config, target_hidden)

    weight = drafter.target_head.lm_head_weight
    with torch.no_grad():
        logits = hidden[:, 1:] @ weight.T
        log_probs, candidates = torch.log_softmax(logits, -1).topk(32, dim=-1)
        start, pair = drafter.head.log_factors(drafter.target_head, candidates, log_probs, hidden[:, 1:], context)
        target_logits = target_hidden[blocks.label_index - 1] @ weight.T
    terms, count = torch.zeros(3), 0
    for n in range(blocks.num_blocks):
        if not blocks.label_mask[n].all():
            continue
        previous = None
        for s in range(config.block_size - 1):
            label = int(blocks.label_ids[n, s])
            hits = (candidates[n, s] == label).nonzero()
            if not len(hits):
                break
            index = int(hits[0])
            row = start[n] if previous is None else pair[n, s - 1, previous]
            others = torch.cat([row[:index], row[index + 1 :]])
            distractor = (target_logits[n, s, label] - target_logits[n, s, candidates[n, s]]).clamp_min(0)
            terms += torch.stack(
                [
                    torch.logsumexp(row, 0) - row[index],
                    torch.relu(options.lilicorr_margin - (row[index] - others.max())),
                    (torch.softmax(row, 0) * distractor).sum(),
                ]
            )
            count += 1
            previous = index
    assert count > 5
    terms /= count
    torch.testing.assert_close(
        torch.stack([metrics["lilicorr/ce"], metrics["lilicorr/margin"], metrics["lilicorr/penalty"]]),
        terms,
        rtol=1e-4,
        atol=1e-5,
    )
    weights = torch.tensor([options.lilicorr_w_ce, options.lilicorr_w_margin, options.lilicorr_w_pen])
    torch.testing.assert_close(loss.detach(), dflash.detach() + (weights * terms).sum(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("objective, label_mode", [("ce", "data"), ("lk_hybrid", "data"), ("ce", "target_soft")])
def test_the_candidates_log_probabilities_are_the_live_log_softmax(objective, label_mode):
    """The normaliser of the candidates' log-probabilities, from the DFlash loss's rows where they hold the label's CE
    and in chunks of its own otherwise: the vocabulary's logsumexp, its gradient included."""
    config = lilicorr_config()
    drafter = build_drafter(config, random_head(config))
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(13, config.hidden_size, generator=gen, requires_grad=True)
    labels = torch.randint(0, config.vocab_size, (13,), generator=gen)
    targets = torch.randn(13, config.hidden_size, generator=gen)
    loss_config = LossConfig(objective=objective, label_mode=label_mode, chunk_rows=4)
    weight = drafter.target_head.lm_head_weight
    options = dict(objective=objective, chunk_rows=4, top_k=32)
    if label_mode == "data":
        head = chunked_head_rows(rows, weight, labels=labels, **options)
    else:
        head = chunked_head_rows(rows, weight, target_hidden=targets, soft=True, **options)
    ours = drafter.head.log_normaliser(rows, head, loss_config, 4, weight)
    expected = torch.logsumexp(rows @ weight.T, -1)
    torch.testing.assert_close(ours, expected)
    probe = torch.randn(13, generator=gen)
    (grad,) = torch.autograd.grad((ours * probe).sum(), rows)
    (expected_grad,) = torch.autograd.grad((expected * probe).sum(), rows)
    torch.testing.assert_close(grad, expected_grad)
    chunked = LogSumExpRows.apply(rows, weight, 5)
    torch.testing.assert_close(chunked, expected)


def test_the_penalty_needs_the_target():
    config = lilicorr_config()
    drafter = build_drafter(config, random_head(config))
    _, blocks, hidden, _, context = blocks_and_hidden(drafter)
    with pytest.raises(ValueError, match="needs the target's final hidden state"):
        drafter.objective(hidden, blocks, context=context)
    without = build_drafter(lilicorr_config(lilicorr_w_pen=0.0), random_head(config))
    loss, _ = without.objective(hidden, blocks, context=context)
    assert torch.isfinite(loss)


# -- decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 5])
def test_the_teacher_forced_streak_is_the_free_greedy_walk(block_size):
    """Labels made from the walk's own tokens, each block's broken at a slot of its own (by another candidate of that
    slot, by a token no candidate, or not at all): the objective's block streaks are the free walk's matches, and the
    walk leaves the DFlash argmax somewhere (the reranker decides)."""
    config = lilicorr_config(block_size=block_size, lilicorr_candidate_topk=8)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)), seed=3, scale=1.0)
    _, blocks, hidden, target_hidden, context = blocks_and_hidden(drafter, anchors=24)
    walked = drafter.propose(hidden, blocks.block_ids[:, 0], context=context).tokens
    candidates = drafter.logits(hidden[:, 1:]).topk(8, dim=-1).indices
    gen = torch.Generator().manual_seed(5)
    labels = walked.clone()
    slots = block_size - 1
    for n in range(blocks.num_blocks):
        cut = int(torch.randint(0, slots + 1, (), generator=gen))
        if cut == slots:
            continue
        others = [t for t in candidates[n, cut].tolist() if t != int(walked[n, cut])]
        outside = [t for t in range(config.vocab_size) if t not in candidates[n, cut].tolist()]
        labels[n, cut] = others[n % len(others)] if n % 2 else outside[0]
    blocks = dataclasses.replace(blocks, label_ids=labels)
    _, metrics = drafter.objective(hidden, blocks, target_hidden, context=context)
    matches = ((walked == blocks.label_ids) & blocks.label_mask).long().cumprod(1).sum(1).float() * blocks.valid
    torch.testing.assert_close(metrics["block_streaks"], matches)
    assert float(matches.max()) == slots and float(matches.min()) == 0
    if block_size > 2:
        assert not torch.equal(walked, drafter.logits(hidden[:, 1:]).argmax(-1))


def test_the_greedy_and_sampled_walks_follow_the_picked_predecessor():
    config = lilicorr_config(block_size=6, lilicorr_candidate_topk=8)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)), scale=1.0)
    _, blocks, hidden, _, context = blocks_and_hidden(drafter)
    anchors = blocks.block_ids[:, 0]
    with torch.no_grad():
        logits = drafter.logits(hidden[:, 1:])
        values, candidates = logits.topk(8, dim=-1)
        start, pair = drafter.head.log_factors(
            drafter.target_head, candidates, values - logits.logsumexp(-1, keepdim=True), hidden[:, 1:], context
        )
    greedy = drafter.propose(hidden, anchors, context=context)
    index = greedy.tokens[..., None].eq(candidates).long().argmax(-1)
    rows = chain_rows(start, pair, index[:, :-1])
    assert torch.equal(rows.argmax(-1), index)

    sampling = Sampling(temperature=0.7)
    sampled = drafter.propose(hidden, anchors, sampling, torch.Generator().manual_seed(0), context=context)
    assert torch.equal(sampled.candidates, candidates)
    index = sampled.tokens[..., None].eq(candidates).long().argmax(-1)
    rows = chain_rows(start, pair, index[:, :-1])
    torch.testing.assert_close(sampled.probs, torch.softmax(rows / 0.7, -1))
    again = drafter.propose(hidden, anchors, sampling, torch.Generator().manual_seed(0), context=context)
    assert torch.equal(again.tokens, sampled.tokens)


def test_the_sampled_walk_draws_from_the_probabilities_it_reports():
    """What lossless verification assumes of a proposal: each token is a draw from the probabilities kept for it.
    One block repeated 20 000 times: slot 1's candidates by their reported q, and slot 2's, among the rows that drew
    slot 1's most frequent candidate, by the q reported for them (the row of that predecessor), both within the
    chi-square threshold of tests/test_sampled_acceptance.py."""
    from tests.test_sampled_acceptance import chi_square

    config = lilicorr_config(block_size=3, lilicorr_candidate_topk=6, lilicorr_logit_scale=20.0)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)), scale=1.0)
    _, blocks, hidden, _, context = blocks_and_hidden(drafter)
    rows = 20_000
    proposal = drafter.propose(
        hidden[:1].expand(rows, -1, -1),
        blocks.block_ids[:1, 0].expand(rows),
        Sampling(1.0),
        torch.Generator().manual_seed(0),
        context=context[:1].expand(rows, -1),
    )
    index = proposal.tokens[..., None].eq(proposal.candidates).long().argmax(-1)
    first = proposal.probs[0, 0]
    assert float(first.max()) > 1.5 * float(first.min())  # not uniform: a wrong q would show
    statistic, threshold = chi_square(torch.bincount(index[:, 0], minlength=6), first)
    assert statistic < threshold, (statistic, threshold)
    common = int(torch.bincount(index[:, 0]).argmax())
    chosen = index[:, 0] == common
    second = proposal.probs[chosen, 1]
    torch.testing.assert_close(second, second[:1].expand_as(second))
    statistic, threshold = chi_square(torch.bincount(index[chosen, 1], minlength=6), second[0])
    assert statistic < threshold, (statistic, threshold)


# -- export and configuration -------------------------------------------------------------------


def test_both_exports_round_trip_with_the_kind_and_its_options(tmp_path):
    config = lilicorr_config(block_size=5, lilicorr_candidate_topk=4, lilicorr_logit_scale=6.0)
    head = random_head(config)
    drafter = trained_like(build_drafter(config, head))
    exported = zlab_config(config)
    assert exported["architectures"] == ["LiLiCorrDraftModel"] and exported["block_size"] == 5
    fields = exported["dflash_config"]
    assert fields["projector_type"] == "lilicorr" and fields["lilicorr_enabled"] is True
    assert {k: v for k, v in fields.items() if k.startswith("lilicorr_") and k != "lilicorr_enabled"} == {
        "lilicorr_candidate_topk": 4,
        "lilicorr_hidden_size": 16,
        "lilicorr_factor_dim": 8,
        "lilicorr_num_layers": 2,
        "lilicorr_num_heads": 2,
        "lilicorr_mlp_ratio": 2.0,
        "lilicorr_logit_scale": 6.0,
        "lilicorr_vector_eps": 1e-4,
    }
    assert not any(k in fields for k in ("lilicorr_w_ce", "lilicorr_w_margin", "lilicorr_w_pen", "lilicorr_margin"))
    assert config_from_export(exported) == config  # the loss weights are the trainer's, at their defaults here
    for fmt, write in (
        ("zlab", lambda d: export_zlab(drafter, d, dtype=None)),
        ("speculators", lambda d: export_speculators(drafter, d, "verifier", dtype=None)),
    ):
        loaded = load_drafter(write(tmp_path / fmt), head)
        assert isinstance(loaded.head, LiLiCorrKindHead) and loaded.config == config, fmt
        assert loaded.config.options.lilicorr_logit_scale == 6.0, fmt
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (fmt, name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["drafter.lilicorr.lilicorr_candidate_topk=0"],
            "drafter.lilicorr.lilicorr_candidate_topk: must be an integer",
        ),
        (["drafter.lilicorr.lilicorr_vector_eps=0.5"], "drafter.lilicorr.lilicorr_vector_eps: must lie in (0, 0.5)"),
        (["drafter.lilicorr.lilicorr_logit_scale=0"], "drafter.lilicorr.lilicorr_logit_scale: must be a number > 0"),
        (
            ["drafter.lilicorr.lilicorr_hidden_size=100"],
            "drafter.lilicorr.lilicorr_hidden_size: 100 must be a multiple",
        ),
        (["drafter.lilicorr.lilicorr_w_pen=-1"], "drafter.lilicorr.lilicorr_w_pen: must be a number >= 0"),
        (
            ["drafter.lilicorr.lilicorr_w_ce=0", "drafter.lilicorr.lilicorr_w_pen=0"],
            "drafter.lilicorr.lilicorr_w_ce: lilicorr_w_ce, lilicorr_w_margin and lilicorr_w_pen cannot all be 0",
        ),
        (
            ["drafter.lilicorr.lilicorr_w_margin=0.1", "drafter.lilicorr.lilicorr_margin=0"],
            "drafter.lilicorr.lilicorr_margin: must be > 0 where lilicorr_w_margin > 0",
        ),
        (["drafter.lilicorr.conv_kernel_size=2"], "unknown key drafter.lilicorr.conv_kernel_size"),
        (["drafter.dspark.markov_rank=8"], "drafter.dspark: options of the dspark kind given to a lilicorr"),
    ],
)
def test_bad_lilicorr_options_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        load_config(None, ['drafter.kind="lilicorr"', *overrides])


def test_the_recipe_defaults_load_and_ship_the_final_hidden_state():
    cfg = load_config(None, ['drafter.kind="lilicorr"'])
    options = cfg.drafter.options
    # the widths are derived per drafter: a quarter of its width, the reference's 1024 on 4096-wide drafters
    assert (options.lilicorr_candidate_topk, options.lilicorr_hidden_size, options.lilicorr_factor_dim) == (
        8,
        None,
        None,
    )
    assert (options.lilicorr_w_ce, options.lilicorr_w_margin, options.lilicorr_w_pen) == (0.25, 0.0, 0.25)
    assert cfg.ships_final_hidden
    assert "LiLiCorr" in options.describe(lilicorr_config())


def test_shapes_that_do_not_fit_the_drafter_name_the_key():
    with pytest.raises(ValueError, match=r"lilicorr\.lilicorr_candidate_topk 65 must be <= vocab_size 64"):
        lilicorr_config(lilicorr_candidate_topk=65)
    with pytest.raises(ValueError, match=r"lilicorr\.lilicorr_hidden_size .* width of 32, which must be a multiple"):
        lilicorr_config(lilicorr_hidden_size=0, lilicorr_num_heads=3)


# -- lossless sampled decoding ------------------------------------------------------------------


def test_sampled_speculative_decoding_with_lilicorr_samples_the_target(tmp_path):
    """tests/test_sampled_acceptance.py's test through the whole decoder, for this kind: every generated token follows the
    target's own sampling distribution (q over the reranker's candidates, scattered into the vocabulary)."""
    from transformers import Qwen3ForCausalLM

    from producer.acceptance.decoder import speculative_decode
    from producer.target_model.greedy import GreedyTarget
    from producer.target_model.load import target_head_of
    from tests import test_sampled_acceptance as sampled
    from tests.drafter_fixtures import tiny_qwen3_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny_qwen3_target(tmp_path, vocab_size=sampled.VOCAB, num_layers=4, hidden=32, seed=1)
        target_model = Qwen3ForCausalLM.from_pretrained(tmp_path).eval()
        with torch.no_grad():
            target_model.lm_head.weight.mul_(sampled.HEAD_SCALE)
        config = tiny_config(
            vocab_size=sampled.VOCAB,
            mask_token_id=sampled.VOCAB - 1,
            target_layer_ids=sampled.LAYER_IDS,
            num_target_layers=4,
            num_hidden_layers=1,
            block_size=sampled.BLOCK,
            kind="lilicorr",
            lilicorr_candidate_topk=sampled.TOP_K,
            lilicorr_hidden_size=16,
            lilicorr_factor_dim=8,
            lilicorr_num_heads=2,
            lilicorr_logit_scale=40.0,
        )
        torch.manual_seed(0)
        drafter = build_drafter(config, target_head_of(target_model)).eval()
        with torch.no_grad():  # a backbone as test_sampled_acceptance.py's, and a reranker far from uniform
            for name, param in drafter.named_parameters():
                if name.endswith("proj.weight") or name == "fc.weight":
                    param.normal_(std=0.3)
        trained_like(drafter, scale=1.0)
        target = GreedyTarget(target_model, sampled.LAYER_IDS)
        generator = torch.Generator().manual_seed(1)
        tokens, accepted = [], []
        for _ in range(sampled.SAMPLES):
            decoded = speculative_decode(
                DraftContext(drafter),
                target,
                sampled.PROMPT,
                sampled.NEW_TOKENS,
                frozenset(),
                sampled.SAMPLING,
                generator,
            )
            tokens.append(decoded.tokens)
            accepted += decoded.accepted
        tokens = torch.tensor(tokens)
        conditionals = sampled.exact_conditionals(target_model, sampled.PROMPT, sampled.SAMPLING, sampled.NEW_TOKENS)
        for k in range(sampled.NEW_TOKENS):
            statistic, threshold = sampled.conditional_chi_square(tokens, conditionals, k)
            assert statistic < threshold, f"generated token {k + 1}: chi-square {statistic:.1f} >= {threshold:.1f}"
        assert 0 < sum(accepted) < len(accepted) * (sampled.BLOCK - 1)
    finally:
        torch.set_num_threads(threads)


# -- the GPU training path ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_lilicorr_step_equals_the_dense_eager_step():
    """The trainer's CUDA path (compiled layers and flex attention, block masks; the reranker's SDPA with its bias
    broadcast over the blocks) against the eager layers with dense masks: the same loss, metrics and gradients; and
    a bf16 step stays finite."""
    config = lilicorr_config(
        layer_types=["sliding_attention", "full_attention"], sliding_window=6, block_size=8, head_dim=16
    )
    torch.manual_seed(0)
    eager = trained_like(build_drafter(config, random_head(config))).cuda()
    compiled = build_drafter(config, random_head(config)).cuda()
    compiled.load_state_dict(eager.state_dict())
    for layer in compiled.layers:
        layer.compile(dynamic=False)
    batch = random_batch([300, 90, 500], config, seed=2, supervised_fraction=0.9, with_last_hidden=True)
    batch = PackedBatch(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})
    blocks = build_blocks(batch, 64, 8, config.mask_token_id, torch.Generator(device="cuda").manual_seed(0))
    target_hidden = eager.target_head.final_norm(batch.last_hidden)
    results = []
    for drafter, dense in ((eager, True), (compiled, False)):
        hidden = drafter(batch.aux_hidden, blocks, build_masks(blocks, config, dense=dense))
        context = drafter.block_context(batch.aux_hidden, blocks)
        loss, metrics = drafter.objective(hidden, blocks, target_hidden, context=context)
        loss.backward()
        results.append((loss, metrics, {n: p.grad for n, p in drafter.named_parameters()}))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=2e-3, atol=2e-3)
    for key in ("tau", "base_tau", "lilicorr/ce", "lilicorr/slot_gt_in_lattice"):
        torch.testing.assert_close(metrics_b[key], metrics_a[key], rtol=0.02, atol=0.02)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=2e-2, atol=2e-3, msg=name)

    half = build_drafter(config, random_head(config)).cuda()
    half.load_state_dict(eager.state_dict())
    half.to(torch.bfloat16)
    loss, metrics = half.forward_train(batch, 64, torch.Generator(device="cuda").manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(metrics[k]).all() for k in half.logged_metrics)
    assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)


# -- through the normal commands ----------------------------------------------------------------


def test_a_lilicorr_run_trains_evaluates_and_exports(short_tmp):
    """run_all.sh trains a LiLiCorr drafter (the producers ship the target's final hidden state for its penalty), the
    trainer logs its metrics, producer 0 evaluates its walk, and trainer.export writes the reference's architecture and
    dflash_config keys."""
    import json
    import subprocess
    import sys

    from tests.test_pipeline import ONE_PRODUCER, ROOT, finish, start

    run_dir = short_tmp / "run"
    overrides = (  # the reranker at its defaults, derived from the tiny target (hidden size 64)
        'drafter.kind="lilicorr"',
        "drafter.lilicorr.lilicorr_w_margin=0.125",
        "training.max_steps=8",
        "eval.every_steps=8",
    )
    finish(start(run_dir, *ONE_PRODUCER, *overrides, "eval.num_prompts=2", "eval.max_new_tokens=8"), run_dir)

    assert "[drafter.lilicorr]" in (run_dir / "config.toml").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("lilicorr/ce" in m and "lilicorr/selected_prefix" in m for m in metrics)
    assert any("eval/tau" in m for m in metrics)
    status = json.loads((run_dir / "trainer.json").read_text())
    assert status["kind"] == "lilicorr" and set(status["kind_metrics"]) == set(LiLiCorrKindHead.logged_metrics)

    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    export = short_tmp / "export"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(export)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    assert (
        config["dflash_config"]["projector_type"] == "lilicorr"
        and config["dflash_config"]["lilicorr_hidden_size"] == 16
        and config["dflash_config"]["lilicorr_factor_dim"] == 16
    )

"""DSpark: the Markov head's three variants and the confidence head, their objective, the decoding walk, the warm start
from DFlash, the confidence cut and the export (common/drafter/dspark/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.acceptance.arithmetic import Transcript, replay_rows
from common.config import ConfigError, load_config
from common.drafter.blocks import build_blocks
from common.drafter.draft_config import default_gamma
from common.drafter.dspark.head_loss import MarkovRows, MarkovTargets, markov_head_rows
from common.drafter.export import config_from_export, export_speculators, export_zlab, load_drafter, speculators_config
from common.drafter.loss import LossConfig, slot_weights
from common.drafter.masks import build_masks
from common.drafter.model import build_drafter
from common.drafter.sampling import Proposal, Sampling
from producer.acceptance.decoder import DraftRows
from tests.drafter_fixtures import host_reads, random_batch, random_head, tiny_config

VARIANTS = ("vanilla", "gated", "rnn")


def dspark_config(**overrides):
    values = dict(kind="dspark", markov_rank=8)
    values.update(overrides)
    return tiny_config(**values)


def with_last_hidden(batch, config, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return dataclasses.replace(
        batch, last_hidden=torch.randn(batch.aux_hidden.shape[0], config.hidden_size, generator=gen)
    )


def trained_like(drafter, seed: int = 1):
    """Every head weight away from its start (W2 no longer zero), as after training."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
    return drafter


def blocks_and_hidden(drafter, seed: int = 0, anchors: int = 12):
    config = drafter.config
    batch = with_last_hidden(random_batch([40, 31], config, seed=seed, supervised_fraction=1.0), config, seed)
    blocks = build_blocks(batch, anchors, config.block_size, config.mask_token_id, torch.Generator().manual_seed(seed))
    hidden = drafter(batch.aux_hidden, blocks, build_masks(blocks, config, dense=True))
    target_hidden = drafter.target_head.final_norm(batch.last_hidden)
    return batch, blocks, hidden, target_hidden


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_dflash_drafter_warm_starts_dspark_with_its_proposals_unchanged(variant):
    """From a DFlash drafter's weights, the DSpark drafter's greedy proposals are the DFlash drafter's token for token,
    and its sampled ones are drawn from the same distributions (slot by slot: its walk draws them one at a time)."""
    config = dspark_config(markov_head_type=variant)
    head = random_head(config)
    torch.manual_seed(0)
    dflash = build_drafter(tiny_config(), head)
    with torch.no_grad():
        for param in dflash.parameters():
            param.normal_(std=0.3)
    dspark = build_drafter(config, head)
    dspark.warm_start(dflash.state_dict())
    _, blocks, hidden, _ = blocks_and_hidden(dflash)
    slots, anchors = hidden, blocks.block_ids[:, 0]
    assert torch.equal(dspark.propose(slots, anchors).tokens, dflash.propose(slots, anchors).tokens)
    sampling = Sampling(temperature=0.8, top_p=0.9)
    ours = dspark.propose(slots, anchors, sampling, torch.Generator().manual_seed(3))
    theirs = dflash.propose(slots, anchors, sampling, torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours.probs, theirs.probs, rtol=0, atol=1e-6)
    assert ours.confidence is not None and ours.confidence.shape == ours.tokens.shape
    with pytest.raises(ValueError, match="not a DFlash or DSpark drafter"):
        dspark.warm_start({"unknown.weight": torch.zeros(1)})


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_objective_trains_every_head_and_logs_its_metrics(variant):
    config = dspark_config(markov_head_type=variant)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    batch = with_last_hidden(random_batch([24, 17, 11], config, seed=0), config)
    loss, metrics = drafter.forward_train(batch, 10, torch.Generator().manual_seed(0))
    loss.backward()
    names = ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight", "fc.weight"]
    names += {"gated": ["markov_head.gate_proj.weight"], "rnn": ["markov_head.joint_proj.weight"]}.get(variant, [])
    params = dict(drafter.named_parameters())
    for name in names:
        assert params[name].grad.abs().sum() > 0, name
    for key in drafter.logged_metrics:
        assert torch.isfinite(metrics[key]), key
    assert 0.0 <= float(metrics["tv"]) <= 1.0
    assert float(metrics["confidence/target"]) == pytest.approx(1.0 - float(metrics["tv"]), abs=1e-6)


def test_the_loss_is_its_three_terms_and_chunks_change_nothing():
    """The loss equals ce_alpha CE + tv_alpha TV + confidence_alpha BCE, each weighted by the slot weights, written out
    over whole logits; computed in chunks of 5 rows it is the same, gradients included."""
    config = dspark_config(markov_head_type="gated")
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    _, blocks, hidden, target_hidden = blocks_and_hidden(drafter)
    options = config.options
    losses, grads = [], []
    for chunk in (5, 100_000):
        hidden_copy = hidden.detach().clone().requires_grad_()
        loss, _ = drafter.objective(hidden_copy, blocks, target_hidden, LossConfig(chunk_rows=chunk))
        (grad,) = torch.autograd.grad(loss, hidden_copy)
        losses.append(loss.detach())
        grads.append(grad)
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(grads[0], grads[1])

    # written out
    slots = hidden.detach()[:, 1:]
    previous = torch.cat([blocks.block_ids[:, :1], blocks.label_ids[:, :-1]], dim=1)
    features, embeddings = drafter.markov_head.features(slots, previous)
    logits = slots @ drafter.target_head.lm_head_weight.T + drafter.markov_head.markov_w2(features)
    q = torch.softmax(logits, -1)
    p = torch.softmax(target_hidden[blocks.label_index - 1] @ drafter.target_head.lm_head_weight.T, -1)
    ce = -torch.log_softmax(logits, -1).gather(-1, blocks.label_ids[..., None]).squeeze(-1)
    tv = 0.5 * (q - p).abs().sum(-1)
    confidence = drafter.confidence_head(slots, embeddings)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(confidence, 1.0 - tv, reduction="none")
    slot = torch.arange(config.block_size - 1, dtype=torch.float32)
    weights = torch.exp(-slot / default_gamma(config.block_size))[None] * blocks.label_mask
    terms = options.ce_alpha * ce + options.tv_alpha * tv + options.confidence_alpha * bce
    torch.testing.assert_close(losses[0], (weights * terms).sum() / weights.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weighting,label_mode", [("decay", "data"), ("dpace", "data"), ("streak", "target_hard")])
def test_the_hand_written_gradient_is_autograds(weighting, label_mode):
    """The objective's vocabulary-wide rows carry a hand-written gradient (head_loss.py); autograd over the same terms
    written out gives the same gradients of the draft states, the Markov features and W2, under every weighting, in
    blocks of chunks that split no block and in one chunk."""
    config = dspark_config(markov_head_type="rnn")
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)))
    _, blocks, hidden, target_hidden = blocks_and_hidden(drafter)
    loss_config = LossConfig(weighting=weighting, label_mode=label_mode)
    slots = blocks.label_mask.shape[1]
    rows = hidden.detach()[:, 1:].reshape(-1, hidden.shape[-1])
    features = torch.randn(rows.shape[0], 8)
    w2 = drafter.markov_head.markov_w2.weight.detach()
    head = drafter.target_head.lm_head_weight
    targets = target_hidden[(blocks.label_index - 1).reshape(-1)]
    labels = blocks.label_ids.reshape(-1) if label_mode == "data" else None

    def written_out(rows, features, w2):
        logits = rows @ head.T + features @ w2.T
        p = torch.softmax(targets @ head.T, -1)
        label = p.argmax(-1) if labels is None else labels
        ce = -torch.log_softmax(logits, -1).gather(-1, label[:, None]).squeeze(-1)
        tv = 1.0 - torch.minimum(torch.softmax(logits, -1), p).sum(-1)
        weights = slot_weights(blocks, loss_config, ce, 1.0 - tv).reshape(-1).detach()
        return (weights * (0.1 * ce + 0.9 * tv)).sum()

    inputs = [t.clone().requires_grad_() for t in (rows, features, w2)]
    expected = torch.autograd.grad(written_out(*inputs), inputs)
    for chunk_rows in (2 * slots + 1, 10_000):
        inputs = [t.clone().requires_grad_() for t in (rows, features, w2)]
        chunked = dataclasses.replace(loss_config, chunk_rows=chunk_rows)
        out = markov_head_rows(*inputs, MarkovTargets(head, targets, labels, blocks.label_mask, chunked, 0.1, 0.9))
        torch.testing.assert_close(out.weighted, written_out(rows, features, w2), rtol=1e-5, atol=1e-6)
        for got, want in zip(torch.autograd.grad(3.0 * out.weighted, inputs), expected):
            torch.testing.assert_close(got, 3.0 * want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_training_tau_is_the_free_walks(variant):
    """Teacher-forced, each block's streak of right picks equals the Markov walk's own from the block's given token."""
    config = dspark_config(markov_head_type=variant)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config)), seed=3)
    _, blocks, hidden, target_hidden = blocks_and_hidden(drafter)
    _, metrics = drafter.objective(hidden, blocks, target_hidden)
    walked = drafter.propose(hidden, blocks.block_ids[:, 0]).tokens
    matches = ((walked == blocks.label_ids) & blocks.label_mask).long().cumprod(1).sum(1).float() * blocks.valid
    torch.testing.assert_close(metrics["block_streaks"], matches)


def test_the_confidence_cut_verifies_only_the_confident_drafts():
    proposal = Proposal(tokens=torch.zeros(3, 4, dtype=torch.long), confidence=torch.tensor(
        [[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]]))  # fmt: skip
    assert proposal.kept_drafts(0.5).tolist() == [2, 0, 4]  # each slot's own confidence, as llama.cpp cuts
    assert proposal.kept_drafts(0.0).tolist() == [4, 4, 4]
    assert Proposal(tokens=torch.zeros(2, 4, dtype=torch.long)).kept_drafts(0.9).tolist() == [4, 4]

    config = dspark_config(block_size=6)
    torch.manual_seed(0)
    drafter = trained_like(build_drafter(config, random_head(config))).eval()
    gen = torch.Generator().manual_seed(0)
    features = [torch.randn(59, config.fused_feature_size, generator=gen) for _ in range(2)]
    transcripts = [
        Transcript(tokens=torch.randint(0, 60, (60,), generator=gen).tolist(), prompt_len=8, features=f)
        for f in features
    ]
    full = replay_rows(DraftRows(drafter, features), transcripts, 20)
    none = replay_rows(DraftRows(drafter, features, confidence_min=1.0), transcripts, 20)
    assert all(d.drafted == [config.block_size - 1] * len(d.accepted) for d in full)
    assert all(set(d.drafted) == {0} and set(d.accepted) == {0} for d in none)
    cut = replay_rows(DraftRows(drafter, features, confidence_min=0.5), transcripts, 20)
    assert all(a <= n for d in cut for a, n in zip(d.accepted, d.drafted))


@pytest.mark.parametrize("variant", VARIANTS)
def test_both_exports_round_trip_with_speculators_names(tmp_path, variant):
    config = dspark_config(markov_head_type=variant, enable_confidence_head=variant != "rnn")
    head = random_head(config)
    drafter = trained_like(build_drafter(config, head))
    exported = speculators_config(config, "verifier")
    assert exported["architectures"] == ["DSparkSpeculator"] and exported["speculators_model_type"] == "dspark"
    assert exported["sample_from_anchor"] is False and exported["markov_rank"] == 8
    assert exported["markov_head_type"] == variant and exported["confidence_head_with_markov"] is True
    assert config_from_export(exported) == config
    names = set(drafter.state_dict())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= names
    assert ("confidence_head.proj.weight" in names) == (variant != "rnn")
    for fmt, write in (
        ("zlab", lambda d: export_zlab(drafter, d, dtype=None)),
        ("speculators", lambda d: export_speculators(drafter, d, "verifier", dtype=None)),
    ):
        loaded = load_drafter(write(tmp_path / fmt), head)
        assert type(loaded) is type(drafter) and loaded.config == config, fmt
        for name, tensor in drafter.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), (fmt, name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["drafter.dspark.markov_rank=0"], "drafter.dspark.markov_rank: must be an integer >= 1"),
        (['drafter.dspark.markov_head_type="lstm"'], "drafter.dspark.markov_head_type: must be one of"),
        (["drafter.dflash2.selector_rank=8"], "drafter.dflash2: options of the dflash2 kind given to a dspark"),
        (['training.objective="lk"'], "training.objective: a dspark drafter trains its own objective"),
    ],
)
def test_bad_dspark_options_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, ['drafter.kind="dspark"', *overrides])


def test_a_rank_above_the_vocabulary_names_the_key():
    with pytest.raises(ValueError, match=r"dspark\.markov_rank 65 must be <= vocab_size 64"):
        dspark_config(markov_rank=65)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("label_mode", ["data", "target_hard"])
def test_gpu_compiled_head_rows_equal_the_eager_ones(label_mode, exact_fp32_matmul):
    """On CUDA the objective's per-chunk work runs compiled: in fp32 the same rows, sum and gradients as the CPU's eager
    code, over chunks of unequal sizes (the last chunk's rows are a new shape)."""
    gen = torch.Generator().manual_seed(0)
    blocks, slots, width, vocab, rank = 9, 7, 32, 1000, 8
    rows = torch.randn(blocks * slots, width, generator=gen)
    features = torch.randn(blocks * slots, rank, generator=gen)
    w2 = torch.randn(vocab, rank, generator=gen) * 0.1
    head = torch.randn(vocab, width, generator=gen) * 0.3
    targets = torch.randn(blocks * slots, width, generator=gen)
    labels = torch.randint(vocab, (blocks * slots,), generator=gen) if label_mode == "data" else None
    mask = torch.rand(blocks, slots, generator=gen) > 0.2
    config = LossConfig(weighting="dpace", label_mode=label_mode, chunk_rows=4 * slots)
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.to(device).requires_grad_() for t in (rows, features, w2)]
        fixed = [None if t is None else t.to(device) for t in (head, targets, labels, mask)]
        out = markov_head_rows(*inputs, MarkovTargets(*fixed, config, 0.1, 0.9))
        results.append([t.cpu() for t in (*out, *torch.autograd.grad(out.weighted, inputs))])
    for name, cpu, cuda in zip((*MarkovRows._fields, "grad_rows", "grad_features", "grad_w2"), *results):
        torch.testing.assert_close(cuda, cpu, rtol=1e-4, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_head_rows_read_nothing_on_the_host():
    """CE's and TV's weights (floats) are constants of the compiled chunk function, not host scalars that each chunk
    reads with item(): the objective's rows and their gradients read nothing on the host."""
    gen = torch.Generator().manual_seed(0)
    blocks, slots, width, vocab, rank = 9, 7, 32, 1000, 8
    rows, features = (torch.randn(blocks * slots, n, generator=gen).cuda().requires_grad_() for n in (width, rank))
    w2 = (torch.randn(vocab, rank, generator=gen) * 0.1).cuda().requires_grad_()
    head, targets = torch.randn(vocab, width, generator=gen).cuda(), torch.randn(blocks * slots, width).cuda()
    mask = torch.ones(blocks, slots, dtype=torch.bool, device="cuda")
    config = LossConfig(weighting="dpace", chunk_rows=4 * slots)

    def step():
        out = markov_head_rows(rows, features, w2, MarkovTargets(head, targets, None, mask, config, 0.1, 0.9))
        torch.autograd.grad(out.weighted, (rows, features, w2))

    assert host_reads(step) == 0

"""Sampled speculative decoding is lossless: its text is distributed as the target's own sampling, for both drafter
kinds (DFlash: q over the vocabulary; DFlash 2: q over the selector's candidates), checked against the target's exact
distributions by a chi-square test whose threshold is derived here; and a sampled evaluation is seeded and
reproducible, with z-lab's tau beside ours.

The threshold: Pearson's statistic X2 = sum over cells of (observed - expected)^2 / expected, cells with an expected
count below 5 pooled into one, is asymptotically chi-square with (cells - 1) degrees of freedom when the samples
follow the expected distribution. We fail above its 1 - ALPHA quantile (Wilson-Hilferty: df (1 - 2/(9 df) + z
sqrt(2/(9 df)))^3, z the normal's 1 - ALPHA quantile), so a correct decoder fails one comparison with probability
about ALPHA (the seeds are fixed: the test is deterministic). A wrong residual (a rejected draft replaced by a draw
from p instead of max(0, p - q)) puts min(p, q) + (1 - sum min(p, q)) p where p belongs; the drafters here make that
miss, most where q is sharp and p is not; the test of the verification step alone (40 000 blocks) sees it at once.
Through the whole decoder (a few hundred continuations per kind, to stay fast) each generated token is compared with
the target's exact distribution after the same prefix (grouped by prefix: the marginal would average a wrong
decoder's errors away).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from common.acceptance.arithmetic import zlab_acceptance_lengths
from common.config import load_config
from common.drafter.model import build_drafter
from common.drafter.sampling import Sampling, rejection_sample, sample_from, sampling_probs
from producer.acceptance.decoder import DraftContext, speculative_decode, speculative_decode_rows
from producer.acceptance.evaluator import build_evaluator
from producer.target_model.greedy import GreedyTarget
from producer.target_model.load import target_head_of
from tests.drafter_fixtures import tiny_config, tiny_qwen3_target

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 16
BLOCK = 3
LAYER_IDS = [1, 2]
PROMPT = torch.tensor([3, 9, 1, 4, 12, 7])
NEW_TOKENS = 3
ALPHA = 1e-4
SAMPLES = 400  # continuations per drafter kind through the whole decoder
MIN_GROUP = 40  # samples of a prefix for its own group in the conditional test
SAMPLING = Sampling(temperature=1.0)
TOP_K = 8  # DFlash 2 candidates: half the vocabulary
HEAD_SCALE = 40.0


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("target")
    tiny_qwen3_target(directory, vocab_size=VOCAB, num_layers=4, hidden=32, seed=1)
    return directory


@pytest.fixture(scope="module")
def target_model(target_dir):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    with torch.no_grad():  # sharp distributions (a random head's logits are near 0): p and q then differ a lot
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


def drafter_of(kind: str, target_model, block_size: int = BLOCK):
    """A random drafter whose proposals differ from the target's distribution (larger weights than at init)."""
    extra = {
        "dflash": {},
        "dflash2": dict(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=TOP_K),
        "dspark": dict(kind="dspark", markov_rank=8),
        "lilicorr": dict(
            kind="lilicorr",
            lilicorr_candidate_topk=TOP_K,
            lilicorr_hidden_size=16,
            lilicorr_factor_dim=8,
            lilicorr_num_heads=2,
        ),
    }[kind]
    config = tiny_config(
        vocab_size=VOCAB,
        mask_token_id=VOCAB - 1,
        target_layer_ids=LAYER_IDS,
        num_target_layers=4,
        num_hidden_layers=1,
        block_size=block_size,
        **extra,
    )
    torch.manual_seed(0)
    drafter = build_drafter(config, target_head_of(target_model)).eval()
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if (
                name.endswith("proj.weight")
                or name == "fc.weight"
                or any(part in name for part in ("candidate_selector", "conv", "markov_head"))
            ):
                param.normal_(std=0.3)
    return drafter


@torch.no_grad()
def exact_conditionals(model, prompt: torch.Tensor, sampling: Sampling, length: int) -> list[torch.Tensor]:
    """The target's own sampling distribution of generated token k + 1 after every prefix of k generated tokens, for
    k < ``length``: ``[V ** k, V]`` each, prefixes in base-V order (one batched forward per k)."""
    prefixes = torch.empty(1, 0, dtype=torch.long)
    conditionals = []
    for _ in range(length):
        ids = torch.cat([prompt.expand(prefixes.shape[0], -1), prefixes], dim=1)
        conditionals.append(sampling_probs(model(input_ids=ids).logits[:, -1], sampling).double())
        prefixes = torch.cat(
            [prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1
        )
    return conditionals


def chi_square_cells(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` [V] against ``expected_probs`` [V] and its degrees of freedom: cells with an
    expected count below 5 pooled into one (which, if still below 5, joins the smallest other cell)."""
    n = float(counts.sum())
    expected = expected_probs.double() * n
    big = expected >= 5
    observed_cells = [float(c) for c in counts[big]]
    expected_cells = [float(e) for e in expected[big]]
    small_expected, small_observed = float(expected[~big].sum()), float(counts[~big].sum())
    if small_expected >= 5 or (small_expected > 0 and not expected_cells):
        observed_cells.append(small_observed)
        expected_cells.append(small_expected)
    elif expected_cells and (small_expected > 0 or small_observed > 0):
        smallest = min(range(len(expected_cells)), key=expected_cells.__getitem__)
        observed_cells[smallest] += small_observed
        expected_cells[smallest] += small_expected
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed_cells, expected_cells))
    return statistic, len(expected_cells) - 1


def threshold_of(df: int) -> float:
    """The 1 - ALPHA quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    z = float(torch.special.ndtri(torch.tensor(1.0 - ALPHA, dtype=torch.float64)))
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(Pearson's statistic, its 1 - ALPHA threshold) of ``counts`` against ``expected_probs``."""
    statistic, df = chi_square_cells(counts, expected_probs)
    return statistic, threshold_of(max(df, 1))


def conditional_chi_square(tokens: torch.Tensor, conditionals: list[torch.Tensor], k: int) -> tuple[float, float]:
    """(statistic, threshold) of generated token k + 1 given the k before it: each prefix seen at least MIN_GROUP
    times is one group whose counts are compared with the target's distribution after that prefix; the groups are
    independent given their prefixes, so the statistics and the degrees of freedom add up. Conditioning on the
    prefix keeps the test sharp: the marginal averages a wrong decoder's errors over the prefixes."""
    prefix_index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(k):
        prefix_index = prefix_index * VOCAB + tokens[:, j]
    statistic, df = 0.0, 0
    for prefix in prefix_index.unique().tolist():
        chosen = prefix_index == prefix
        if int(chosen.sum()) < MIN_GROUP:
            continue
        s, d = chi_square_cells(torch.bincount(tokens[chosen, k], minlength=VOCAB), conditionals[k][prefix])
        statistic, df = statistic + s, df + d
    return statistic, threshold_of(max(df, 1))


def test_rejection_sampling_keeps_the_target_distribution():
    """The verification step alone, many blocks at once: whatever q is (here far from p, and zero on most of
    the vocabulary as a DFlash 2 candidate set is), the first two tokens of the verified text follow p."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 40_000, 12
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)  # the target after the anchor, each draft, bonus
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    q[1, 4:] = 0  # a candidate set
    q[1] /= q[1].sum()
    drafted = sample_from(q.expand(rows, -1, -1), gen)
    # p after the second draft depends on the first: a different distribution for each first token.
    second = torch.softmax(torch.randn(vocab, vocab, generator=gen), -1)
    target = torch.stack([p[0].expand(rows, -1), second[drafted[:, 0]], p[2].expand(rows, -1)], dim=1)
    accepted, after = rejection_sample(drafted, target, q.expand(rows, -1, -1), gen)
    first = torch.where(accepted >= 1, drafted[:, 0], after)
    statistic, threshold = chi_square(torch.bincount(first, minlength=vocab), p[0])
    assert statistic < threshold, (statistic, threshold)
    # The second token, given that the first was drafted and kept, follows p after that first token.
    kept_first = accepted >= 1
    second_token = torch.where(accepted >= 2, drafted[:, 1], after)[kept_first]
    expected = (second[drafted[kept_first, 0]]).mean(0)  # the mixture over the kept first tokens
    statistic, threshold = chi_square(torch.bincount(second_token, minlength=vocab), expected)
    assert statistic < threshold, (statistic, threshold)
    assert 0.1 < float(accepted.float().mean()) < 1.9  # the drafts are often rejected: the residual is exercised


# LiLiCorr's run here (its reranker at its start) is a further one: tests/test_lilicorr.py's
# test_sampled_speculative_decoding_with_lilicorr_samples_the_target runs this test with a reranker away from its start.
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark", pytest.param("lilicorr", marks=pytest.mark.thorough)])
def test_sampled_speculative_decoding_samples_the_target(target_model, kind):
    """Every generated token of sampled speculative decoding, through the whole decoder (the drafter's proposal, the
    target's verify forward, rejection sampling, the KV cache), follows the target's own sampling distribution."""
    drafter = drafter_of(kind, target_model)
    target = GreedyTarget(target_model, LAYER_IDS)
    generator = torch.Generator().manual_seed(1)
    tokens, accepted = [], []
    for _ in range(SAMPLES):
        decoded = speculative_decode(
            DraftContext(drafter), target, PROMPT, NEW_TOKENS, frozenset(), SAMPLING, generator
        )
        tokens.append(decoded.tokens)
        accepted += decoded.accepted
    tokens = torch.tensor(tokens)
    conditionals = exact_conditionals(target_model, PROMPT, SAMPLING, NEW_TOKENS)
    results = [conditional_chi_square(tokens, conditionals, k) for k in range(NEW_TOKENS)]
    print(
        kind,
        "chi-square (statistic, threshold) of tokens 1..3:",
        results,
        "mean accepted:",
        sum(accepted) / len(accepted),
    )
    for k, (statistic, threshold) in enumerate(results, start=1):
        assert statistic < threshold, f"{kind}: generated token {k}: chi-square {statistic:.1f} >= {threshold:.1f}"
    # Drafts are kept and rejected alike: both ways of making a token are exercised.
    assert 0 < sum(accepted) < len(accepted) * (BLOCK - 1)


def test_sampled_decoding_is_seeded_and_greedy_at_temperature_zero(target_model):
    drafter = drafter_of("dflash2", target_model)
    target = GreedyTarget(target_model, LAYER_IDS)

    def run(seed: int, sampling: Sampling | None):
        generator = torch.Generator().manual_seed(seed)
        return speculative_decode(DraftContext(drafter), target, PROMPT, 20, frozenset(), sampling, generator)

    assert run(3, SAMPLING) == run(3, SAMPLING)
    assert run(3, SAMPLING).tokens != run(4, SAMPLING).tokens
    assert run(3, Sampling(0.0)) == run(4, None)  # temperature 0 is the greedy decoder


ROW_PROMPTS = [PROMPT, torch.tensor([5, 2]), torch.tensor([11, 3, 8, 1, 0, 6, 2, 9, 13]), torch.tensor([7])]


@pytest.fixture(scope="module")
def target_model_fp64(target_model):
    """The target in float64, so that prompts decoded together and alone round alike (a larger product sums in
    another order) and the draws, not rounding, decide what they keep; with a quarter of the sharpened head, so
    that sampled drafts are kept as well as rejected."""
    model = copy.deepcopy(target_model).double()
    with torch.no_grad():
        model.lm_head.weight.div_(4.0)
    return model


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
@pytest.mark.parametrize("sampling", [SAMPLING, None], ids=["sampled", "greedy"])
def test_prompts_decoded_together_keep_what_each_keeps_alone(target_model_fp64, kind, sampling):
    """One drafter forward and one target forward a round for every prompt, in one cache whose rejected slots stay
    as holes: each prompt's text, acceptances and draft counts are those of its own decoding, drawn from its own
    generator; prompts of other lengths, some stopping early (stop token 4), others running to the token limit."""
    drafter = drafter_of(kind, target_model_fp64, block_size=4).double()
    target = GreedyTarget(target_model_fp64, LAYER_IDS)
    stops = frozenset({4})

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(10 + i) for i in range(len(ROW_PROMPTS))]

    alone = [
        speculative_decode(DraftContext(drafter), target, prompt, 14, stops, sampling, generator)
        for prompt, generator in zip(ROW_PROMPTS, generators())
    ]
    contexts = [DraftContext(drafter) for _ in ROW_PROMPTS]
    together = speculative_decode_rows(contexts, target, ROW_PROMPTS, 14, stops, sampling, generators())
    assert together == alone
    assert len({len(d.accepted) for d in alone}) > 1  # the rows finish in different rounds
    assert any(n < drafted for d in alone for n, drafted in zip(d.accepted, d.drafted)), "no draft was rejected"
    if sampling is not None:  # a random drafter's greedy drafts are seldom the target's
        assert any(0 < n < drafted for d in alone for n, drafted in zip(d.accepted, d.drafted)), "no block split"


def test_a_sampled_evaluation_of_prompts_together_equals_one_prompt_at_a_time(target_dir, target_model_fp64):
    cfg = load_config(
        None, [*SMALL_DATA, f"target.path={json.dumps(str(target_dir))}", "eval.temperature=1.0", "eval.seed=3"]
    )
    drafter = drafter_of("dflash", target_model_fp64).double()
    reports = []
    for size in (1, 3):
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, batch_prompts=size))
        reports.append(build_evaluator(cfg, target_model_fp64, LAYER_IDS).evaluate(drafter))
    one, together = reports
    assert (together.tau, together.zlab_tau, together.accept_pos, together.generated_tokens) == (
        one.tau,
        one.zlab_tau,
        one.accept_pos,
        one.generated_tokens,
    )
    assert one.num_prompts == 3


def test_zlab_acceptance_lengths_cut_the_last_step():
    from common.acceptance.arithmetic import Decoded, zlab_tau

    # max_new_tokens 7: the prefill's token, then steps of 3 and 2 tokens, then a full block of 3 cut to the 1 left.
    decoded = Decoded(tokens=[1, 2, 3, 4, 5, 6, 7], accepted=[2, 1, 2])
    assert zlab_acceptance_lengths(decoded) == [3, 2, 1]
    stopped = Decoded(tokens=[1, 2, 9], accepted=[3, 3])  # stop token 9 second of a kept block of 4
    assert zlab_acceptance_lengths(stopped) == [2]
    assert zlab_acceptance_lengths(Decoded(tokens=[9], accepted=[])) == []
    assert zlab_tau([decoded, stopped, Decoded(tokens=[9], accepted=[])]) == pytest.approx((2.0 + 2.0) / 2)


SMALL_DATA = [
    "data.num_samples=20",
    "data.mean_len=48",
    "data.min_len=24",
    "data.max_seq_len=96",
    "batching.token_budget=128",
    "drafter.num_anchors=16",
    "eval.num_prompts=3",
    "eval.max_new_tokens=12",
]


def test_a_sampled_evaluation_reports_both_taus_and_repeats_itself(target_dir, target_model):
    cfg = load_config(
        None,
        [
            *SMALL_DATA,
            f"target.path={json.dumps(str(target_dir))}",
            "eval.temperature=0.8",
            "eval.top_p=0.9",
            "eval.top_k=8",
            "eval.seed=5",
        ],
    )
    drafter = drafter_of("dflash", target_model)
    evaluator = build_evaluator(cfg, target_model, LAYER_IDS)
    first, again = evaluator.evaluate(drafter), evaluator.evaluate(drafter)
    metrics = first.metrics()
    assert (first.tau, first.zlab_tau, first.accept_pos) == (again.tau, again.zlab_tau, again.accept_pos)
    assert evaluator.reference.transcripts == []  # no greedy continuation is made for a sampled evaluation
    assert "eval/sim_tau_walk" not in metrics and metrics["eval/temperature"] == 0.8 and metrics["eval/seed"] == 5
    assert 1.0 <= first.zlab_tau <= BLOCK and 1.0 <= first.tau <= BLOCK
    assert "sampled at temperature 0.8" in first.table() and "tau (z-lab)" in first.table()
    other = build_evaluator(
        dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, seed=6)), target_model, LAYER_IDS
    )
    assert other.evaluate(drafter).accept_pos != first.accept_pos  # another seed, other draws

"""Our live decoder against z-lab's reference decoder (``dflash.model.dflash_generate``), greedy: our exported drafter
of either kind, loaded into z-lab's own model class, produces with dflash_generate the same tokens and the same
acceptance lengths, step by step, as ``speculative_decode`` on the same prompts and target.

The two count steps differently, and the test maps one onto the other explicitly: our ``Decoded.accepted`` holds the
drafts each verify forward accepted (0 .. B - 1; the last block counted whole); dflash_generate's
``acceptance_lengths`` hold the tokens each step added to its output (the accepted drafts and the target's token
after them), cut at the stop token and at max_new_tokens, so step i is ``accepted[i] + 1`` except where a cut falls
(``zlab_acceptance_lengths``). dflash_generate also drafts a shorter block where fewer than B - 1 tokens are left
before max_new_tokens (its drafts there may differ); so each comparison lets it run B - 1 tokens further than ours,
or ends both at a stop token early enough that no block is shortened.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from common.acceptance.arithmetic import zlab_acceptance_lengths
from common.drafter.export import export_zlab
from common.drafter.model import build_drafter
from producer.acceptance.decoder import DraftContext, speculative_decode
from producer.acceptance.transcripts import greedy_transcripts
from producer.target_model.greedy import GreedyTarget
from producer.target_model.load import target_head_of
from tests.drafter_fixtures import tiny_config, tiny_qwen3_target, train_on_transcripts

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("dflash") is None,
        reason="z-lab's reference package is missing: pip install --no-deps dflash==0.1.0 (launch/setup.sh installs it)",
    ),
    pytest.mark.usefixtures("one_thread"),
]

LAYER_IDS = [1, 3]
BLOCK = 4
NEW_TOKENS = 40
KIND_FIELDS = {"dflash": {}, "dflash2": dict(kind="dflash2", conv_group_size=8, selector_rank=8, selector_top_k=4)}


@pytest.fixture(autouse=True)
def host_clock(monkeypatch):
    """dflash_generate's statistics (its acceptance lengths come only with them) time through CUDA: the host's clock
    here."""
    import time

    import dflash.model

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)


@pytest.fixture(scope="module")
def target_model(tmp_path_factory):
    """A tiny random Qwen3 saved with save_pretrained and loaded back (head_dim 8, as the drafter's)."""
    return tiny_qwen3_target(tmp_path_factory.mktemp("target"), vocab_size=64, num_layers=6, hidden=32)


def prompts(count: int, vocab: int, length: int = 10) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab - 1, (length,), generator=gen) for _ in range(count)]


def trained_drafter(kind: str, target, prompt_list: list[torch.Tensor], config):
    """A drafter of ``kind`` trained briefly on the target's greedy continuations of the prompts, so that it accepts
    blocks (a comparison of all-zero acceptances would prove little)."""
    torch.manual_seed(0)
    drafter = build_drafter(config, target_head_of(target.model))
    transcripts = greedy_transcripts(target, prompt_list, NEW_TOKENS + BLOCK, 1)
    target.detach()
    return train_on_transcripts(drafter, transcripts, steps=120)


def zlab_model(kind: str, drafter, directory):
    """Our drafter exported (fp32) and loaded by z-lab's own class."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    export_zlab(drafter, directory, dtype=torch.float32)
    model_class = DFlash2DraftModel if kind == "dflash2" else DFlashDraftModel
    return model_class.from_pretrained(directory, torch_dtype=torch.float32).eval()


def zlab_run(reference, target_model, prompt: torch.Tensor, max_new_tokens: int, stop: frozenset[int]):
    from dflash.model import dflash_generate

    with torch.no_grad():
        out = dflash_generate(
            reference, target_model, prompt[None], max_new_tokens, sorted(stop) or None, return_stats=True
        )
    return out.output_ids[0, prompt.numel() :].tolist(), [int(n) for n in out.acceptance_lengths]


def stop_token_for(tokens: list[int], max_new_tokens: int) -> int | None:
    """A token whose first occurrence in ``tokens`` lies as late as possible where no block of dflash_generate is
    shortened before it (at least B - 1 tokens before max_new_tokens), and past the prefill's token."""
    first = {}
    for i, token in enumerate(tokens):
        first.setdefault(token, i)
    fitting = [(i, t) for t, i in first.items() if 2 <= i <= max_new_tokens - BLOCK]
    return max(fitting)[1] if fitting else None


def compare(kind: str, target_model, drafter, reference, prompt_list) -> list[int]:
    """Each prompt decoded both ways; every step of dflash_generate mapped onto ours. Returns our acceptances."""
    target = GreedyTarget(target_model, list(drafter.config.target_layer_ids))
    all_accepted = []
    for r, prompt in enumerate(prompt_list):
        ours = speculative_decode(DraftContext(drafter), target, prompt, NEW_TOKENS)
        all_accepted += ours.accepted
        # No stop token: dflash_generate runs B - 1 tokens further, so none of our steps is a shortened block there.
        # Its steps are ours, each adding our accepted drafts + the target's token; its text begins with ours.
        tokens, lengths = zlab_run(reference, target_model, prompt, NEW_TOKENS + BLOCK - 1, frozenset())
        assert tokens[: len(ours.tokens)] == ours.tokens, (kind, r)
        assert lengths[: len(ours.accepted)] == [a + 1 for a in ours.accepted], (kind, r)
        # A stop token early enough that no block is shortened: both end after it; the steps are the same, the last
        # cut at the stop token on both sides (ours counts that block whole in ``accepted``).
        stop_token = stop_token_for(ours.tokens, NEW_TOKENS)
        if stop_token is None:
            continue
        stop = frozenset([stop_token])
        stopped = speculative_decode(DraftContext(drafter), target, prompt, NEW_TOKENS, stop)
        tokens, lengths = zlab_run(reference, target_model, prompt, NEW_TOKENS, stop)
        assert tokens == stopped.tokens and stopped.tokens[-1] == stop_token, (kind, r)
        assert lengths == zlab_acceptance_lengths(stopped), (kind, r)
        assert lengths[:-1] == [a + 1 for a in stopped.accepted[:-1]] and lengths[-1] <= stopped.accepted[-1] + 1
        assert sum(lengths) == len(stopped.tokens) - 1  # every token but the prefill's comes from a step
    return all_accepted


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_generate_with_our_export_decodes_as_we_do(tmp_path, target_model, kind):
    config = tiny_config(target_layer_ids=LAYER_IDS, block_size=BLOCK, **KIND_FIELDS[kind])
    prompt_list = prompts(4, config.vocab_size)
    drafter = trained_drafter(kind, GreedyTarget(target_model, LAYER_IDS), prompt_list, config)
    reference = zlab_model(kind, drafter, tmp_path / "export")
    accepted = compare(kind, target_model, drafter, reference, prompt_list)
    assert sum(accepted) > len(accepted) // 2, "the drafter accepts drafts: the comparison is not all zeros"


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_generate_on_smollm2_decodes_as_we_do(tmp_path, kind):
    """The same on the real model (SmolLM2-135M, fp32), with a random drafter of its shapes."""
    from transformers import AutoModelForCausalLM

    from tests.real_model import smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), torch_dtype=torch.float32).eval()
    text = model.config
    config = tiny_config(
        hidden_size=text.hidden_size,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads,
        vocab_size=text.vocab_size,
        target_hidden_size=text.hidden_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=[1, text.num_hidden_layers // 2, text.num_hidden_layers - 3],
        mask_token_id=text.vocab_size - 1,
        block_size=BLOCK,
        **(
            {**KIND_FIELDS[kind], "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 8}
            if kind == "dflash2"
            else {}
        ),
    )
    torch.manual_seed(0)
    drafter = build_drafter(config, target_head_of(model)).eval()
    reference = zlab_model(kind, drafter, tmp_path / "export")
    prompt_list = [torch.tensor([1, 9690, 198, 2683, 314, 253, 5356, 11173, 30, 2]), prompts(1, 2000, length=12)[0]]
    compare(kind, model, drafter, reference, prompt_list)

"""Every built-in drafter kind trains on the tiny default with its own defaults: an option whose reference value
depends on the target (DSpark's Markov rank, bounded by the vocabulary; LiLiCorr's reranker and factor widths) is
derived from the drafter's shape, and keeps the reference's value where the target is big enough."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from common.drafter.kinds import KINDS
from common.drafter.model import build_drafter
from producer.target_model.load import build_target_config
from tests.drafter_fixtures import random_head, tiny_config
from trainer.build import draft_config_for

ROOT = Path(__file__).resolve().parents[1]
BUILT_IN = ("dflash", "dflash2", "dspark", "lilicorr")
DERIVED = {"dspark": {"markov_rank": 64}, "lilicorr": {"lilicorr_hidden_size": 16, "lilicorr_factor_dim": 16}}
"""What the tiny default (vocabulary 64, hidden size 64) derives of each kind's target-bound options."""


def tiny_default_drafter(kind: str, head_dir: Path):
    cfg = load_config(ROOT / "launch" / "tiny.toml", [f'drafter.kind="{kind}"'])
    config = draft_config_for(cfg, build_target_config(cfg.target), head_dir)
    return cfg, build_drafter(config, random_head(config))


def trainable(drafter) -> int:
    return sum(p.numel() for p in drafter.parameters() if p.requires_grad)


def test_the_built_in_kinds_are_the_ones_named_here():
    assert set(BUILT_IN) <= set(KINDS)


@pytest.mark.parametrize("kind", BUILT_IN)
def test_every_kind_builds_on_the_tiny_default_at_a_size_near_dflash(kind, tmp_path):
    """The tiny default resolves every kind's defaults to a drafter that fits its target (DSpark's rank 256 was refused
    against the vocabulary of 64), and no kind's additions dwarf the DFlash backbone they extend (LiLiCorr's
    1024-wide reranker was 25.0M parameters beside a 0.4M drafter, 65x DFlash's step)."""
    cfg, drafter = tiny_default_drafter(kind, tmp_path)
    for name, value in DERIVED.get(kind, {}).items():
        assert getattr(drafter.config.options, name) == value, name
        assert getattr(cfg.drafter.options, name) is None, "the run's own options stay as given (derived per drafter)"
    _, dflash = tiny_default_drafter("dflash", tmp_path)
    assert trainable(drafter) <= 3 * trainable(dflash), (kind, trainable(drafter), trainable(dflash))


def test_a_target_big_enough_keeps_the_references_values():
    wide = dict(hidden_size=4096, target_hidden_size=4096, num_attention_heads=32, head_dim=128, vocab_size=1000)
    assert tiny_config(kind="dspark", **wide).options.markov_rank == 256
    lilicorr = tiny_config(kind="lilicorr", **wide).options
    assert (lilicorr.lilicorr_hidden_size, lilicorr.lilicorr_factor_dim) == (1024, 1024)


@pytest.mark.parametrize(("hidden", "width"), [(64, 16), (100, 32), (576, 144), (2048, 512), (5120, 1024)])
def test_the_rerankers_default_width_keeps_the_references_quarter_of_the_drafter(hidden, width):
    """Model-Optimizer's 1024-wide reranker on 4096-wide drafters: a quarter, rounded up to whole heads, at most 1024.
    As wide as the drafter (the former default) it ran over K times the drafter's positions and took the tiny
    default's LiLiCorr run to 2.27x DFlash's time."""
    options = tiny_config(kind="lilicorr", hidden_size=hidden, target_hidden_size=hidden, vocab_size=1000).options
    assert (options.lilicorr_hidden_size, options.lilicorr_factor_dim) == (width, width)


def test_a_value_given_is_kept_and_still_checked_against_the_target():
    assert tiny_config(kind="dspark", markov_rank=8).options.markov_rank == 8
    assert tiny_config(kind="lilicorr", lilicorr_hidden_size=0).options.lilicorr_hidden_size == 0
    with pytest.raises(ValueError, match=r"dspark\.markov_rank 65 must be <= vocab_size 64"):
        tiny_config(kind="dspark", markov_rank=65)

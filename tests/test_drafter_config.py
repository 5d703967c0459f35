"""Draft config: layer-id rule, derivation from a target config, validation, RoPE settings."""

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from common.drafter.draft_config import DraftConfig, build_target_layer_ids, default_gamma
from common.drafter.model import RotaryEmbedding
from tests.drafter_fixtures import tiny_config


def qwen3_8b_config(**overrides) -> Qwen3Config:
    values = dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    values.update(overrides)
    return Qwen3Config(**values)


class FakeTokenizer:
    """Qwen3's tokenizer has 151669 entries and no mask token."""

    mask_token_id = None

    def __len__(self) -> int:
        return 151669


def test_layer_id_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(36, 1) == [18]
    assert build_target_layer_ids(28, 2) == [1, 25]
    ids = build_target_layer_ids(64, 4)
    assert ids[0] == 1 and ids[-1] == 61


def test_from_target_qwen3_8b():
    config = DraftConfig.from_target(qwen3_8b_config(), num_draft_layers=5, tokenizer=FakeTokenizer())
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.mask_token_id == 151669
    assert (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    ) == (4096, 12288, 32, 8, 128, 151936)
    assert config.rope_theta == 1e6 and config.num_target_layers == 36
    assert config.layer_types == ["full_attention"] * 5
    assert config.fused_feature_size == 5 * 4096
    assert default_gamma(16) == 7 and default_gamma(10) == 5 and default_gamma(8) == 4
    assert default_gamma(12) == pytest.approx(5 + 2 / 3) and default_gamma(9) == 4.5


def test_from_target_overrides_and_explicit_mask():
    config = DraftConfig.from_target(
        qwen3_8b_config(),
        num_draft_layers=5,
        mask_token_id=7,
        block_size=8,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        target_layer_ids=[2, 10, 18, 26, 34],
    )
    assert config.mask_token_id == 7 and config.block_size == 8 and config.target_layer_ids[0] == 2
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftConfig.from_target(qwen3_8b_config())


def test_named_target_layers_on_a_target_too_shallow_for_the_default_rule():
    """Two draft layers over a 4-layer target: the default rule gives [1, 1] and refuses, naming the key; the layers
    named with drafter.target_layer_ids are taken without the rule being asked (the trainer once failed here)."""
    shallow = qwen3_8b_config()
    shallow.num_hidden_layers = 4
    with pytest.raises(ValueError, match="drafter.target_layer_ids"):
        DraftConfig.from_target(shallow, num_draft_layers=2, mask_token_id=7)
    config = DraftConfig.from_target(shallow, num_draft_layers=2, mask_token_id=7, target_layer_ids=[1, 2])
    assert config.target_layer_ids == [1, 2] and config.num_target_layers == 4


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(target_layer_ids=[1, 6]), "target_layer_ids"),
        (dict(mask_token_id=64), "mask_token_id"),
        (dict(block_size=1), "block_size"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8192},
    ],
)
def test_rope_matches_the_target(rope_parameters):
    target = qwen3_8b_config(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_size=64,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=32768,
    )
    config = DraftConfig.from_target(target, num_draft_layers=2, mask_token_id=1)
    positions = torch.tensor([0, 5, 100, 20000])
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    ref_cos, ref_sin = Qwen3RotaryEmbedding(target)(torch.zeros(1), positions[None])
    torch.testing.assert_close(cos, ref_cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, ref_sin[0], rtol=1e-5, atol=1e-5)


def test_rope_theta_from_legacy_fields():
    class Legacy:
        rope_theta = 123.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    from common.drafter.draft_config import target_rope_parameters

    assert target_rope_parameters(Legacy()) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 123.0}

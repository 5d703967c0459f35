"""The trainer's line about the mask token it chose names the token, or says it is an id past the tokenizer."""

from __future__ import annotations

import logging

from test_target import tiny_qwen3_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from common.config import load_config
from trainer.build import draft_config_for


def test_a_mask_past_the_tokenizer_is_said_so_not_printed_as_none(tmp_path, caplog):
    """A tokenizer of 63 tokens on a head of 64: the mask is id 63, which no token spells (the log said 'None')."""
    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(62)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eot|>").save_pretrained(tmp_path)
    target = tiny_qwen3_config(vocab_size=64)
    with caplog.at_level(logging.INFO, logger="trainer.build"):
        config = draft_config_for(load_config(None, ["drafter.num_layers=1"]), target, tmp_path)
    line = next(r.getMessage() for r in caplog.records if "mask token is" in r.getMessage())
    assert config.mask_token_id == 63
    assert "the mask token is 63, the first id past the tokenizer's 63 tokens" in line and "None" not in line, line

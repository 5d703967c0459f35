"""Data sources: chat-template loss masks, pre-tokenized files, bad records, synthetic data."""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from common.config import DataConfig
from producer.data.build import build_data_source
from producer.data.files import index_line_offsets
from producer.data.render import render_chat

# Qwen-style: <|im_start|>role\n...<|im_end|>\n, with a default system prompt when none is given.
PLAIN_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\nBe brief.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# Like Qwen3: only assistant turns after the last user turn get a (here empty) think block, so
# rendering a prefix that ends on an earlier assistant turn is not a prefix of the full text.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

GENERATION_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}{% generation %}{{- message.content + '<|im_end|>\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "add 2+2"},
    {"role": "assistant", "content": "4"},
]


def tiny_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: one token per ASCII character, plus the chat specials."""
    vocab = {char: i for i, char in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, additional_special_tokens=["<|im_start|>", "<|im_end|>"], eos_token="<|im_end|>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def expected(tokenizer: PreTrainedTokenizerFast, segments: list[tuple[str, int]]) -> tuple[list[int], list[int]]:
    """Token ids and mask of text given as (piece, masked) segments (this tokenizer never merges)."""
    ids, mask = [], []
    for text, masked in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [masked] * len(piece)
    return ids, mask


def test_chat_mask_covers_assistant_turns_only():
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    ids, mask = render_chat(tokenizer, CONVERSATION)
    want_ids, want_mask = expected(
        tokenizer,
        [
            ("<|im_start|>system\nBe brief.<|im_end|>\n", 0),
            ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello!<|im_end|>\n", 1),
            ("<|im_start|>user\nadd 2+2<|im_end|>\n<|im_start|>assistant\n", 0),
            ("4<|im_end|>\n", 1),
        ],
    )
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    assert tokenizer.decode(ids[mask == 1]) == "Hello!<|im_end|>\n4<|im_end|>\n"


def test_chat_mask_when_template_rewrites_earlier_turns():
    tokenizer = tiny_tokenizer(THINKING_TEMPLATE)
    ids, mask = render_chat(tokenizer, CONVERSATION)
    want_ids, want_mask = expected(
        tokenizer,
        [
            ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", 0),
            ("Hello!<|im_end|>\n", 1),
            ("<|im_start|>user\nadd 2+2<|im_end|>\n<|im_start|>assistant\n", 0),
            ("<think>\n\n</think>\n\n", 0),  # inserted by the template: never a training target
            ("4<|im_end|>\n", 1),
        ],
    )
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask


# The structure of the Qwen3.5 / Qwen3.6 template: thinking on by default, the generation prompt opening a
# think block (``enable_thinking=False`` closes it at once); reasoning (``reasoning_content``) rendered only
# for the turns after the last user message, which always get a think block, empty when there is none.
QWEN35_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip() + '\n</think>\n\n' + m.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    "{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("with_reasoning", [True, False])
def test_qwen35_template_masks_reasoning_and_answer_never_an_empty_think_block(thinking, with_reasoning):
    tokenizer = tiny_tokenizer(QWEN35_TEMPLATE)
    last = {"role": "assistant", "content": "4"}
    if with_reasoning:
        last["reasoning_content"] = "2 and 2 make 4."
    conversation = [*CONVERSATION[:3], last]
    ids, mask = render_chat(tokenizer, conversation, enable_thinking=thinking)
    history = [
        ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Hello!<|im_end|>\n", 1),
        ("<|im_start|>user\nadd 2+2<|im_end|>\n<|im_start|>assistant\n<think>\n", 0),
    ]
    if with_reasoning:  # the reasoning and the answer are what the target generates
        final = [("2 and 2 make 4.\n</think>\n\n4<|im_end|>\n", 1)]
    else:  # the template's empty block, in the prompt or not, is never supervised
        final = [("\n</think>\n\n", 0), ("4<|im_end|>\n", 1)]
    want_ids, want_mask = expected(tokenizer, history + final)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask
    assert "</think>" not in tokenizer.decode(ids[mask == 1]) or with_reasoning


def test_chat_mask_from_generation_tags_matches_prefix_rendering():
    tagged = render_chat(tiny_tokenizer(GENERATION_TEMPLATE), CONVERSATION)
    plain_template = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain = render_chat(tiny_tokenizer(plain_template), CONVERSATION)
    assert tagged[0].tolist() == plain[0].tolist()
    assert tagged[1].tolist() == plain[1].tolist()
    assert 0 < tagged[1].sum() < len(tagged[1])


# Renders OpenAI tool calls and tool results the way chat templates of this family do.
TOOL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}{{- '<tool_call>' + call.function.name + '(' + call.function.arguments + ')</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>tool\n<tool_response>' + m.content + '</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_openai_tool_calls_tool_results_and_content_parts():
    """An assistant turn that only calls a tool (content null), the tool's result, and content given as parts:
    the calls and the final answer are supervised, the tool's result and the prompt are not."""
    from producer.data.chat import validate_messages

    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Oslo?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "rain"},
            {"role": "assistant", "content": [{"type": "text", "text": "It rains."}]},
        ]
    }
    tokenizer = tiny_tokenizer(TOOL_TEMPLATE)
    ids, mask = render_chat(tokenizer, validate_messages(record))
    want_ids, want_mask = expected(
        tokenizer,
        [
            ("<|im_start|>user\nweather in Oslo?<|im_end|>\n<|im_start|>assistant\n", 0),
            ('<tool_call>weather({"city": "Oslo"})</tool_call><|im_end|>\n', 1),
            ("<|im_start|>tool\n<tool_response>rain</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
            ("It rains.<|im_end|>\n", 1),
        ],
    )
    assert ids.tolist() == want_ids and mask.tolist() == want_mask


def test_sharegpt_records_are_rendered_like_openai_ones():
    from producer.data.chat import validate_messages

    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "hi there"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "add 2+2"},
            {"from": "gpt", "value": "4"},
        ]
    }
    openai = {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION]}
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    got = render_chat(tokenizer, validate_messages(sharegpt))
    want = render_chat(tokenizer, validate_messages(openai))
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist() and got[1].sum() > 0


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"prompt": "a", "completion": "b"}, "unknown_format"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "wrong_type"),
        ({"conversations": [{"from": "human"}]}, "missing_key"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                    {"role": "assistant", "content": "a cat"},
                ]
            },
            "unsupported_content",
        ),
    ],
)
def test_records_that_fit_neither_form_get_a_clear_reason(record, reason):
    from producer.data.chat import validate_messages
    from producer.data.files import BadRecord

    with pytest.raises(BadRecord) as error:
        validate_messages(record)
    assert error.value.reason == reason


def write_lines(path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_chat_source_skips_and_reports_bad_lines(tmp_path, caplog):
    good = json.dumps({"messages": CONVERSATION})
    lines = [
        good,
        "{not json",
        json.dumps({"text": "no messages key"}),
        json.dumps({"messages": [{"role": "user", "content": 3}]}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
        good,
    ]
    path = write_lines(tmp_path / "chat.jsonl", lines)
    config = DataConfig(format="chat", paths=[path], max_seq_len=4096)
    source = build_data_source(config, tokenizer=tiny_tokenizer(PLAIN_TEMPLATE))
    with caplog.at_level(logging.WARNING, logger="producer.data"):
        documents = [source.get(i) for i in range(len(source))]

    assert len(source) == len(lines)
    assert [d is not None for d in documents] == [True, False, False, False, False, False, True]
    assert documents[0].input_ids.tolist() == documents[6].input_ids.tolist()
    assert documents[6].sample_id == 6
    assert source.stats.bad == {
        "invalid_json": 1,
        "unknown_format": 1,
        "wrong_type": 1,
        "empty": 1,
        "no_loss_tokens": 1,
    }
    assert "(OpenAI) or" in caplog.text and "(ShareGPT)" in caplog.text, (
        "the message says what a record should look like"
    )
    assert source.stats.documents == 2
    for line_number in (2, 3, 4, 5, 6):
        assert f"chat.jsonl:{line_number} " in caplog.text
    # Re-reading (replay, next epoch) neither recounts nor re-logs.
    caplog.clear()
    source.get(1)
    assert sum(source.stats.bad.values()) == 5 and caplog.text == ""


def test_tokenized_jsonl_across_files_with_length_policy(tmp_path):
    first = write_lines(
        tmp_path / "a.jsonl",
        [
            json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}),
            json.dumps({"input_ids": [4, 5]}),  # loss_mask defaults to all ones
            json.dumps({"input_ids": [1, 2], "loss_mask": [1]}),  # length mismatch
            json.dumps({"input_ids": ["a", "b"]}),  # wrong type
            json.dumps({"input_ids": [1, 99]}),  # outside the vocab
        ],
    )
    second = tmp_path / "b.jsonl"
    second.write_text(json.dumps({"input_ids": list(range(10)), "loss_mask": [0] * 8 + [1, 1]}))  # no final newline
    config = DataConfig(format="tokenized", paths=[first, str(second)], max_seq_len=6, vocab_size=50)
    source = build_data_source(config)

    assert len(source) == 6
    assert source.get(0).loss_mask.tolist() == [0, 1, 1]
    assert source.get(1).loss_mask.tolist() == [1, 1]
    assert source.get(1).input_ids.dtype == np.int32 and source.get(1).loss_mask.dtype == np.uint8
    assert [source.get(i) for i in (2, 3, 4)] == [None, None, None]
    assert source.location(5).endswith("b.jsonl:1")
    # Truncated to max_seq_len=6 the last record has no loss tokens left.
    assert source.get(5) is None
    assert source.stats.bad == {"bad_value": 2, "wrong_type": 1, "no_loss_tokens": 1}

    dropping = build_data_source(DataConfig(format="tokenized", paths=[str(second)], max_seq_len=6, too_long="drop"))
    assert dropping.get(0) is None and dropping.stats.bad == {"too_long": 1}
    keeping = build_data_source(DataConfig(format="tokenized", paths=[str(second)], max_seq_len=9))
    assert keeping.get(0).input_ids.tolist() == list(range(9)) and keeping.stats.truncated == 1


def test_random_access_by_line_offsets(tmp_path):
    records = [{"input_ids": list(range(i % 7 + 1))} for i in range(200)]
    path = write_lines(tmp_path / "r.jsonl", [json.dumps(r) for r in records])
    offsets = index_line_offsets(path, chunk_bytes=64)  # chunk edges inside lines
    assert len(offsets) == 201 and offsets[-1] == (tmp_path / "r.jsonl").stat().st_size
    source = build_data_source(DataConfig(format="tokenized", paths=[path]))
    for i in np.random.default_rng(0).permutation(200):
        assert source.get(int(i)).input_ids.tolist() == records[i]["input_ids"]


def test_tokenized_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "input_ids": [[1, 2, 3], [4, 5], None, [6]],
            "loss_mask": [[0, 1, 1], None, None, [1]],
        }
    )
    path = str(tmp_path / "t.parquet")
    pq.write_table(table, path, row_group_size=2)
    source = build_data_source(DataConfig(format="tokenized", paths=[path]))
    assert len(source) == 4
    assert source.get(0).loss_mask.tolist() == [0, 1, 1]
    assert source.get(1).loss_mask.tolist() == [1, 1]
    assert source.get(2) is None and source.stats.bad == {"missing_key": 1}
    assert source.get(3).input_ids.tolist() == [6]


def test_parquet_without_pyarrow_names_the_fix(tmp_path, monkeypatch):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        build_data_source(DataConfig(format="tokenized", paths=[str(path)]))


def synthetic(**overrides) -> DataConfig:
    return DataConfig(**{"format": "synthetic", "vocab_size": 1000, "num_samples": 2000, **overrides})


def test_synthetic_is_a_pure_function_of_seed_and_id():
    a, b = build_data_source(synthetic()), build_data_source(synthetic())
    for i in (5, 1999, 0, 5, 731):
        assert np.array_equal(a.get(i).input_ids, b.get(i).input_ids)
    reversed_order = {i: b.get(i).input_ids.tolist() for i in reversed(range(50))}
    assert all(a.get(i).input_ids.tolist() == reversed_order[i] for i in range(50))
    other_seed = build_data_source(synthetic(seed=1))
    assert a.get(5).input_ids.tolist() != other_seed.get(5).input_ids.tolist()
    assert a.get(5).input_ids.max() < 1000 and a.get(5).input_ids.min() >= 0


def test_synthetic_length_mix():
    source = build_data_source(synthetic(mean_len=1000, min_len=32, max_seq_len=3072))
    lengths = np.asarray([len(source.get(i)) for i in range(len(source))])
    assert 900 < lengths.mean() < 1100
    assert lengths.min() >= 32 and lengths.max() <= 3072
    assert (lengths < 300).mean() > 0.05 and (lengths > 2000).mean() > 0.05  # a real spread, not a constant

    fixed = build_data_source(synthetic(length_mode="fixed", mean_len=256, num_samples=20))
    assert {len(fixed.get(i)) for i in range(20)} == {256}


def test_synthetic_tokens_are_predictable_from_context():
    document = build_data_source(synthetic()).get(3)
    tokens = document.input_ids.astype(np.int64)
    predictable = 0
    for t in range(8, len(tokens)):
        progression = tokens[t] == (2 * tokens[t - 1] - tokens[t - 2]) % 1000
        copy = any(tokens[t] == tokens[t - period] for period in range(2, 9))
        predictable += bool(progression or copy)
    assert predictable / (len(tokens) - 8) > 0.85
    assert document.loss_mask[0] == 0 and document.loss_mask[-1] == 1


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"format": "csv"}, "format"),
        ({"format": "chat"}, "paths"),
        ({"format": "synthetic", "vocab_size": 10, "max_seq_len": 0}, "max_seq_len"),
        ({"format": "synthetic", "vocab_size": 10, "too_long": "cut"}, "too_long"),
        ({"format": "synthetic", "vocab_size": 10, "mean_len": 5000}, "mean_len"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DataConfig(**kwargs)


def test_synthetic_source_needs_a_vocabulary_size():
    with pytest.raises(ValueError, match="data.vocab_size"):
        build_data_source(DataConfig(format="synthetic"))


def counting_reads(source) -> list[int]:
    """The sample ids ``source`` reads from its records from now on (a list that grows)."""
    reads, read = [], source._read

    def counted(sample_id):
        reads.append(sample_id)
        return read(sample_id)

    source._read = counted
    return reads


def test_later_epochs_read_no_record_again_and_get_the_same_documents(tmp_path):
    good = json.dumps({"messages": CONVERSATION})
    path = write_lines(tmp_path / "chat.jsonl", [good, "{not json", good, good])
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    kept = build_data_source(DataConfig(format="chat", paths=[path], max_seq_len=4096), tokenizer=tokenizer)
    uncached = build_data_source(
        DataConfig(format="chat", paths=[path], max_seq_len=4096, cache_mb=0), tokenizer=tokenizer
    )
    reads, reads_uncached = counting_reads(kept), counting_reads(uncached)
    for _epoch in range(3):
        for i in range(len(kept)):
            a, b = kept.get(i), uncached.get(i)
            assert (a is None) == (b is None) and (a is None or a.input_ids.tolist() == b.input_ids.tolist())
    assert sorted(reads) == [0, 1, 2, 3], "each record read and rendered once, the bad one too"
    assert len(reads_uncached) == 12
    assert kept.stats.documents == 3 and kept.stats.bad == {"invalid_json": 1}
    assert kept.cache.as_dict()["cache_documents"] == 4 and kept.cache.hits == 8


def test_the_cache_keeps_the_first_documents_up_to_its_budget_and_reads_the_rest_each_time():
    source = build_data_source(
        synthetic(length_mode="fixed", mean_len=1000, max_seq_len=1000, num_samples=600, cache_mb=1)
    )
    reads = counting_reads(source)
    per_document = 1000 * 5 + 200  # int32 ids, uint8 mask, the cache's reckoning of Python's overhead
    fits = 2**20 // per_document
    for _epoch in range(2):
        for i in range(len(source)):
            source.get(i)
    assert source.cache.kept_bytes <= 2**20 and source.cache.as_dict()["cache_documents"] == fits
    assert len(reads) == 600 + (600 - fits), "the kept ones are not read again, the others are"
    assert set(range(fits)).isdisjoint(reads[600:])


@pytest.mark.parametrize("template", [PLAIN_TEMPLATE, THINKING_TEMPLATE, QWEN35_TEMPLATE, GENERATION_TEMPLATE])
def test_a_window_rendered_and_tokenized_together_gives_the_documents_of_one_at_a_time(tmp_path, template):
    conversations = [
        CONVERSATION,
        CONVERSATION[:2],
        [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "x " * 40}],
    ]
    lines = [json.dumps({"messages": c}) for c in conversations]
    lines[1:1] = ["{not json", json.dumps({"messages": [{"role": "user", "content": "only a question"}]})]
    path = write_lines(tmp_path / "chat.jsonl", lines)
    tokenizer = tiny_tokenizer(template)
    together = build_data_source(DataConfig(format="chat", paths=[path], max_seq_len=4096), tokenizer=tokenizer)
    alone = build_data_source(
        DataConfig(format="chat", paths=[path], max_seq_len=4096, cache_mb=0), tokenizer=tokenizer
    )
    reads_alone = counting_reads(alone)
    together.prefetch(list(range(len(lines))))
    assert len(together._rendered) == (0 if template is GENERATION_TEMPLATE else len(lines))
    for i in range(len(lines)):
        a, b = together.get(i), alone.get(i)
        assert (a is None) == (b is None), f"line {i + 1}"
        if a is not None:
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    assert together.stats.as_dict() == alone.stats.as_dict() and together.stats.first_bad == alone.stats.first_bad
    assert not together._rendered, "the window is taken whole, nothing left behind"
    assert len(reads_alone) == len(lines)

"""Multi-turn on-policy data (synthesize.turns = "all", magpie_turns, max_conversation_tokens): the target writes
every assistant turn of a record in order, its tool calls included, a conversation whose call changed ends after
that call, bad records are counted skips naming file:line, and synthesis and regeneration write the same
conversations, each exactly once through a kill -9."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from producer.conversation import Conversation
from producer.data.chat import check_turn_order
from producer.data.files import BadRecord
from tests.real_model import run_killing_once, smollm2_folder, smollm2_gguf
from tests.test_data_sources import PLAIN_TEMPLATE, TOOL_TEMPLATE, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = str(ROOT / "launch" / "run_all.sh")

# Renders tools and tool calls as Qwen's and Hermes' templates do: a call is a JSON object in <tool_call> tags, its
# result goes back in a user turn.
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\nTools: ' }}{%- for t in tools %}{{- t.function.name + ' ' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}{%- set f = call.function %}"
    "{%- if m.content or not loop.first %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Llama 3.1 writes a call as a bare JSON object with "parameters".
BARE_JSON_TOOL_TEMPLATE = QWEN_TOOL_TEMPLATE.replace(
    "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}",
    "{{- '{\"name\": \"' + f.name + '\", \"parameters\": ' }}",
).replace("{{- '}\n</tool_call>' }}", "{{- '}' }}")

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
]


def weather_call(city: str, call_id: str = "c1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "weather", "arguments": json.dumps({"city": city})}}


def tool_conversation(city: str, answer: str, tomorrow: str) -> list[dict]:
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [weather_call(city)]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": tomorrow},
    ]


def plain_conversation(hello: str, goodbye: str) -> list[dict]:
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": hello},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": goodbye},
    ]


# What the tiny target learns by heart: its own answers, which differ from the records' (written by "somebody else").
TARGET_TOOL_CONVERSATION = tool_conversation("Oslo", "It rains in Oslo.", "Sun tomorrow.")
TARGET_PLAIN_CONVERSATION = plain_conversation("Hello!", "Goodbye!")


@pytest.fixture(scope="module")
def tool_target(tmp_path_factory) -> Path:
    """A tiny Qwen3 with a tool-rendering template that has learnt two conversations by heart (its greedy turns are
    known), saved with its tokenizer as a target folder. About 5 s of training on one CPU thread."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("tool-target")
    tokenizer = tiny_tokenizer(QWEN_TOOL_TEMPLATE)
    texts = [
        tokenizer.apply_chat_template(TARGET_TOOL_CONVERSATION, tools=WEATHER_TOOLS, tokenize=False),
        tokenizer.apply_chat_template(TARGET_PLAIN_CONVERSATION, tokenize=False),
    ]
    sequences = [torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]]) for text in texts]
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer) + 1,  # a spare row: the drafter's mask token
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(400):
        loss = sum(model(ids, labels=ids).loss for ids in sequences)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.04:  # every token after the first predicted: greedy decoding reproduces both
            break
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_records(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


RECORDS = [
    # 1: the recorded call is the target's: every turn is written anew, the tool result kept.
    {"messages": tool_conversation("Oslo", "Recorded: wet.", "Recorded: dry."), "tools": WEATHER_TOOLS},
    # 2: the recorded call asks for another city: the target's call differs, the conversation ends after it.
    {"messages": tool_conversation("Bergen", "Recorded: wet.", "Recorded: dry."), "tools": WEATHER_TOOLS},
    # 3: two user turns in a row.
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]},
    # 4: a tool result that answers no call.
    {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "tool", "tool_call_id": "c9", "content": "rain"},
        ]
    },
    # 5: two plain turns.
    {"messages": plain_conversation("Recorded: hello.", "Recorded: goodbye.")},
]


def tiny_synthesis(run_dir: Path, target: Path, data: Path, *extra: str) -> list[str]:
    return [
        RUN_ALL,
        "synthesize",
        "--run-dir",
        str(run_dir),
        f"target.path={json.dumps(str(target))}",
        "target.config_overrides={}",
        'data.format="chat"',
        f"data.paths={json.dumps([str(data)])}",
        'synthesize.turns="all"',
        "synthesize.rows=4",
        "synthesize.max_new_tokens=80",
        "synthesize.max_prompt_tokens=512",
        'launch.producer_devices=["cpu"]',
        'launch.trainer_devices=["cpu"]',
        *extra,
    ]


def check(target: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``run_all.sh check --json`` of chat data for the tiny target (one drafter layer: it has two)."""
    command = [RUN_ALL, "check", f"target.path={target}", "target.config_overrides={}", "drafter.num_layers=1"]
    checked = subprocess.run(
        [*command, 'data.format="chat"', *overrides, "--json"], capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0, checked.stderr
    return checked


def shard_records(folder: Path, pattern: str = "*.jsonl") -> dict[str, dict]:
    return {
        record["id"]: record
        for path in folder.glob(pattern)
        for record in map(json.loads, path.read_text().splitlines())
    }


def test_turn_order_and_tool_results_are_checked_naming_the_message():
    check_turn_order([{"role": "system", "content": "s"}, *TARGET_PLAIN_CONVERSATION])
    check_turn_order(TARGET_TOOL_CONVERSATION)
    calls_without_ids = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "a", "arguments": "{}"}},
                {"function": {"name": "b", "arguments": {}}},
            ],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]
    check_turn_order(calls_without_ids)  # results answer the calls in order
    bad = {
        "messages[1]: two user turns in a row": RECORDS[2]["messages"],
        "messages[0]: the conversation starts with an assistant turn": [{"role": "assistant", "content": "a"}],
        "messages[2]: two assistant turns in a row": [
            *TARGET_PLAIN_CONVERSATION[:2],
            {"role": "assistant", "content": "x"},
        ],
        "messages[2]: a tool result with no tool call before it": RECORDS[3]["messages"],
        "messages[2]: tool_call_id 'c9' answers the calls of messages[1]": [
            *TARGET_TOOL_CONVERSATION[:2],
            {"role": "tool", "tool_call_id": "c9", "content": "rain"},
        ],
        "messages[4]: more results than the calls of messages[1]": [
            *calls_without_ids[:4],
            {"role": "tool", "content": "3"},
        ],
        "messages[3]: a user turn follows tool results no assistant turn reads": [
            *TARGET_TOOL_CONVERSATION[:3],
            {"role": "user", "content": "?"},
        ],
    }
    for message, messages in bad.items():
        with pytest.raises(BadRecord, match=message.replace("[", r"\[").replace("]", r"\]")) as raised:
            check_turn_order(messages)
        assert raised.value.reason in ("turn_order", "tool_result_without_call")


def test_tool_calls_are_read_back_in_the_form_the_template_writes_them():
    from producer.conversation import parse_tool_calls, same_calls, tool_call_format

    qwen = tool_call_format(tiny_tokenizer(QWEN_TOOL_TEMPLATE), {})
    bare = tool_call_format(tiny_tokenizer(BARE_JSON_TOOL_TEMPLATE), {})
    assert qwen is not None and qwen.opener == "<tool_call>"
    assert bare is not None and bare.opener == ""
    # No call rendered at all, or not as a JSON object: nothing to read a call back with.
    assert tool_call_format(tiny_tokenizer(PLAIN_TEMPLATE), {}) is None
    assert tool_call_format(tiny_tokenizer(TOOL_TEMPLATE), {}) is None

    two_calls = (
        'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": "{}"}\n</tool_call>'
    )
    content, calls = parse_tool_calls(two_calls, qwen)
    assert content == "Checking."
    assert calls == [{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}, {"name": "time", "arguments": "{}"}]
    recorded = [
        {"id": "t", "name": "time", "arguments": {}},
        {"id": "w", "name": "weather", "arguments": '{"days":2, "city":"Oslo"}'},
    ]
    assert same_calls(calls, recorded)  # by JSON value, in any order
    assert not same_calls(calls, [recorded[0], {**recorded[1], "arguments": '{"city": "Bergen", "days": 2}'}])
    assert not same_calls(calls, [recorded[0], {**recorded[1], "name": "forecast"}])
    assert not same_calls([], recorded[:1]) and not same_calls(calls[:1], [])
    # JSON in an answer is no call without the opener; a call inside the reasoning is not made.
    assert parse_tool_calls('Use {"name": "x", "arguments": {}} like this.', qwen)[1] == []
    thought = '<think>maybe <tool_call>{"name": "x", "arguments": {}}</tool_call></think>\n\nNo tool needed.'
    assert parse_tool_calls(thought, qwen) == (thought, [])
    content, calls = parse_tool_calls('{"name": "weather", "parameters": {"city": "Oslo"}}', bare)
    assert content == "" and calls == [{"name": "weather", "arguments": {"city": "Oslo"}}]


def test_check_says_no_record_is_skipped_without_an_empty_list():
    """check's turns = "all" line where every sampled record can be written: the count, and no empty reasons."""
    import numpy as np

    from launch.check import conversations

    class Records:
        def read_json(self, sample_id: int) -> dict:
            return {"messages": TARGET_PLAIN_CONVERSATION}

        def location(self, sample_id: int) -> str:
            return f"data.jsonl:{sample_id + 1}"

    cfg = load_config(None, ['synthesize.turns="all"'])
    lines, figures = conversations(cfg, Records(), np.arange(2), tiny_tokenizer(QWEN_TOOL_TEMPLATE))
    assert figures["turns_all_skipped"] == {}
    assert (
        'synthesize.turns = "all": of the 2 sampled, 0 cannot be written turn by turn and are skipped; 0 of '
        in (lines[0])
    )


def test_smollm2s_template_writes_no_tool_call_so_its_tool_records_are_skipped():
    from transformers import AutoTokenizer

    from producer.conversation import conversation_script, tool_call_format

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    assert tool_call_format(tokenizer, {}) is None
    with pytest.raises(BadRecord, match="tool_calls_not_rendered"):
        conversation_script(RECORDS[0], "all", None)
    assert len(conversation_script(RECORDS[4], "all", None)) == 4
    assert conversation_script(RECORDS[0], "last", None) == RECORDS[0]["messages"][:5]  # today's: up to the last user


def test_synthesis_writes_every_turn_cuts_where_a_call_changed_and_regeneration_writes_the_same(short_tmp, tool_target):
    data = write_records(short_tmp / "chat.jsonl", RECORDS)
    run_dir = short_tmp / "run"
    started = time.monotonic()
    done = subprocess.run(tiny_synthesis(run_dir, tool_target, data), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = run_dir / "synthesized"
    written, skipped = shard_records(folder), shard_records(folder, "*.skipped")

    # 1: every assistant turn is the target's own (what it learnt, not the record's), the tool result the record's.
    whole = written["data:0"]
    assert whole["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [weather_call("Oslo")]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "content": "It rains in Oslo."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Sun tomorrow."},
    ]
    generation = whole["generation"]
    assert whole["tools"] == WEATHER_TOOLS and "cut" not in generation and generation["turns"] == "all"
    assert [(t["role"], t["stop_reason"]) for t in generation["per_turn"]] == [("assistant", "stop")] * 3
    assert generation["new_tokens"] == sum(t["new_tokens"] for t in generation["per_turn"]) > 30
    # 2: the target asks for Oslo where the record asks for Bergen: the record's result no longer answers it.
    cut = written["data:1"]
    assert cut["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{**weather_call("Oslo"), "id": "call_0_0"}]},
    ]
    assert cut["generation"]["cut"] == {
        "reason": "tool_call_changed",
        "after_turn": 1,
        "of_turns": 3,
        "detail": 'the target called weather({"city":"Oslo"}) where the record calls weather({"city":"Bergen"})',
    }
    # 3, 4: counted skips naming file:line.
    assert skipped["data:2"] == {
        "id": "data:2",
        "skipped": "turn_order: messages[1]: two user turns in a row",
        "source": f"{data}:3",
    }
    assert skipped["data:3"]["skipped"].startswith("tool_result_without_call: messages[2]")
    assert skipped["data:3"]["source"] == f"{data}:4"
    # 5: both answers the target's own.
    assert written["data:4"]["messages"] == TARGET_PLAIN_CONVERSATION
    assert written["data:4"]["generation"]["per_turn"][1]["stop_reason"] == "stop"

    status = json.loads((folder / "status-p0.json").read_text())
    assert status["skipped"] == {"turn_order": 1, "tool_result_without_call": 1}
    assert status["cut"] == {"tool_call_changed": 1} and status["cut_after_turn"] == {"1": 1}
    assert f"{data}:3 turn_order: messages[1]: two user turns in a row" in status["first_skipped"]
    out = done.stdout + done.stderr
    assert "3 records in" in out and "2 prompts skipped: " in out, out[-2000:]
    assert "1 conversations end early (tool_call_changed 1; after assistant turn 1: 1)" in out, out[-2000:]
    assert time.monotonic() - started < 120

    # check, on the shards: how many conversations were cut, why and where; on the data: the records it skips.
    checked = check(tool_target, f"data.paths={json.dumps([str(folder / '*.jsonl')])}")
    assert (
        "conversations cut short by the target: 1 of the 3 sampled (tool_call_changed 1; after assistant turn 1: 1)"
        in checked.stdout
    )
    figures = json.loads(checked.stdout.strip().splitlines()[-1])
    assert figures["cut"] == {"tool_call_changed": 1} and figures["cut_after_turn"] == {"1": 1}
    (where,) = figures["cut_records"]
    assert where.startswith(str(folder / "p0-")) and " tool_call_changed after assistant turn 1 of 3: " in where
    checked = check(tool_target, f"data.paths={json.dumps([str(data)])}", 'synthesize.turns="all"')
    assert (
        "cannot be written turn by turn and are skipped (turn_order 1, tool_result_without_call 1); 2 of the others"
        in checked.stdout
    )
    assert "2 of the others call tools (the template writes a call as JSON after '<tool_call>')" in checked.stdout
    assert f"  skipped {data}:3 turn_order: messages[1]: two user turns in a row" in checked.stdout

    # data.regenerate goes the same way: the same conversations, kept by file:line, the cut counted in its stats.
    regenerated = regenerate_in_process(tool_target, data, short_tmp / "regenerated")
    for i in (0, 1, 4):
        assert regenerated[f"{data}:{i + 1}"]["messages"] == written[f"data:{i}"]["messages"]
        assert regenerated[f"{data}:{i + 1}"]["generation"].get("cut") == written[f"data:{i}"]["generation"].get("cut")
    assert regenerated[f"{data}:3"]["skipped"] == skipped["data:2"]["skipped"]


def regenerate_in_process(target: Path, data: Path, folder: Path) -> dict[str, dict]:
    """What data.regenerate keeps for every record of ``data`` (a RegeneratedSource over the chat records)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producer.data.build import build_data_source
    from producer.regenerate import RegeneratedSource

    cfg = load_config(
        None,
        [
            'data.format="chat"',
            f"data.paths={json.dumps([str(data)])}",
            "data.regenerate=true",
            'synthesize.turns="all"',
            "synthesize.rows=4",
            "synthesize.max_new_tokens=80",
            "synthesize.max_prompt_tokens=512",
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    records = build_data_source(cfg.data, tokenizer=tokenizer)
    source = RegeneratedSource(records, model, tokenizer, cfg, folder, 0)
    source.prefetch(list(range(len(source))))
    documents = [source.get(i) for i in range(len(source))]
    assert [d is not None for d in documents] == [True, True, False, False, True]
    assert source.stats.as_dict()["cut_by_reason"] == {"tool_call_changed": 1}
    assert source.stats.bad == Counter({"not_regenerated": 2})
    return shard_records(folder) | shard_records(folder, "*.skipped")


def write_in_process(target: Path, record: dict, turns: str, cap: int = 0) -> Conversation:
    """The conversation the tiny target writes from ``record`` (the writer synthesis and regeneration share)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producer.conversation import ConversationWriter, record_conversation, tool_call_format
    from producer.target_model.generation import GenerationConfig
    from producer.target_model.generator import Generator

    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    config = GenerationConfig(
        max_new_tokens=80, rows=2, max_prompt_tokens=512, stop_token_ids=(tokenizer.eos_token_id,)
    )
    tool_format = tool_call_format(tokenizer, {})
    writer = ConversationWriter(
        tokenizer, {}, Generator(model, config), tool_format=tool_format, max_conversation_tokens=cap
    )
    (done,) = writer.run([record_conversation("key", record, turns, tool_format)], lambda: False)
    return done


def test_a_conversation_ends_after_the_turn_that_reaches_max_conversation_tokens(tool_target):
    whole = write_in_process(tool_target, RECORDS[4], "all")
    assert whole.messages == TARGET_PLAIN_CONVERSATION and whole.cut is None
    first = whole.turns[0]["new_tokens"]  # "Hello!" and the end of turn
    assert first == 7
    assert write_in_process(tool_target, RECORDS[4], "all", cap=first + 1).cut is None  # the last turn may pass it
    capped = write_in_process(tool_target, RECORDS[4], "all", cap=first)
    assert capped.messages == TARGET_PLAIN_CONVERSATION[:2]
    assert capped.cut == {
        "reason": "max_conversation_tokens",
        "after_turn": 1,
        "of_turns": 2,
        "detail": "7 new tokens reached the cap 7",
    }


def test_turns_last_keeps_the_earlier_turns_as_recorded_and_answers_the_last_user_turn(tool_target):
    plain = write_in_process(tool_target, RECORDS[4], "last")
    assert plain.messages[:3] == RECORDS[4]["messages"][:3]  # "Recorded: hello." stays
    assert plain.messages[3]["role"] == "assistant" and plain.messages[3]["content"] != "Recorded: goodbye."
    assert len(plain.messages) == 4 and len(plain.turns) == 1 and plain.cut is None
    # The recorded call and its result are context; the tool definitions are rendered into the prompt.
    tools = write_in_process(tool_target, RECORDS[1], "last")
    assert tools.messages[:5] == RECORDS[1]["messages"][:5] and len(tools.turns) == 1
    assert tools.tools == WEATHER_TOOLS and "tool_calls" not in tools.messages[5]  # its text as written


@pytest.mark.reference
def test_every_conversation_is_written_once_through_a_kill_9_with_smollm2(short_tmp):
    """SmolLM2 writes every assistant turn of three-turn records and two-turn self-written conversations (its own
    follow-up user turn included); a kill -9 of the producer mid-run loses only conversations in flight."""
    smollm2_folder()
    data = short_tmp / "chat.jsonl"
    with open(data, "w") as f:
        for i in range(1, 11):
            turns = [(f"What is {i} plus {i}?", "x"), ("And times two?", "y"), ("Thanks!", "z")]
            messages = [
                m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    run_dir = short_tmp / "run"
    folder = run_dir / "synthesized"
    command = [
        RUN_ALL,
        "synthesize",
        "--run-dir",
        str(run_dir),
        "--config",
        str(ROOT / "launch" / "smollm2-135m.toml"),
        f"target.path={json.dumps(str(smollm2_gguf()))}",
        "target.dtype=float32",
        'synthesize.prompts="both"',
        f"data.paths={json.dumps([str(data)])}",
        'synthesize.turns="all"',
        "synthesize.num_magpie=4",
        "synthesize.magpie_turns=2",
        "synthesize.rows=4",
        "synthesize.max_new_tokens=6",
        "synthesize.magpie_max_tokens=8",
        "synthesize.max_prompt_tokens=256",
        "synthesize.records_per_shard=2",
        "synthesize.flush_every_s=0.5",
        'launch.producer_devices=["cpu"]',
        'launch.trainer_devices=["cpu"]',
        "launch.mps=false",
        "launch.restart_backoff_s=0.2",
    ]
    out = run_killing_once(command, folder, f"producer.synthesize --run-dir {run_dir}")
    assert "synth0 crashed (killed by SIGKILL), restarting in" in out and "it continues from its shards" in out
    ids: Counter = Counter()
    for path in [*folder.glob("*.jsonl"), *folder.glob("*.skipped")]:
        ids.update(json.loads(line)["id"] for line in path.read_text().splitlines())
    assert set(ids) == {f"data:{i}" for i in range(10)} | {f"magpie:{i}" for i in range(4)}
    assert max(ids.values()) == 1, ids  # none twice
    records = shard_records(folder)
    for i in range(10):
        messages = records[f"data:{i}"]["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        assert [m["content"] for m in messages[::2]] == [f"What is {i + 1} plus {i + 1}?", "And times two?", "Thanks!"]
        assert all(m["content"] not in ("x", "y", "z") for m in messages[1::2])  # every answer the target's own
        assert [t["role"] for t in records[f"data:{i}"]["generation"]["per_turn"]] == ["assistant"] * 3
    for i in range(4):
        record = records[f"magpie:{i}"]
        assert [m["role"] for m in record["messages"]] == ["user", "assistant"] * 2
        assert [t["role"] for t in record["generation"]["per_turn"]] == ["user", "assistant"] * 2
        assert record["generation"]["magpie_turns"] == 2
    log = (run_dir / "logs" / "synth0.log").read_text()
    assert "done before" in log.split("==== synth0 start 2")[1]


def test_data_without_a_record_to_write_stops_the_run_naming_the_file(tmp_path):
    from producer.data.files import DataError
    from producer.synthesize import all_prompts

    data = write_records(tmp_path / "chat.jsonl", [RECORDS[2], RECORDS[3]])
    cfg = load_config(None, ['data.format="chat"', f"data.paths={json.dumps([str(data)])}", 'synthesize.turns="all"'])
    with pytest.raises(
        DataError, match=rf"data.paths: no chat record to write .* \(2 skipped; first: {data}:1 turn_order"
    ):
        all_prompts(cfg)
    write_records(data, [RECORDS[2], RECORDS[4]])
    prompts = all_prompts(cfg)
    assert [p.skipped is None for p in prompts] == [False, True] and prompts[0].source == f"{data}:1"


def test_conversation_settings_are_validated_naming_the_key():
    assert load_config(None).synthesize.turns == "last"
    with pytest.raises(ConfigError, match=r"synthesize.turns: must be one of \['last', 'all'\]"):
        load_config(None, ['synthesize.turns="some"'])
    with pytest.raises(ConfigError, match="synthesize.magpie_turns: must be >= 1, got 0"):
        load_config(None, ["synthesize.magpie_turns=0"])
    with pytest.raises(ConfigError, match="synthesize.max_conversation_tokens: must be >= 0"):
        load_config(None, ["synthesize.max_conversation_tokens=-1"])

"""Chat data as users hold it: each layout (OpenAI, ShareGPT, UltraChat, LMSYS-Chat) in each container (JSONL, Parquet, a
datasets save_to_disk folder, a DatasetDict folder, a hub snapshot of Parquet shards) gives the documents of the same
conversations in OpenAI-layout JSONL; columns named in the config; a layout nothing reads stops at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.config import DataConfig, load_config
from common.rundir import RunDir, read_json
from producer.data.build import build_data_source
from producer.data.files import DataError
from tests.drafter_fixtures import tiny_qwen3_target
from tests.test_data_sources import PLAIN_TEMPLATE, tiny_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[1]

# Renders the record's tools, tool calls (arguments as JSON), and the keys a template tests with ``is defined``
# (tool_call_id, name): a table's null for a key a message lacks would render, or fail, here.
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\n' + m.content }}"
    "{%- for call in m.tool_calls or [] %}"
    "{{- '<tool_call>' + call.function.name + ' ' + (call.function.arguments | tojson) }}"
    "{%- if call.id is defined %}{{- ' #' + call.id }}{%- endif %}{{- '</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role }}"
    "{%- if m.name is defined %}{{- ' (' + m.name + ')' }}{%- endif %}"
    "{%- if m.tool_call_id is defined %}{{- ' for ' + m.tool_call_id }}{%- endif %}"
    "{{- '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def chats(n: int = 5) -> list[list[dict]]:
    """Plain conversations of user and assistant turns, n of them, of different lengths."""
    conversations = []
    for i in range(n):
        turns = []
        for t in range(1 + i % 3):
            turns += [
                {"role": "user", "content": f"question {i}.{t}?"},
                {"role": "assistant", "content": f"a{i}" * (t + 1)},
            ]
        conversations.append(turns)
    return conversations


def openai_layout() -> tuple[list[dict], list[dict]]:
    """(records in the layout, the same conversations as OpenAI JSONL records): everything the layout carries, tool
    calls with and without an id, tool results naming them or not, a speaker's name, tools, a system prompt."""
    records = [{"messages": c} for c in chats()]
    records[1] = {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Oslo?", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                    },
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Bergen"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": "rain"},
            {"role": "tool", "content": "sun"},
            {"role": "assistant", "content": "It rains."},
        ],
        "tools": TOOLS,
    }
    return records, records


def sharegpt_layout() -> tuple[list[dict], list[dict]]:
    """ShareGPT with the speakers of its variants: system, human, gpt, function_call, observation, and tools as the
    JSON text LLaMA-Factory keeps them in."""
    speaker = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    records = [{"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in c]} for c in chats()]
    openai = [{"messages": c} for c in chats()]
    call = {"name": "weather", "arguments": {"city": "Oslo"}}
    records[1] = {
        "conversations": [
            {"from": "system", "value": "Use tools."},
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": "rain"},
            {"from": "gpt", "value": "It rains."},
        ],
        "tools": json.dumps(TOOLS),
    }
    openai[1] = {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "It rains."},
        ],
        "tools": TOOLS,
    }
    return records, openai


def ultrachat_200k_layout() -> tuple[list[dict], list[dict]]:
    """HuggingFaceH4/ultrachat_200k: OpenAI messages beside the first prompt and its id."""
    records = [{"prompt": c[0]["content"], "prompt_id": f"{i:064x}", "messages": c} for i, c in enumerate(chats())]
    return records, [{"messages": c} for c in chats()]


def ultrachat_layout() -> tuple[list[dict], list[dict]]:
    """stingning/ultrachat: ``data``, the turns as strings, user and assistant in turn."""
    records = [{"id": str(i), "data": [m["content"] for m in c]} for i, c in enumerate(chats())]
    return records, [{"messages": c} for c in chats()]


def lmsys_layout() -> tuple[list[dict], list[dict]]:
    """lmsys/lmsys-chat-1m: OpenAI messages under ``conversation``, beside the model and language."""
    records = [
        {"conversation_id": str(i), "model": "m", "conversation": c, "language": "English"}
        for i, c in enumerate(chats())
    ]
    return records, [{"messages": c} for c in chats()]


LAYOUTS = {
    "openai": openai_layout,
    "sharegpt": sharegpt_layout,
    "ultrachat_200k": ultrachat_200k_layout,
    "ultrachat": ultrachat_layout,
    "lmsys": lmsys_layout,
}


# -- the containers, written as the tools users hold them from write them ------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def table_of(records: list[dict]):
    """The records as a table whose columns are every key any record has (null where a record lacks it)."""
    keys = dict.fromkeys(key for record in records for key in record)
    return pa.table({key: [record.get(key) for record in records] for key in keys})


def write_parquet(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table_of(records), path, row_group_size=2)  # several row groups
    return path


def features_of(arrow_type) -> dict:
    """datasets' features (dataset_info.json, the schema's metadata) of an Arrow type."""
    if pa.types.is_struct(arrow_type):
        return {f.name: features_of(f.type) for f in arrow_type}
    if pa.types.is_list(arrow_type):
        return {"feature": features_of(arrow_type.value_type), "_type": "List"}
    return {"dtype": {"double": "float64"}.get(str(arrow_type), str(arrow_type)), "_type": "Value"}


def save_to_disk(folder: Path, records: list[dict], num_shards: int = 2) -> Path:
    """What ``Dataset.save_to_disk`` writes (huggingface/datasets arrow_dataset.py): contiguous shards as Arrow IPC
    streams ``data-0000i-of-0000N.arrow`` (the features in the schema's metadata), ``state.json`` listing them and
    ``dataset_info.json`` with the features."""
    table = table_of(records)
    features = {f.name: features_of(f.type) for f in table.schema}
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    folder.mkdir(parents=True)
    names, start = [], 0
    for shard in range(num_shards):
        size = len(records) // num_shards + (shard < len(records) % num_shards)
        names.append(f"data-{shard:05d}-of-{num_shards:05d}.arrow")
        with pa.ipc.new_stream(str(folder / names[-1]), table.schema) as writer:
            writer.write_table(table.slice(start, size), max_chunksize=2)  # several record batches
        start += size
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return folder


def save_dict_to_disk(folder: Path, splits: dict[str, list[dict]]) -> Path:
    """What ``DatasetDict.save_to_disk`` writes: ``dataset_dict.json`` naming the splits, one Dataset folder each."""
    folder.mkdir(parents=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    for name, records in splits.items():
        save_to_disk(folder / name, records, num_shards=1)
    return folder


def hub_snapshot(folder: Path, splits: dict[str, list[dict]], shards: int = 2) -> Path:
    """A dataset repository as downloaded: ``data/<split>-0000i-of-0000N.parquet`` and a README."""
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n---\n")
    for name, records in splits.items():
        count = shards if len(records) >= shards else 1
        for shard in range(count):
            part = records[shard * len(records) // count : (shard + 1) * len(records) // count]
            write_parquet(folder / "data" / f"{name}-{shard:05d}-of-{count:05d}.parquet", part)
    return folder


OTHER = [{"messages": [{"role": "user", "content": "another split"}, {"role": "assistant", "content": "no"}]}]


def write_container(kind: str, folder: Path, records: list[dict]) -> Path:
    """``records`` in a container of ``kind``; a DatasetDict or hub snapshot has another split beside "train"."""
    folder.mkdir(exist_ok=True)
    if kind == "jsonl":
        return write_jsonl(folder / "chat.jsonl", records)
    if kind == "parquet":
        return write_parquet(folder / "chat.parquet", records)
    if kind == "arrow_folder":
        return save_to_disk(folder / "saved", records)
    if kind == "dataset_dict":
        return save_dict_to_disk(folder / "saved_dict", {"test": OTHER * 3, "train": records})
    assert kind == "hub_parquet"
    return hub_snapshot(folder / "snapshot", {"train": records, "test": OTHER})


CONTAINERS = ["jsonl", "parquet", "arrow_folder", "dataset_dict", "hub_parquet"]


def documents(path: Path, tokenizer, **keys) -> list:
    source = build_data_source(DataConfig(format="chat", paths=[str(path)], max_seq_len=4096, **keys), tokenizer)
    return [source.get(i) for i in range(len(source))]


def assert_same_documents(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a is not None and b is not None, f"record {i}"
        assert a.input_ids.tolist() == b.input_ids.tolist(), f"record {i}"
        assert a.loss_mask.tolist() == b.loss_mask.tolist() and a.loss_mask.sum() > 0, f"record {i}"


@pytest.mark.parametrize("container", CONTAINERS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_in_every_container_gives_the_documents_of_openai_jsonl(tmp_path, layout, container):
    records, openai = LAYOUTS[layout]()
    tokenizer = tiny_tokenizer(TEMPLATE)
    want = documents(write_jsonl(tmp_path / "openai.jsonl", openai), tokenizer)
    got = documents(write_container(container, tmp_path / "held", records), tokenizer)
    assert_same_documents(got, want)
    if layout in ("openai", "sharegpt"):  # the tool-calling record: its call, id and tools are all rendered
        text = tokenizer.decode(got[1].input_ids)
        assert 'Tools: [{"type": "function"' in text and '<tool_call>weather {"city": "Oslo"}' in text
        assert (" #call_7</tool_call>" in text) == (layout == "openai") and "None" not in text
        assert (text.count("</tool_call>"), text.count(" for call_7\n")) == ((2, 1) if layout == "openai" else (1, 0))


def test_keys_named_in_the_config_read_renamed_columns(tmp_path):
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    speakers = {"user": "Person", "assistant": "BOT"}
    renamed = [{"dialog": [{"speaker": speakers[m["role"]], "text": m["content"]} for m in c]} for c in chats()]
    keys = {
        "messages_key": "dialog",
        "role_key": "speaker",
        "content_key": "text",
        "role_names": {"person": "user", "bot": "assistant"},
    }
    want = documents(write_jsonl(tmp_path / "openai.jsonl", [{"messages": c} for c in chats()]), tokenizer)
    for path in (
        write_jsonl(tmp_path / "renamed.jsonl", renamed),
        write_parquet(tmp_path / "renamed.parquet", renamed),
    ):
        assert_same_documents(documents(path, tokenizer, **keys), want)
        with pytest.raises(DataError, match=r"keys are \['dialog'\].*data\.messages_key"):
            documents(path, tokenizer)  # found by itself it is none of the known keys
        with pytest.raises(
            DataError, match=r"have the keys \['speaker', 'text'\]: data\.role_key and data\.content_key"
        ):
            documents(path, tokenizer, messages_key="dialog")
        # The keys found, but a speaker no table maps: each record is bad, saying which key maps it.
        source = build_data_source(
            DataConfig(format="chat", paths=[str(path)], messages_key="dialog", role_key="speaker", content_key="text"),
            tokenizer,
        )
        assert source.get(0) is None and source.stats.bad == {"wrong_type": 1}
        assert "unknown speaker 'Person' (data.role_names maps it to a role)" in source.stats.first_bad[0]


@pytest.mark.parametrize("container", ["jsonl", "parquet", "arrow_folder"])
def test_a_layout_nothing_reads_stops_at_start_naming_the_keys_found(tmp_path, container):
    records = [{"prompt": "2+2?", "completion": "4"}] * 3
    path = write_container(container, tmp_path, records)
    with pytest.raises(DataError) as error:
        documents(path, tiny_tokenizer(PLAIN_TEMPLATE))
    message = str(error.value)
    assert message.startswith("data.paths: ") and "whose keys are ['completion', 'prompt']" in message
    assert "data.messages_key names the one that holds the messages" in message


def test_a_json_array_is_named_as_one_not_read_as_bad_lines(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}]}], indent=2))
    with pytest.raises(DataError, match="is one JSON array of records, not JSON lines"):
        documents(path, tiny_tokenizer(PLAIN_TEMPLATE))


def test_the_split_of_a_folder(tmp_path):
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    records = [{"messages": c} for c in chats()]
    want = documents(write_jsonl(tmp_path / "openai.jsonl", records), tokenizer)
    # ultrachat_200k's splits: none is "train", so data.split must name one
    saved = save_dict_to_disk(tmp_path / "saved", {"train_sft": records, "test_sft": OTHER})
    hub = hub_snapshot(tmp_path / "hub", {"train_sft": records, "test_sft": OTHER})
    for folder in (saved, hub):
        with pytest.raises(DataError, match=r"^data\.split: .* has the splits .*train_sft.*: data\.split names"):
            documents(folder, tokenizer)
        assert_same_documents(documents(folder, tokenizer, split="train_sft"), want)
        assert len(documents(folder, tokenizer, split="test_sft")) == 1
        with pytest.raises(DataError, match=r"^data\.split: 'dev' is not a split of"):
            documents(folder, tokenizer, split="dev")
    # Files named by a split's word, as datasets' loader reads them: the test file is not trained on.
    words = tmp_path / "words"
    words.mkdir()
    write_jsonl(words / "train.jsonl", records)
    write_jsonl(words / "test.jsonl", OTHER)
    assert_same_documents(documents(words, tokenizer), want)
    # A folder of files with no split in their names is one split.
    plain = tmp_path / "plain"
    write_parquet(plain / "part-a.parquet", records[:2])
    write_parquet(plain / "part-b.parquet", records[2:])
    (plain / "dataset_infos.json").write_text(json.dumps({"default": {"features": {}}}, indent=2))  # not data
    assert_same_documents(documents(plain, tokenizer), want)


def test_rows_are_read_at_random_and_a_row_group_is_decoded_once(tmp_path, monkeypatch):
    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(40)
    ]
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    want = documents(write_jsonl(tmp_path / "openai.jsonl", records), tokenizer)
    decoded = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, i, **kw: decoded.append(i) or read_row_group(self, i, **kw)
    )
    for path in (write_parquet(tmp_path / "chat.parquet", records), save_to_disk(tmp_path / "saved", records, 3)):
        source = build_data_source(
            DataConfig(format="chat", paths=[str(path)], max_seq_len=4096, cache_mb=0), tokenizer
        )
        order = np.random.default_rng(0).permutation(len(records)).tolist()
        for _epoch in range(2):
            for i in order:
                assert source.get(i).input_ids.tolist() == want[i].input_ids.tolist()
    # 20 row groups of two rows: row group 0 once at start (all columns, the layout check), then each once
    assert sorted(decoded) == [0, *range(20)]


def test_arrow_ipc_in_the_file_format_is_read_too(tmp_path):
    records = [{"messages": c} for c in chats()]
    path = tmp_path / "chat.arrow"
    table = table_of(records)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    tokenizer = tiny_tokenizer(PLAIN_TEMPLATE)
    want = documents(write_jsonl(tmp_path / "openai.jsonl", records), tokenizer)
    assert_same_documents(documents(path, tokenizer), want)


def test_without_pyarrow_a_parquet_or_arrow_path_names_the_install(tmp_path, monkeypatch):
    records = [{"messages": c} for c in chats()]
    paths = [write_parquet(tmp_path / "chat.parquet", records), save_to_disk(tmp_path / "saved", records)]
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    for path in paths:
        with pytest.raises(
            DataError, match=r"needs pyarrow: pip install pyarrow \(or pip install 'dflash-stream\[parquet\]'\)"
        ):
            documents(path, tiny_tokenizer(PLAIN_TEMPLATE))


@pytest.mark.parametrize(
    "keys, field",
    [
        ({"messages_key": ""}, "messages_key"),
        ({"role_names": {"bot": "robot"}}, "role_names"),
        ({"format": "tokenized", "split": "train"}, "split"),
    ],
)
def test_the_layout_keys_are_validated_naming_the_key(keys, field):
    with pytest.raises(ValueError, match=field):
        DataConfig(**{"format": "chat", "paths": ["x.jsonl"], **keys})


def test_synthesis_reads_its_prompts_through_the_same_reader(tmp_path):
    """The prompts of ``synthesize.prompts = "data"`` from a save_to_disk folder of ShareGPT records are those of the
    OpenAI JSONL of the same conversations, each named by its file and row."""
    from producer.synthesize import data_prompts

    records, openai = sharegpt_layout()
    folder = save_to_disk(tmp_path / "saved", records)
    jsonl = write_jsonl(tmp_path / "openai.jsonl", openai)

    def prompts(path: Path) -> list:
        return data_prompts(load_config(None, ['data.format="chat"', f"data.paths={json.dumps([str(path)])}"]))

    got, want = prompts(folder), prompts(jsonl)
    assert [(p.id, p.messages, p.tools, p.skipped) for p in got] == [
        (p.id, p.messages, p.tools, p.skipped) for p in want
    ]
    assert got[1].tools and got[1].messages[-1] == {"role": "user", "content": "Weather in Oslo?"}
    assert got[0].source == f"{folder}/data-00000-of-00002.arrow:row 0" and got[4].source.endswith("00002.arrow:row 1")


def check_command(target: Path, *overrides: str) -> list[str]:
    return [
        str(ROOT / "launch" / "run_all.sh"),
        "check",
        f"target.path={target}",
        "target.config_overrides={}",
        'data.format="chat"',
        "eval.every_steps=0",
        *overrides,
        "--json",
    ]


def test_check_and_a_run_read_a_parquet_file_and_a_sharegpt_file(short_tmp):
    """``run_all.sh check`` says what each path is read as and renders them like any chat data; a run trains on
    them with real producers and trainer; a Parquet file of an unknown layout stops check with exit 2 naming its
    columns."""
    from tests.test_pipeline import finish, start

    target = short_tmp / "target"
    tiny_qwen3_target(target, vocab_size=512)
    tiny_tokenizer(PLAIN_TEMPLATE).save_pretrained(target)
    conversations = chats(40)
    parquet = write_parquet(short_tmp / "openai.parquet", [{"messages": c} for c in conversations[:20]])
    sharegpt = write_jsonl(
        short_tmp / "sharegpt.jsonl",
        [
            {"conversations": [{"from": {"user": "human"}.get(m["role"], "gpt"), "value": m["content"]} for m in c]}
            for c in conversations[20:]
        ],
    )
    paths = f"data.paths={json.dumps([str(parquet), str(sharegpt)])}"
    done = subprocess.run(check_command(target, paths), cwd=short_tmp, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out, figures = done.stdout.rsplit("\n", 2)[0], json.loads(done.stdout.strip().splitlines()[-1])
    assert "data: 36 records in chat format; sampled 36: 36 good, 0 bad" in out, out  # 4 held out
    assert f"  from {parquet}: Parquet; conversations in 'messages', messages {{'role', 'content'}}" in out
    assert f"  from {sharegpt}: JSONL; conversations in 'conversations', messages {{'from', 'value'}}" in out
    assert f"sample 0 ({parquet}:row 0)" in out and "[[a0<|im_end|>\n]]" in out, (
        "a rendered sample, its answer supervised"
    )
    assert figures["good"] == 36 and figures["bad"] == {} and len(figures["read_as"]) == 2

    unknown = write_parquet(short_tmp / "unknown.parquet", [{"text": "2+2=4"}] * 4)
    stopped = subprocess.run(
        check_command(target, f"data.paths={json.dumps([str(unknown)])}"),
        cwd=short_tmp,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stopped.returncode == 2
    assert f"error: data.paths: {unknown}: no conversation in its records, whose keys are ['text']" in stopped.stderr

    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        f"target.path={target}",
        "target.config_overrides={}",
        'data.format="chat"',
        paths,
        "training.max_steps=4",
        "eval.every_steps=0",
        "launch.num_producers=1",
        'launch.producer_devices=["cpu"]',
    )
    finish(launcher, run_dir, timeout=240)
    run = RunDir(run_dir)
    assert read_json(run.trainer_status)["step"] == 4
    data = read_json(run.producer_status(0))["data"]
    assert data["documents"] > 0 and data["bad_records"] == 0, data

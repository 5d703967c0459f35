"""The served check's own arithmetic and its refusals (launch/bench/served), fast and without a server: the common
schedule, the naming of the first difference, a target split told apart from a drafter's fault, llama-server's trace
and Prometheus counters read right, and every "cannot run" ending in one line and exit 2. The servers themselves run in
tests/test_served_llamacpp.py and tests/test_served_vllm.py (``pytest -m served``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.bench.served import __main__ as cli
from launch.bench.served.llamacpp import EOG_HEADER, EOG_LINE, STEP_LINE, LlamaServer
from launch.bench.served.measure import difference, parse_metrics, spec_counters
from launch.bench.served.schedule import (
    PromptRun,
    Side,
    compare,
    counts_of,
    failures,
    lengths_of,
    scheduled_counts,
    steps_in_answer,
    tau_of,
    zlab_tau_of,
)


def test_counts_are_the_servers_per_position_counters():
    # Four verify forwards that accepted 2, 0, 3 and 1 drafts of a block of 4 (3 drafted tokens each).
    counts = counts_of([2, 0, 3, 1], block_size=4)
    assert counts == {"drafts": 4, "draft_tokens": 12, "accepted_per_pos": [3, 2, 1]}
    assert tau_of(counts) == 1 + 6 / 4


def test_one_schedule_cuts_each_side_at_the_answers_end():
    # 7 answer tokens: the prefill's token, then steps adding 3, 1 and (cut) 2 of the 4 the last block accepted.
    ours = PromptRun(tokens=[5, 6, 7, 8, 9, 10, 11], accepted=[2, 0, 3])
    assert lengths_of(ours) == [3, 1, 2]
    # A side that ran further (a server given B - 1 more tokens) has steps past the answer: left out.
    further = PromptRun(tokens=ours.tokens, accepted=[2, 0, 3, 3, 1])
    assert lengths_of(further) == [3, 1, 2] and steps_in_answer(further) == [2, 0, 3]
    # llama.cpp stops accepting at the end token: its last step counts 1, not 3; on the schedule it is the same.
    stopped = PromptRun(tokens=ours.tokens, accepted=[2, 0, 1])
    assert lengths_of(stopped) == lengths_of(ours)
    assert zlab_tau_of([[3, 1, 2], [2]]) == (2 + 2) / 2


def side(name: str, runs: list[tuple[list[int], list[int] | None]], reported=None) -> Side:
    return Side(name, [PromptRun(t, a) for t, a in runs], block_size=4, reported=reported)


def test_identical_sides_agree():
    ours = side("evaluator", [([1, 2, 3, 4, 5], [1, 2]), ([7, 8], [3])])
    assert compare(ours, side("llama.cpp", [([1, 2, 3, 4, 5], [1, 2, 0]), ([7, 8], [1])])) == []


def test_the_first_differing_step_is_named():
    ours = side("evaluator", [([1, 2, 3, 4, 5], [1, 2]), ([1, 2, 3, 4, 5, 6, 7], [1, 0, 2])])
    other = side("llama.cpp", [([1, 2, 3, 4, 5], [1, 2]), ([1, 2, 3, 4, 5, 6, 7], [1, 1, 1])])
    (found,) = compare(ours, other)
    assert (found.prompt, found.what, found.step, found.position) == (1, "steps", 1, 3)
    assert "prompt 1, step 1, token 3" in found.describe() and failures([found]) == [found]


def test_a_near_tie_of_the_target_is_a_split_not_a_fault():
    ours = side("evaluator", [([1, 2, 3, 4, 5, 6], [1, 1, 0])])
    other = side("llama.cpp", [([1, 2, 3, 9, 9, 9], [1, 2])])  # the target chose 9 at token 3
    (split,) = compare(ours, other, margin_at=lambda p, t: 0.004, tie_margin=0.01)
    assert split.what == "tokens" and split.position == 3 and split.target_split
    assert failures([split]) == [] and "near-tie" in split.describe() and "0.00400" in split.describe()
    # the same split where the target's choice was clear: a fault, named with its margin
    (fault,) = compare(ours, other, margin_at=lambda p, t: 2.5, tie_margin=0.01)
    assert not fault.target_split and failures([fault]) == [fault] and "no tie" in fault.describe()


def test_the_table_reads_each_side_as_it_counts_and_on_the_schedule():
    from launch.bench.served.schedule import table

    ours = side("evaluator", [([1, 2, 3, 4, 5], [1, 3])])  # the last block whole: 3 accepted, 1 of them in the answer
    llama = side("llama.cpp", [([1, 2, 3, 4, 5], [1, 2])])  # stopped accepting at the end token
    vllm = side("vLLM", [([1, 2, 3, 4, 5], None)], reported=counts_of([1, 3], 4))
    text = table([llama, ours, vllm], ours, {"llama.cpp": compare(ours, llama), "vLLM": compare(ours, vllm)})
    rows = {line[:34].strip(): line[34:].split() for line in text.splitlines()[1:]}
    assert rows["accepted drafts, as run"] == ["3", "4", "4"] and rows["accepted drafts, schedule"] == ["2", "2", "-"]
    assert rows["agrees"] == ["yes", "-", "yes"] and rows["accepted at position 3, as run"] == ["0", "1", "1"]
    from launch.bench.served.check import per_prompt_lines

    assert (
        per_prompt_lines([llama, ours, vllm], ours)
        .splitlines()[1]
        .endswith("2 verify forwards,    2 accepted drafts; all equal")
    )
    other = side("llama.cpp", [([1, 2, 3, 9, 9], [1, 2])])
    assert per_prompt_lines([other, ours], ours).splitlines()[1].endswith("differ: llama.cpp")


def test_a_side_with_counters_only_is_compared_by_them():
    ours = side("evaluator", [([1, 2, 3, 4, 5], [1, 2])])
    same = side("vLLM", [([1, 2, 3, 4, 5], None)], reported=counts_of([1, 2], 4))
    assert compare(ours, same) == []
    shifted = side("vLLM", [([1, 2, 3, 4, 5], None)], reported=counts_of([1, 1], 4))
    (found,) = compare(ours, shifted)
    assert found.what == "counters" and "accepted_per_pos" in found.detail


def test_llama_server_trace_lines_are_read():
    assert STEP_LINE.search("0.01.2 I slot   operator(): id  0 | task 3 | accepted  5/15 draft tokens").groups()[
        :2
    ] == (
        "5",
        "15",
    )
    restored = STEP_LINE.search("slot operator(): id 0 | task 3 | accepted 2/ 7 draft tokens (restore checkpoint)")
    assert restored.group(3) is not None
    log = f"0.1 I load: {EOG_HEADER}\n0.1 I load:   - 0 ('<|endoftext|>')\n0.1 I load:   - 2 ('<|im_end|>')\n0.1 I x"
    assert [int(EOG_LINE.search(line).group(1)) for line in log.splitlines()[1:3]] == [0, 2]
    # level 5 repeats each forward's acceptance in a debug line: not a second step
    assert (
        STEP_LINE.search("0.5 D slot operator(): id 0 | task 0 | accepted 7/7 draft tokens, new n_tokens = 48") is None
    )


def test_a_block_cut_to_no_draft_is_a_step_of_the_trace(tmp_path):
    """With a confidence cut llama-server logs at level 5: a block the cut left without a draft is decoded as a plain
    token ("slot decode token"), a verify forward of 0 of 0 drafts; the debug copy of each acceptance is no step."""
    server = LlamaServer(Path("llama-server"), Path("t.gguf"), Path("d.gguf"), 8, tmp_path / "log", p_min=0.5)
    assert server.command[server.command.index("--spec-draft-p-min") + 1] == "0.5"
    assert server.command[server.command.index("-lv") + 1] == "5"
    lines = [
        "0.1 D slot handle_last_: id  0 | task 0 | generate_draft: id=0, #tokens=20, #draft=3, pos_next=20",
        "0.2 I slot   operator(): id  0 | task 0 | accepted  2/ 3 draft tokens",
        "0.2 D slot   operator(): id  0 | task 0 | accepted 2/3 draft tokens, new n_tokens = 23",
        "0.3 D slot handle_last_: id  0 | task 0 | slot decode token, id=0, n_ctx = 512, n_tokens = 23, truncated = 0",
        "0.4 I slot   operator(): id  0 | task 0 | accepted  7/ 7 draft tokens",
        "0.5 I slot print_timing: id  0 | task 0 | ",
        "       total time =      12.00 ms /    12 tokens",
    ]
    server.log_file.write_text("\n".join(lines) + "\n")
    assert server._steps_since(0) == ([2, 0, 7], [3, 0, 7])
    plain = LlamaServer(Path("llama-server"), Path("t.gguf"), Path("d.gguf"), 8, tmp_path / "log")
    assert plain.command[plain.command.index("-lv") + 1] == "4" and "--spec-type" not in plain.command


def test_a_block_cut_elsewhere_is_a_difference_even_where_the_acceptance_is_the_same():
    """Where both sides say how many drafts each verify forward verified (a confidence cut), those counts are
    compared too, and the pooled drafted tokens are theirs, not B - 1 a forward."""
    ours = Side("evaluator", [PromptRun([1, 2, 3, 4, 5, 6], [1, 0, 2], [3, 0, 2])], block_size=4)
    same = Side("llama.cpp", [PromptRun([1, 2, 3, 4, 5, 6], [1, 0, 2, 3], [3, 0, 2, 3])], block_size=4)
    assert compare(ours, same) == []
    assert ours.as_run()["draft_tokens"] == 5 and scheduled_counts(ours)["draft_tokens"] == 5
    cut_later = Side("llama.cpp", [PromptRun([1, 2, 3, 4, 5, 6], [1, 0, 2], [3, 1, 2])], block_size=4)
    (found,) = compare(ours, cut_later)
    assert (found.what, found.step, found.position) == ("steps", 1, 3)
    assert "evaluator verified 0 drafts, llama.cpp 1" in found.describe()
    # a side that does not say (z-lab's decoder) is compared by its acceptances alone
    assert compare(ours, Side("z-lab", [PromptRun([1, 2, 3, 4, 5, 6], [1, 0, 2])], block_size=4)) == []
    # where the confidence of the first draft they disagree on lies at the cut, a near-tie of the cut: named, no fault
    asked = []

    def at_the_cut(prompt, position, draft):
        asked.append((prompt, position, draft))
        return 2e-6

    (tie,) = compare(ours, cut_later, cut_margin_at=at_the_cut)
    assert asked == [(0, 3, 0)] and tie.cut_tie and failures([tie]) == [] and "near-tie of the cut" in tie.describe()
    (fault,) = compare(ours, cut_later, cut_margin_at=lambda p, t, d: 0.2)
    assert not fault.cut_tie and failures([fault]) == [fault] and "2.00e-01 from the cut: no tie" in fault.describe()


LLAMACPP_METRICS = """# HELP llamacpp:spec_decode_num_drafts_total x
llamacpp:spec_decode_num_drafts_total 10
llamacpp:spec_decode_num_draft_tokens_total 70
llamacpp:spec_decode_num_accepted_tokens_total 12
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8
"""
VLLM_METRICS = """vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
"""
SGLANG_METRICS = """sglang:spec_verify_calls_total{model_name="m"} 20
sglang:generation_tokens_total{model_name="m"} 64
sglang:spec_accept_length{model_name="m"} 3.1
"""


def test_each_servers_counters_are_read_alike():
    llama = spec_counters(parse_metrics(LLAMACPP_METRICS))
    assert llama == {"drafts": 10, "draft_tokens": 70, "accepted": 12, "accepted_per_pos": [8, 4]}
    vllm = spec_counters(parse_metrics(VLLM_METRICS))
    assert vllm["drafts"] == 3 and vllm["accepted_per_pos"] == [3, 2]
    sglang = spec_counters(parse_metrics(SGLANG_METRICS))
    assert sglang["drafts"] == 20 and sglang["generated"] == 64
    later = spec_counters(parse_metrics(LLAMACPP_METRICS.replace(" 10\n", " 25\n").replace(' 8\n', " 18\n")))
    assert difference(later, llama)["drafts"] == 15 and difference(later, llama)["accepted_per_pos"] == [10, 0]


def test_prompt_formats(tmp_path):
    from transformers import AutoTokenizer

    from launch.bench.served.prompts import read_prompts
    from tests.real_model import smollm2_folder

    folder = smollm2_folder()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            [
                json.dumps(
                    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "dropped"}]}
                ),
                json.dumps({"prompt": "Once upon a time"}),
                json.dumps({"prompt_token_ids": [1, 2, 3]}),
                "a line of text",
            ]
        )
        + "\n"
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = read_prompts(prompts, folder, None)
    assert ids[0] == tokenizer(chat, add_special_tokens=False)["input_ids"]
    assert ids[1:] == [tokenizer("Once upon a time")["input_ids"], [1, 2, 3], tokenizer("a line of text")["input_ids"]]
    assert read_prompts(prompts, folder, 2) == ids[:2]


def write_export(folder: Path, kind: str = "dflash", block_size: int = 8, speculators: bool = False) -> Path:
    """A config.json alone: the refusals come before any weight is read."""
    folder.mkdir(parents=True)
    architecture = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[kind]
    config = {"architectures": [architecture], "block_size": block_size, "dflash_config": {}}
    if speculators:
        config = {"speculators_model_type": kind, "architectures": ["DFlashSpeculator"], "block_size": block_size}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def check_argv(tmp_path: Path, server: str, export: dict | None = None) -> list[str]:
    """A served check's command line over a target with an empty config, one prompt and an export's config."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    draft = write_export(tmp_path / "draft", **(export or {}))
    return ["--server", server, "--target", str(target), "--draft", str(draft), "--prompts", str(prompts)]


@pytest.mark.parametrize(
    "server, export, extra, says",
    [
        ("vllm", {"kind": "dflash2"}, [], "vLLM's CPU build does not serve dflash2"),
        (
            "llamacpp",
            {"block_size": 8},
            ["--block-size", "16"],
            "--block-size 16 contradicts the export's block_size 8",
        ),
        ("llamacpp", {"speculators": True}, [], "z-lab format only"),
        ("vllm", {}, ["--confidence-min", "1.5"], "--confidence-min must lie in [0, 1]"),
    ],
)
def test_what_cannot_run_is_one_line_and_exit_2(tmp_path, capsys, server, export, extra, says):
    assert cli.main(check_argv(tmp_path, server, export) + extra) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_gguf_export_given_to_the_check_says_what_to_give(tmp_path, capsys):
    """The check converts the drafter itself: a GGUF export's folder is named for what it is, with what to give."""
    argv = check_argv(tmp_path, "llamacpp")
    draft = Path(argv[argv.index("--draft") + 1])
    (draft / "config.json").unlink()
    (draft / "draft.gguf").write_bytes(b"GGUF")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--draft {draft}: a GGUF export" in err and "z-lab export or its checkpoint" in err


def test_without_a_llamacpp_build_it_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    from common.llamacpp import HOME_ENV

    monkeypatch.setenv(HOME_ENV, str(tmp_path / "nowhere"))
    assert cli.main(check_argv(tmp_path, "llamacpp")) == 2 and "run launch/setup_llamacpp.sh" in capsys.readouterr().err
    from trainer.export import main as export_main

    checkpoint = tmp_path / "step-1"
    write_export(checkpoint / "drafter")
    code = export_main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "d-gguf"), "--format", "gguf"])
    assert code == 2 and "--target" in capsys.readouterr().err


def test_without_the_vllm_venv_it_says_how_to_make_it(tmp_path, monkeypatch, capsys):
    from launch.bench.served import vllm_worker

    monkeypatch.setattr(vllm_worker, "VLLM_PYTHON", tmp_path / "no-venv" / "python")
    assert cli.main(check_argv(tmp_path, "vllm")) == 2 and "launch/setup_vllm.sh" in capsys.readouterr().err


def test_measure_needs_one_prompt_source(capsys):
    assert cli.main(["--url", "http://127.0.0.1:9"]) == 2
    assert "--prompts or --run-dir" in capsys.readouterr().err


def test_a_server_without_metrics_is_named_with_the_flag_that_serves_them(tmp_path, capsys):
    """A running server without /metrics (llama-server without --metrics answers 501 Not Implemented): --url exits 2,
    as the check does where it cannot run, in one line naming the cause and the flag; a server that is down: 2 too."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class WithoutMetrics(BaseHTTPRequestHandler):
        def do_GET(self):  # as llama-server started without --metrics
            if self.path == "/metrics":
                self.send_error(501, "Not Implemented", "This server does not support metrics endpoint.")
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps({"data": [{"id": "target.gguf"}]}).encode())

        def log_message(self, *args):
            pass

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2]}) + "\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), WithoutMetrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert cli.main(["--url", url, "--prompts", str(prompts)]) == 2
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"{url}: /metrics answered 501 Not Implemented" in err and "llama-server --metrics" in err, err
    assert cli.main(["--url", url, "--prompts", str(prompts)]) == 2, "the server down: nothing measured, exit 2"
    assert "Connection refused" in capsys.readouterr().err


def test_a_dequantized_target_folder_names_a_tokenizer_class_transformers_4_reads(tmp_path):
    """llama.cpp's converter runs transformers 4.x, which does not know transformers 5's "TokenizersBackend": the
    dequantized folder names "PreTrainedTokenizerFast" (which 5.x reads as the same class), and a folder written
    before is rewritten when it is next asked for."""
    from transformers import AutoTokenizer

    from common.gguf import PORTABLE_TOKENIZER_CLASS, portable_tokenizer_config
    from tests.real_model import smollm2_folder

    folder = smollm2_folder()
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (old / name).write_bytes((folder / name).read_bytes())
    settings = json.loads((old / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps({**settings, "tokenizer_class": "TokenizersBackend"}))
    portable_tokenizer_config(old)
    assert json.loads((old / "tokenizer_config.json").read_text())["tokenizer_class"] == PORTABLE_TOKENIZER_CLASS
    tokenizer, original = AutoTokenizer.from_pretrained(old), AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer("hello world")["input_ids"] == original("hello world")["input_ids"]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(chat, tokenize=False)


def test_a_dflash2_drafter_llamacpp_cannot_load_is_refused_before_export(tmp_path, capsys):
    """llama.cpp refuses a DFlash 2 draft whose hidden size is under selector_top_k * (selector_top_k + 1): the export
    and the served check say so in one line, naming the keys, instead of a server that exits at load."""
    from common.drafter.dflash2 import selector_lattice_refusal
    from common.drafter.export import zlab_config
    from tests.drafter_fixtures import tiny_config
    from trainer.export import main as export_main

    narrow = tiny_config(kind="dflash2", hidden_size=256, num_attention_heads=4, head_dim=64, selector_top_k=16)
    assert "drafter.dflash2.selector_top_k = 15" in selector_lattice_refusal(narrow)
    assert selector_lattice_refusal(tiny_config(kind="dflash2", hidden_size=272, selector_top_k=16)) is None
    from launch.check import _serving_notes  # check says it before a drafter is trained

    assert "selector_top_k = 15" in _serving_notes(narrow) and _serving_notes(tiny_config()) == ""
    checkpoint = tmp_path / "step-1"
    (checkpoint / "drafter").mkdir(parents=True)
    (checkpoint / "drafter" / "config.json").write_text(json.dumps(zlab_config(narrow)))
    argv = ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "d-gguf"), "--format", "gguf", "--target", "x"]
    assert export_main(argv) == 2 and "hidden_size 256 and selector_top_k 16" in capsys.readouterr().err


def test_a_server_that_exits_is_explained_by_its_first_real_error():
    from launch.bench.served.llamacpp import ServerError

    log = "\n".join(
        [
            "0.00.1 I srv load_model: loading model",
            "0.00.2 E llama_init_from_model: dflash requires ctx_other to be set (this warning is normal during fit)",
            "0.00.3 E llama_model_load: error loading model: DFlash2 hidden size is too small for the selector lattice",
            "0.00.4 E srv  llama_server: exiting due to model loading error",
        ]
    )
    error = ServerError("llama-server exited with 1", log)
    assert error.reason == (
        "llama-server exited with 1: llama_model_load: error loading model: DFlash2 hidden size is too small for the "
        "selector lattice"
    )


def test_a_dspark_drafter_reaches_llamacpps_converter_in_speculators_format(tmp_path):
    """llama.cpp's converter reads a DSpark drafter's speculators names and keys (its kind's ``llamacpp_format``): the
    check writes that format from a checkpoint's z-lab drafter/, and takes a speculators export as it is; a DFlash
    drafter goes to the converter as its z-lab export."""
    import torch
    from safetensors.torch import load_file

    from common.drafter.export import export_speculators, export_zlab
    from common.drafter.kinds import kind_of
    from common.drafter.model import build_drafter
    from launch.bench.served import ours
    from launch.bench.served.check import converter_source, kind_and_block
    from tests.drafter_fixtures import random_head, tiny_config

    config = tiny_config(kind="dspark", markov_rank=8)
    drafter = build_drafter(config, random_head(config))
    checkpoint = tmp_path / "step-1"
    export_zlab(drafter, checkpoint / "drafter", dtype=torch.float32)
    config_json = json.loads((checkpoint / "drafter" / "config.json").read_text())
    kind, block = kind_and_block(config_json, "llamacpp", None)
    assert (kind.name, block) == ("dspark", 4)
    source = converter_source(checkpoint, config_json, kind, tmp_path / "target", tmp_path / "scratch")
    written = json.loads((source / "config.json").read_text())
    assert written["speculators_model_type"] == "dspark" and written["markov_rank"] == 8
    assert written["sample_from_anchor"] is False and written["confidence_head_with_markov"] is True
    assert written["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
    weights = load_file(str(source / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= set(weights)
    assert all(t.dtype == torch.float32 for t in weights.values())

    speculators = export_speculators(drafter, tmp_path / "spec", "target", dtype=torch.float32)
    spec_json = json.loads((speculators / "config.json").read_text())
    assert kind_and_block(spec_json, "llamacpp", None)[0].name == "dspark"
    assert converter_source(speculators, spec_json, kind, tmp_path / "target", tmp_path / "s2") == speculators
    dflash = tiny_config()
    zlab = export_zlab(build_drafter(dflash, random_head(dflash)), tmp_path / "dflash", dtype=torch.float32)
    zlab_json = json.loads((zlab / "config.json").read_text())
    assert converter_source(zlab, zlab_json, kind_of("dflash"), tmp_path / "target", tmp_path / "s3") == zlab

    # the confidence cut needs a confidence head; z-lab's decoder has no DSpark class
    with_head = ours.Loaded(None, drafter.eval(), checkpoint / "drafter", 4, 0.0)
    no_head = tiny_config(kind="dspark", markov_rank=8, enable_confidence_head=False)
    without = ours.Loaded(None, build_drafter(no_head, random_head(no_head)).eval(), tmp_path, 4, 0.0)
    plain = ours.Loaded(None, build_drafter(dflash, random_head(dflash)).eval(), zlab, 4, 0.0)
    assert ours.has_confidence(with_head) and not ours.has_confidence(without) and not ours.has_confidence(plain)
    assert not ours.zlab_serves(with_head) and ours.zlab_serves(plain)


def test_the_cut_margin_is_the_nearest_confidence_that_decided_a_block():
    """Our side's distance from the cut to the confidences it compared (up to the first below it): how near a tie
    the cut came."""
    import torch

    from common.drafter.sampling import Proposal
    from launch.bench.served.ours import CutMargin

    class Fixed(torch.nn.Module):
        def propose(self, hidden, anchor_ids, sampling=None, generator=None, context=None):
            return Proposal(tokens=torch.zeros(2, 3, dtype=torch.long), confidence=torch.tensor(
                [[0.9, 0.45, 0.5001], [0.7, 0.8, 0.6]]))  # fmt: skip

    drafter = Fixed()
    with CutMargin(drafter, 0.5) as cut:
        drafter.propose(None, None)
    # row 0 stops at 0.45 (0.05 away; 0.5001 is never compared), row 1 keeps all: 0.6 is 0.1 away
    assert cut.margin == pytest.approx(0.05) and "propose" not in vars(drafter)


def test_llamacpp_builds_on_every_core_under_a_per_process_thread_limit():
    """OMP_NUM_THREADS=1, as this project's processes and CI run, made nproc say 1: llama-server compiled on one
    core, twice the minutes on two."""
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("JOBS", None)
    done = subprocess.run(
        ["bash", "launch/setup_llamacpp.sh", "--jobs"],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(done.stdout) == len(os.sched_getaffinity(0))

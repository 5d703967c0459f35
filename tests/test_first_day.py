"""A user's first day: errors that repeat on every try stop the run at once (exit 2, naming the key or file)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from common.drafter.draft_config import DraftConfig, build_target_layer_ids
from common.status import ProducerStatus
from tests.drafter_fixtures import tiny_qwen3_target
from tests.test_pipeline import ONE_PRODUCER, start


def stops_with_2(run_dir: Path, *overrides: str) -> tuple[str, float]:
    """Start a run that must stop by itself with exit 2 and without a restart: (launcher output and logs, seconds).
    One producer: the launcher's stop of every child on a child's exit 2 is test_launcher.py's."""
    began = time.monotonic()
    launcher = start(run_dir, "training.max_steps=8", "eval.every_steps=0", *ONE_PRODUCER, *overrides)
    code = launcher.wait(timeout=150)
    seconds = time.monotonic() - began
    text = (run_dir.parent / "launcher.out").read_text()
    text += (
        "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))) if (run_dir / "logs").exists() else ""
    )
    assert code == 2, text[-3000:]
    assert "restarting" not in text.lower() and "restart in" not in text.lower(), text[-3000:]
    return text, seconds


def test_a_missing_data_file_stops_the_run(short_tmp):
    text, seconds = stops_with_2(
        short_tmp / "run", 'data.format="tokenized"', 'data.paths=["/nonexistent/train.jsonl"]'
    )
    assert "data.paths: data file not found: '/nonexistent/train.jsonl'" in text
    assert seconds < 60


def test_an_empty_data_file_stops_the_run_naming_it(short_tmp):
    empty = short_tmp / "empty.jsonl"
    empty.write_text("")
    text, _ = stops_with_2(short_tmp / "run", 'data.format="tokenized"', f'data.paths=["{empty}"]')
    assert f"data.paths: {empty} is empty" in text


def test_a_file_without_a_usable_record_stops_the_run_naming_the_first_bad_lines(short_tmp):
    bad = short_tmp / "bad.jsonl"
    bad.write_text(
        "\n".join(
            [json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}), "{not json", json.dumps({"text": "x"})]
        )
        + "\n"
    )
    text, seconds = stops_with_2(
        short_tmp / "run",
        'data.format="tokenized"',
        f'data.paths=["{bad}"]',
        "launch.num_producers=1",
        'launch.producer_devices=["cpu"]',
    )
    assert "no good document" in text and str(bad) in text and f"{bad}:2" in text
    assert seconds < 90


def test_an_unloadable_target_stops_the_run(short_tmp):
    target = short_tmp / "target"
    tiny_qwen3_target(target)
    (target / "model.safetensors").write_bytes(b"not a safetensors file")
    text, _ = stops_with_2(short_tmp / "run", f"target.path={target}", "target.config_overrides={}")
    assert f"target.path: {target} cannot be loaded" in text


def test_a_tokenizer_without_a_spare_id_for_the_mask_stops_the_run_naming_the_key(short_tmp):
    """A Llama-3-like tokenizer that fills the vocabulary and has no reserved special token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = short_tmp / "target"
    tiny_qwen3_target(target, vocab_size=64)
    vocab = {f"t{i}": i for i in range(63)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eot|>")
    assert len(tokenizer) == 64
    tokenizer.save_pretrained(target)
    text, _ = stops_with_2(short_tmp / "run", f"target.path={target}", "target.config_overrides={}")
    assert "drafter.mask_token_id" in text and "trainer: configuration error (exit 2)" in text


def test_mask_token_as_released_drafts_pick_it():
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )

    class Tokenizer:
        def __init__(self, size, added=None, mask=None):
            self.size, self.added, self.mask_token_id = size, added or {}, mask

        def __len__(self):
            return self.size

        def get_added_vocab(self):
            return self.added

    assert DraftConfig.from_target(config, 2, Tokenizer(100, mask=7)).mask_token_id == 7
    assert DraftConfig.from_target(config, 2, Tokenizer(100)).mask_token_id == 100  # a spare row (Qwen)
    llama = Tokenizer(
        128, {"<|begin_of_text|>": 120, "<|reserved_special_token_1|>": 123, "<|reserved_special_token_0|>": 122}
    )
    assert DraftConfig.from_target(config, 2, llama).mask_token_id == 122
    with pytest.raises(ValueError, match="drafter.mask_token_id"):
        DraftConfig.from_target(config, 2, Tokenizer(128, {"<|eot|>": 127}))


def test_default_layers_of_a_small_target_name_the_key():
    with pytest.raises(ValueError, match=r"drafter.target_layer_ids.*gives \[1, 1\]"):
        build_target_layer_ids(4, 2)
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_check_prints_what_training_would_see(tmp_path):
    """``run_all.sh check``: counts of good and bad records with file:line, length statistics, and a rendered
    sample with the supervised tokens marked; no run is started."""
    import subprocess

    from tests.test_data_sources import PLAIN_TEMPLATE, tiny_tokenizer

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "target"
    tiny_qwen3_target(target, vocab_size=512)
    tiny_tokenizer(PLAIN_TEMPLATE).save_pretrained(target)
    data = tmp_path / "train.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]}
    data.write_text("\n".join([json.dumps(good), "{oops", json.dumps({"prompt": "x"}), json.dumps(good)]) + "\n")
    command = [
        str(root / "launch" / "run_all.sh"),
        "check",
        f"target.path={target}",
        "target.config_overrides={}",
        'data.format="chat"',
        f'data.paths=["{data}"]',
        "eval.every_steps=0",
        "--json",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "4 records in chat format; sampled 4: 2 good, 2 bad" in out
    assert f"bad record {data}:2 invalid_json" in out and f"bad record {data}:3 unknown_format" in out
    assert "[[Hello!<|im_end|>\n]]" in out and "<|im_start|>user\nhi<|im_end|>" in out
    figures = json.loads(out.strip().splitlines()[-1])
    assert figures["good"] == 2 and figures["bad"] == {"invalid_json": 1, "unknown_format": 1}
    assert f"mask token {len(tiny_tokenizer(PLAIN_TEMPLATE))}" in out, "the first id past the tokenizer"
    assert not (tmp_path / "runs").exists(), "check starts no run"

    missing = subprocess.run(
        [*command[:-1], 'data.paths=["/nope.jsonl"]'], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "data.paths: data file not found: '/nope.jsonl'" in missing.stderr


def test_check_reads_the_held_out_records_and_lists_every_bad_record_once(tmp_path):
    """Issue 45: check never read the held-out records (a broken line among them went unreported), printed each
    bad record twice (its report and the data's own warning) and listed only the first three."""
    import subprocess

    from common.config import load_config
    from producer.data.held_out import held_out_ids
    from tests.test_data_sources import PLAIN_TEMPLATE, tiny_tokenizer

    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "target"
    tiny_qwen3_target(target, vocab_size=512)
    tiny_tokenizer(PLAIN_TEMPLATE).save_pretrained(target)
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]})
    held = held_out_ids(40, 4, load_config(None).data.shuffle_seed).tolist()
    broken_trained = [i for i in range(40) if i not in held][1:30:6]  # five of the records trained on
    lines = [good] * 40
    for i in [held[1], *broken_trained]:
        lines[i] = "{oops"
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    command = [
        str(root / "launch" / "run_all.sh"),
        "check",
        f"target.path={target}",
        "target.config_overrides={}",
        'data.format="chat"',
        f'data.paths=["{data}"]',
        "eval.every_steps=0",
        "eval.num_prompts=4",
        "--json",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out, figures_line = done.stdout.strip().rsplit("\n", 1)
    assert "36 records in chat format; sampled 36: 31 good, 5 bad" in out, out
    for i in broken_trained:  # each once, none as the data's warning on stderr
        assert (out + done.stderr).count(f"{data}:{i + 1} ") == 1, (i, out, done.stderr)
        assert f"  bad record {data}:{i + 1} invalid_json" in out
    assert "held out for evaluation: 4 records" in out and "read 4: 3 good, 1 bad {'invalid_json': 1}" in out, out
    assert (out + done.stderr).count(f"{data}:{held[1] + 1} ") == 1
    assert f"  bad held-out record {data}:{held[1] + 1} invalid_json" in out
    figures = json.loads(figures_line)
    assert len(figures["first_bad"]) == 5 and figures["held_out_bad"] == {"invalid_json": 1}


def test_a_hub_id_in_the_local_cache_is_a_target_path(tmp_path):
    """target.path = org/name resolves to the model's snapshot in the local Hugging Face cache, as
    huggingface_hub lays it out; one that is not there is a clear error, and nothing is downloaded."""
    import os
    import subprocess

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-qwen3" / "snapshots" / "0123abcd"
    tiny_qwen3_target(snapshot, vocab_size=64)
    (cache / "models--acme--tiny-qwen3" / "refs").mkdir()
    (cache / "models--acme--tiny-qwen3" / "refs" / "main").write_text("0123abcd")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    command = [str(root / "launch" / "run_all.sh"), "check", "--sample", "5", "target.config_overrides={}"]
    found = subprocess.run(
        [*command, "target.path=acme/tiny-qwen3"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert found.returncode == 0, found.stderr
    assert "target qwen3: 6 layers, hidden 32, vocab 64" in found.stdout
    absent = subprocess.run(
        [*command, "target.path=acme/not-downloaded"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert absent.returncode == 2
    assert "target.path: 'acme/not-downloaded' is no folder and is not in the local Hugging Face cache" in absent.stderr


def test_progress_view_shows_only_the_current_trainers_figures(tmp_path):
    """After a restart the old trainer's figures are not the new one's: until the new trainer writes its own
    trainer.json the view says it is starting."""
    from common.rundir import RunDir, atomic_write_json
    from launch.progress import ProgressView

    run = RunDir(tmp_path / "run")
    (run.root / "producers").mkdir(parents=True)
    atomic_write_json(
        run.producer_status(0), {"id": 0, "ring": {"slots": 4, "free": 1, "filling": 0, "ready": 2, "leased": 1}}
    )
    old = {
        "step": 40,
        "max_steps": 100,
        "state": "training",
        "updated": 1000.0,
        "loss": 3.5,
        "tau": 1.7,
        "lr": 1e-3,
        "samples_per_s": 6.0,
        "steps_per_s": 2.0,
        "eval": {"step": 40, "tau": 1.5, "sim_tau": 1.7},
    }
    atomic_write_json(run.trainer_status, old)
    lines = []
    view = ProgressView(run, terminal=False)
    view.write = lines.append
    import builtins

    printed = []
    real_print = builtins.print
    builtins.print = lambda *a, **k: printed.append(" ".join(map(str, a)))
    try:
        view.update(trainer_started_wall=900.0, trainer_alive=True)  # the trainer that wrote it
        view.update(trainer_started_wall=1100.0, trainer_alive=True)  # a new one, still loading
    finally:
        builtins.print = real_print
    assert len(printed) == 1
    line = printed[0]
    assert "step 40/100" in line and "eta 0:30" in line and "elapsed" in line
    for text in ("loss 3.500", "lr 1.0e-03", "tau 1.70", "real 1.50@40", "6.0 samples/s", "ring 3/4"):
        assert text in line, text


def test_metrics_reach_wandb_by_section_and_the_status_is_a_table(short_tmp):
    """A short run: the batching figures the producers send reach metrics.jsonl and wandb, training figures
    are under train/ in wandb, the launcher prints elapsed, ETA, lr, tau and ring occupancy, and status
    prints them as a table (no raw JSON)."""
    import subprocess

    from tests.test_pipeline import finish
    from tests.wandb_log import history

    run_dir = short_tmp / "run"
    # 40 steps, about a second of training here: the figures come with the producers' heartbeats (every 0.25 s),
    # and producer 0 may send none while it makes the evaluator's reference, at the start (12 steps, a third of a
    # second, once ended before its first figures came).
    finish(
        start(
            run_dir,
            "training.max_steps=40",
            "eval.every_steps=40",
            "eval.num_prompts=2",
            "eval.max_new_tokens=8",
            'logging.wandb_mode="offline"',
        ),
        run_dir,
    )
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "loss" in m]
    for producer in (0, 1):
        assert any(
            f"data/{producer}/mean_batch_docs" in m and f"data/{producer}/mean_batch_tokens" in m for m in trained
        )
    rows = history(run_dir)
    keys = set().union(*(row.keys() for row in rows))
    assert {
        "train/loss",
        "train/tau",
        "train/lr",
        "data/0/mean_batch_docs",
        "data/1/mean_batch_docs",
        "ring/0/ready",
        "eval/tau",
    } <= keys
    assert "loss" not in keys
    output = (run_dir.parent / "launcher.out").read_text()
    progress = [line for line in output.splitlines() if line.startswith("step ")]
    assert progress and all(k in progress[-1] for k in ("elapsed", "eta", "lr ", "tau ", "samples/s", "ring "))
    status = subprocess.run(
        [str(Path(__file__).resolve().parents[1] / "launch" / "run_all.sh"), "status", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "training  step 40/40 (100%)" in status.stdout and "real " in status.stdout and "{" not in status.stdout


def test_a_second_ctrl_c_still_stops_in_order(short_tmp):
    """Ctrl-C twice: the trainer still checkpoints its last step, the producers free their rings (nothing left
    in /dev/shm), nothing is SIGKILLed, and the resumed run repeats no step in metrics.jsonl."""
    import os
    import signal

    from common.rundir import RunDir, read_json
    from tests.peers import wait_for
    from tests.test_pipeline import WANDB, finish

    run_dir = short_tmp / "run"
    # wandb as by default (tests.test_pipeline.SMALL turns it off): its stop is part of the trainer's stop in order.
    # One producer: the rings freed are each producer's own doing, and each start of a second is 5 s of CPU.
    launcher = start(
        run_dir,
        *ONE_PRODUCER,
        "training.max_steps=100000",
        "eval.every_steps=0",
        "training.checkpoint_every=100000",
        WANDB,
    )
    run = RunDir(run_dir)
    wait_for(lambda: ((read_json(run.trainer_status) or {}).get("step") or 0) >= 6, "training", 120)
    pids = [p.pid for p in ProducerStatus.read_all(run)]
    launcher.send_signal(signal.SIGINT)
    time.sleep(0.3)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=120) == 130
    output = (run_dir.parent / "launcher.out").read_text()
    assert "already stopping in order" in output and "SIGKILL" not in output, output[-2000:]
    stopped_at = read_json(run.trainer_status)["step"]
    assert read_json(run.latest_checkpoint() / "trainer_state.json")["step"] == stopped_at, "the last step checkpointed"
    assert not [name for name in os.listdir("/dev/shm") if any(f".{pid}-" in name for pid in pids)], "rings freed"

    finish(
        start(
            run_dir,
            *ONE_PRODUCER,
            f"training.max_steps={stopped_at + 4}",
            "eval.every_steps=0",
            "logging.log_every=1",
            WANDB,
        ),
        run_dir,
    )
    steps = [json.loads(line)["step"] for line in run.metrics.read_text().splitlines() if "loss" in json.loads(line)]
    assert len(steps) == len(set(steps)), "no step is logged twice"


def test_a_first_start_that_failed_does_not_lock_the_run_directorys_config(short_tmp):
    """A first start with a wrong data path stops with exit 2 before any step; the same command with the path
    corrected (and the same --config) then starts, instead of being refused as another run's config."""
    from tests.test_pipeline import finish

    root = Path(__file__).resolve().parents[1]
    run_dir = short_tmp / "run"
    config = root / "launch" / "tiny.toml"
    text, _ = stops_with_2(run_dir, "--config", str(config), 'data.format="tokenized"', 'data.paths=["/nope.jsonl"]')
    assert "data file not found" in text
    finish(
        start(run_dir, "--config", str(config), *ONE_PRODUCER, "training.max_steps=4", "eval.every_steps=0"), run_dir
    )
    assert "differs from the config" not in (run_dir.parent / "launcher.out").read_text()


def test_exports_are_readable_like_the_files_beside_them(tmp_path):
    import stat

    from common.drafter.export import export_speculators, export_zlab
    from common.drafter.model import DFlashDrafter
    from tests.drafter_fixtures import random_head, tiny_config

    config = tiny_config()
    drafter = DFlashDrafter(config, random_head(config))
    for out in (export_zlab(drafter, tmp_path / "z"), export_speculators(drafter, tmp_path / "s", "org/t")):
        weights, config_json = (
            stat.S_IMODE((out / name).stat().st_mode) for name in ("model.safetensors", "config.json")
        )
        assert weights == config_json and weights & 0o044 == 0o044, oct(weights)


def test_run_all_help_lists_the_commands():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([str(root / "launch" / "run_all.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0
    for command in ("run", "restart-trainer", "stop", "status", "check", "synthesize", "evaluate", "export"):
        assert f"  {command} " in done.stdout, command
    exported = subprocess.run(
        [str(root / "launch" / "run_all.sh"), "export", "--help"], capture_output=True, text=True, timeout=60
    )
    assert exported.returncode == 0 and "--format" in exported.stdout and "gguf" in exported.stdout


def test_readme_and_docs_link_nothing_outside_the_repository():
    import re

    root = Path(__file__).resolve().parents[1]
    for path in [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)]+)\)", path.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            resolved = (path.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(root) and resolved.exists(), f"{path.name} links {target}"


def test_a_finished_run_says_where_its_checkpoint_is_its_tau_and_commands_that_paste(short_tmp):
    """The launcher's last words after a finished run: the last checkpoint, simulated and real tau, and the next
    commands; the export command, pasted into a shell as printed, writes the export."""
    import subprocess

    from tests.test_pipeline import finish

    run_dir = short_tmp / "run with space"
    finish(
        start(
            run_dir,
            *ONE_PRODUCER,
            "training.max_steps=8",
            "eval.every_steps=8",
            "eval.num_prompts=2",
            "eval.max_new_tokens=8",
        ),
        run_dir,
    )
    output = (run_dir.parent / "launcher.out").read_text()
    summary = output[output.index("run finished at step 8") :]
    assert "last checkpoint" in summary and "step-00000008" in summary
    assert "simulated tau" in summary and "real tau" in summary
    # the README's commands (launch/run_all.sh evaluate|export), as the launcher started from the repository root
    evaluate = next(line for line in summary.splitlines() if " evaluate --checkpoint " in line)
    export = next(line for line in summary.splitlines() if " export --checkpoint " in line)
    assert evaluate.startswith("  launch/run_all.sh evaluate ") and export.startswith("  launch/run_all.sh export ")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", "-c", export], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "export" / "config.json").is_file()
    card = (run_dir / "export" / "README.md").read_text()  # the model card: what it is, its tau, how to serve it
    assert "| block size | 4 " in card and "| steps | 8 |" in card and "| real acceptance | tau " in card
    assert '"num_speculative_tokens": 3' in card
    # the serving commands are the export's, for the kind's servers and its block size
    assert "--speculative-config" in done.stdout and '"num_speculative_tokens": 3' in done.stdout


def test_what_the_readmes_walkthrough_writes_stays_out_of_git_status():
    """The walkthrough's data (my-data/) and runs (runs/) are ignored, so that git status shows the user's own work."""
    import shutil
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    readme = (root / "README.md").read_text()
    for path in ("my-data/chat.jsonl", "runs/my/draft/README.md", "runs/my-data/synthesized/p0-0.jsonl"):
        assert path.split("/")[0] + "/" in readme, path
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, timeout=30)
        assert done.returncode == 0, f"{path} would show in git status"


def test_the_readmes_walkthrough_names_a_model_folder_a_preset_and_commands_that_exist():
    """The README's "Your own model", as a user pastes it: its MODEL= line prints the packaged SmolLM2 GGUF's
    dequantized folder (a Hugging Face folder), its preset is a file, and every launch/run_all.sh line names a command
    of run_all.sh with options that command takes."""
    import os
    import shlex
    import subprocess
    import sys

    from tests.real_model import smollm2_folder, smollm2_gguf

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    start = text.index("## Your own model")
    lines = text[start : text.index("\n## ", start + 1)].splitlines()
    preset = next(line for line in lines if line.startswith("PRESET=")).split("=", 1)[1].split()[0]
    assert (root / preset).is_file(), preset
    model = next(line for line in lines if line.startswith("MODEL=$("))
    command = model.removeprefix("MODEL=$(").removesuffix(")").replace(".venv/bin/python", sys.executable, 1)
    env = {**os.environ, "GGUF": str(smollm2_gguf())}
    printed = subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=root, env=env, timeout=300)
    assert printed.returncode == 0, printed.stderr
    assert Path(printed.stdout.strip()) == smollm2_folder() and (smollm2_folder() / "config.json").is_file()
    runs = [shlex.split(line.split("#", 1)[0]) for line in lines if line.startswith("launch/run_all.sh ")]
    assert {words[1] for words in runs} >= {"check", "synthesize", "--run-dir", "evaluate", "export"}
    helps: dict[str, str] = {}
    for words in runs:
        name = "run" if words[1].startswith("--") else words[1]
        if name not in helps:
            shown = subprocess.run(
                [str(root / "launch" / "run_all.sh"), name, "--help"], capture_output=True, text=True, timeout=120
            )
            assert shown.returncode == 0, (name, shown.stderr)
            helps[name] = shown.stdout
        for option in (word for word in words[1:] if word.startswith("--")):
            assert option in helps[name], (name, option)

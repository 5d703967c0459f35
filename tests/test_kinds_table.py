"""The kinds benchmark's table: the equal-steps view from each row's evaluations during training, a wave's rows
evaluated together, and the size of a smoke run."""

import json

import pytest

from launch.bench.kinds import equal_steps, table


def _quality(out, row: str, kind: str, curve: list[tuple[int, float]]) -> None:
    taus = {"tau": 2.0, "zlab_tau": 2.2, "sim_tau": 3.0}
    (out / f"quality-{row}.json").write_text(
        json.dumps(
            {
                "kind": kind,
                "overrides": [],
                "steps": max((step for step, _ in curve), default=0),
                "trained_samples": 100,
                "trained_s": 240.0,
                "held_out": taus,
                "humaneval": taus,
                "curve": [
                    {"step": step, "samples": 10 * step, "minutes": step / 100, "tau": tau} for step, tau in curve
                ],
            }
        )
    )


def test_the_equal_steps_view_holds_the_steps_every_row_evaluated(tmp_path):
    _quality(tmp_path, "dflash-s0", "dflash", [(200, 2.1), (400, 2.5), (600, 2.8)])
    _quality(tmp_path, "dflash2-s0", "dflash2", [(200, 2.3), (400, 2.9)])  # slower steps: fewer of them in M minutes
    rows = table(tmp_path)
    assert [r["row"] for r in rows] == ["dflash-s0", "dflash2-s0"]
    assert equal_steps(rows) == [
        {"step": 200, "dflash-s0": 2.1, "dflash2-s0": 2.3},
        {"step": 400, "dflash-s0": 2.5, "dflash2-s0": 2.9},
    ]


def test_a_row_that_evaluated_nothing_during_training_leaves_the_view_empty(tmp_path):
    _quality(tmp_path, "dflash-s0", "dflash", [(200, 2.1)])
    _quality(tmp_path, "dspark-s0", "dspark", [])  # no curve: no common step
    assert equal_steps(table(tmp_path)) == []


def test_a_waves_rows_are_evaluated_together_once_they_have_trained(tmp_path, monkeypatch):
    """The rows of a wave that trained go to one evaluation of their last checkpoints, against the first row's run
    (the same data and held-out records for all); a row whose training failed is left out; each evaluated row's
    record gets its figures, as ``launch.bench.quality`` writes them, and so enters the table."""
    import argparse

    from launch.bench import kinds, quality

    trained = {"kind": "dflash", "overrides": [], "steps": 10, "trained_samples": 100, "trained_s": 240.0, "curve": []}
    times = {"synthesize_s": 100.0, "humaneval_synthesize_s": 20.0, "train_s": 250.0}
    for row, record in (("dflash-s0", trained | times), ("dflash2-s0", trained | times | {"kind": "dflash2"})):
        (tmp_path / f"quality-{row}.json").write_text(json.dumps(record))
        for step in (5, 10):
            (tmp_path / row / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    (tmp_path / "quality-dspark-s0.json").write_text(json.dumps({"kind": "dspark"}))  # its training failed
    calls = []

    def evaluate(checkpoints, run_dir, out, name, runs):
        calls.append(([c.relative_to(tmp_path).as_posix() for c in checkpoints], run_dir.name, name))
        return [{"held_out": {"tau": 2.0 + i, "sim_tau": 3.0, "prompts": 4}} for i in range(len(checkpoints))]

    monkeypatch.setattr(quality, "evaluated", evaluate)
    args = argparse.Namespace(smoke=True, held_out=4, sampled_prompts=0)
    kinds.evaluate_rows(args, tmp_path, ["dflash-s0", "dflash2-s0", "dspark-s0"], "wave1")
    assert calls == [
        (["dflash-s0/checkpoints/step-00000010", "dflash2-s0/checkpoints/step-00000010"], "dflash-s0", "wave1")
    ]
    rows = {r["row"]: r for r in table(tmp_path)}
    assert set(rows) == {"dflash-s0", "dflash2-s0"} and rows["dflash2-s0"]["held_out_tau"] == 3.0
    record = json.loads((tmp_path / "quality-dflash-s0.json").read_text())
    assert record["total_s"] == 370.0 + record["evaluate_s"] and record["trained_s"] == 240.0


@pytest.mark.parametrize("bench, magpie", [("kinds", 24576), ("recipes", 36864)])
def test_a_smoke_run_synthesizes_what_the_quality_smoke_does(bench, magpie):
    """--smoke caps --magpie, which every row is passed, at ``launch.bench.quality --smoke``'s prompts: a kinds smoke
    run on two cores set out to synthesize 24,576 prompts (its synthesis said 13 hours)."""
    from launch.bench.quality import SIZES
    from launch.bench.side_by_side import parse_side_by_side, side_by_side_parser

    parser = side_by_side_parser("", bench, magpie=magpie)
    assert parse_side_by_side(parser, ["--gguf", "G", "--out", "O", "--smoke"]).magpie == SIZES["magpie"][2]
    assert parse_side_by_side(parser, ["--gguf", "G", "--out", "O"]).magpie == magpie


def test_a_kinds_smoke_run_evaluates_the_prompts_of_the_quality_smoke():
    from launch.bench.kinds import parse

    smoke, _ = parse(["--gguf", "G", "--out", "O", "--smoke", "dflash"])
    assert (smoke.magpie, smoke.held_out, smoke.sampled_prompts) == (48, 4, 2)
    full, _ = parse(["--gguf", "G", "--out", "O", "dflash"])
    assert (full.magpie, full.held_out, full.sampled_prompts) == (24576, 128, 48)


def test_side_by_side_runs_that_fail_are_named_so_the_benchmark_exits_1(tmp_path, capsys):
    """A kinds or recipes row whose run fails is said, and returned, so that the benchmark does not exit 0 over a
    table with rows missing."""
    import sys

    from launch.bench.side_by_side import SideBySide

    with SideBySide(tmp_path, "kinds", processes=2, smoke=True) as rows:
        rows.launch("good", [sys.executable, "-c", "pass"])
        rows.launch("bad", [sys.executable, "-c", "raise SystemExit(3)"])
        assert rows.wait() == ["bad"]
    assert "bad: failed (exit 3), see kinds-bad.log" in capsys.readouterr().out


@pytest.mark.reference
@pytest.mark.timeout(1800)  # 536 s on two cores, synthesis 3.5 min of it
def test_the_smoke_bench_trains_two_kinds_side_by_side_and_evaluates_them_together(short_tmp):
    """The whole path on the CPU: the data, DFlash and DFlash 2 side by side, then both evaluated together, each
    evaluation one process against one reference of the target, and the table."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from launch.bench.served.prompts import smollm2_gguf

    out = short_tmp / "out"  # its producers' socket paths must stay under 100 characters
    command = [sys.executable, "-m", "launch.bench.kinds", "--gguf", str(smollm2_gguf()), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [*command, "--smoke", "--minutes", "1", "dflash", "dflash2"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads((out / "kinds.json").read_text())}
    assert set(rows) == {"dflash-s0", "dflash2-s0"}
    for row in rows.values():
        assert all(row[f"{what}_tau"] >= 1.0 for what in ("held_out", "humaneval", "humaneval_sampled"))
    for what in ("held_out", "humaneval"):
        assert (out / f"eval-{what}-wave1.log").read_text().count("evaluation reference:") == 1

"""launch.bench.kinds sizes its rows to the card before it starts anything (launch/bench/memory.py estimates them).

The card's memory is given with --card-gib (on a GPU the benchmark asks torch), so the plans of an H100 80 GB and an
H200 run here on the CPU, for the real target's preset (SmolLM2's packaged GGUF file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_mps_cleanup import FakeMps, fake_mps  # noqa: F401  (the fixture: MPS must not start)

from launch.bench.kinds import plan_waves
from launch.bench.memory import GIB, estimate

ROOT = Path(__file__).resolve().parents[1]
ROWS = ["dflash", "dflash2", "dflash@1", "dflash2@1"]
"""Two kinds, two seeds: the four rows that ran out of memory together on an H100 80 GB (issue 56)."""
H100, H200 = "79.6", "139.8"  # GiB, as torch reports the cards


def _gguf() -> Path:
    from launch.bench.served.prompts import smollm2_gguf

    return smollm2_gguf()


def kinds(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.bench.kinds", "--gguf", str(_gguf()), "--out", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def planned(capsys, out: Path, *args: str) -> tuple[int, str, str]:
    """``launch.bench.kinds``'s main in this process: (its exit code, what it printed, its errors). The program's own
    process is ``kinds``'s (5 s of imports each); the plan's further cases run here."""
    from launch.bench.kinds import main

    capsys.readouterr()
    try:
        code = main(["--gguf", str(_gguf()), "--out", str(out), *args])
    except SystemExit as stopped:
        code = stopped.code
    printed = capsys.readouterr()
    return code, printed.out, printed.err


def test_rows_that_fit_run_together_and_the_others_in_even_waves_in_their_order():
    needs = {"a-s0": 20, "b-s0": 24, "a-s1": 20, "b-s1": 24}
    assert plan_waves(needs, 100) == [list(needs)]
    assert plan_waves(needs, 75) == [["a-s0", "b-s0"], ["a-s1", "b-s1"]], "even waves, not 3 + 1"
    assert plan_waves(needs, 44) == [["a-s0", "b-s0"], ["a-s1", "b-s1"]]
    assert plan_waves(needs, 43) == [["a-s0"], ["b-s0"], ["a-s1"], ["b-s1"]]
    with pytest.raises(ValueError, match="b-s0"):
        plan_waves(needs, 23)


def test_the_estimate_of_the_smollm2_preset_matches_what_its_processes_held():
    """Measured on an H100 in the kinds benchmark: producers about 4 GB, trainers 9-15 GB; DFlash 2's step holds more
    than DFlash's (12.0 against 9.5 GiB allocated, BENCHMARKS.md)."""
    from common.config import load_config
    from launch.bench.quality import PRESET

    def of(kind: str):
        return estimate(load_config(PRESET, [f"target.path={json.dumps(str(_gguf()))}", f"drafter.kind={kind}"]))

    dflash, dflash2 = of("dflash"), of("dflash2")
    assert 3 * GIB < dflash.producer < 5 * GIB
    assert 9 * GIB < dflash.trainer < dflash2.trainer < 16 * GIB
    assert dflash.ring == 2 * dflash.staged_batches, "ring.num_slots = 4 slots on the GPU, ring.credits = 2 leased"


def test_a_kinds_step_is_dflashs_times_the_factor_its_table_row_states(monkeypatch):
    """The factor is read from the kind's row (common/drafter/kinds.py), so a kind not measured says so there rather
    than getting a default here."""
    import dataclasses

    from common.config import load_config
    from common.drafter.kinds import KINDS, kind_of
    from launch.bench.quality import PRESET

    def step(kind: str) -> int:
        cfg = load_config(PRESET, [f"target.path={json.dumps(str(_gguf()))}", f"drafter.kind={kind}"])
        return estimate(cfg).step_activations

    monkeypatch.setitem(KINDS._all(), "lilicorr", dataclasses.replace(kind_of("lilicorr"), step_memory_factor=2.0))
    dflash = step("dflash")
    for kind in ("dflash2", "dspark", "lilicorr"):
        assert step(kind) == pytest.approx(kind_of(kind).step_memory_factor * dflash, rel=1e-6), kind
    assert step("lilicorr") == pytest.approx(2.0 * dflash, rel=1e-6)


def test_the_four_rows_go_in_two_waves_on_an_h100_and_together_on_an_h200(short_tmp, capsys):
    out = short_tmp / "out"
    h100 = kinds(out, "--card-gib", H100, "--plan", *ROWS)
    assert h100.returncode == 0, h100.stderr
    assert "wave 1: dflash-s0, dflash2-s0 (" in h100.stdout and "wave 2: dflash-s1, dflash2-s1 (" in h100.stdout
    assert "2 waves, each row beside those of its wave only" in h100.stdout
    assert "dflash2-s0 needs " in h100.stdout and "2 producers of" in h100.stdout
    code, printed, errors = planned(capsys, out, "--card-gib", H200, "--plan", *ROWS)
    assert code == 0, errors
    assert "wave 1: dflash-s0, dflash2-s0, dflash-s1, dflash2-s1 (" in printed and "wave 2" not in printed
    assert not out.exists(), "--plan starts nothing"


def test_a_row_too_big_for_the_card_stops_with_exit_2_before_anything_starts(
    short_tmp,
    fake_mps: FakeMps,  # noqa: F811
    capsys,
    monkeypatch,
):
    out = short_tmp / "out"
    small = kinds(out, "--card-gib", "12", *ROWS, env=fake_mps.env)
    assert small.returncode == 2, small.stdout + small.stderr
    assert "error: row dflash-s0 needs " in small.stderr and "the card has 12.0 GiB" in small.stderr
    assert "does not fit with one producer either: lower batching.token_budget or drafter.num_anchors" in small.stderr
    assert not out.exists() and not fake_mps.lines(), "no synthesis, no MPS daemon, no row"
    for name, value in fake_mps.env.items():
        monkeypatch.setenv(name, value)
    code, _, errors = planned(capsys, out, "--card-gib", "20", *ROWS)
    assert code == 2 and "It fits with --producers 1." in errors
    assert not out.exists() and not fake_mps.lines()


def test_without_a_gpu_or_card_gib_the_benchmark_stops_at_once(short_tmp):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = kinds(short_tmp / "out", "dflash", env=env)
    assert done.returncode == 2 and "no CUDA GPU to size the rows for: give its memory with --card-gib" in done.stderr
    assert not (short_tmp / "out").exists()

"""The kinds benchmark's table: the equal-steps view from each row's evaluations during training."""

import json

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

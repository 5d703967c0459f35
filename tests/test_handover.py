"""restart-trainer in seconds: a standby trainer takes over, and kill -9 at any point of the handover loses
nothing and trains nothing twice (fault points and the ledger audit, real processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from common.faults import DELAY_ENV, LOG_ENV, PLAN_ENV
from common.naming import process_start_ticks, run_tag
from common.rundir import RunDir, read_json
from common.status import ProducerStatus
from tests.peers import wait_for
from tests.test_pipeline import ONE_PRODUCER, ROOT, SMALL, lineage, run_all, start, stop_and_finish, trainer_step

# Before the handover (the old trainer before it stages its state in shared memory, and after, before its mark),
# at the takeover (the standby, told to take over) and after it (the successor before it maps the state, and
# after, before it trains or writes the checkpoint of that state). Each round replaces the trainer once and
# kills one or both of the two trainers of that replacement (each point fires the first time it is reached);
# a kill during a checkpoint write is tests/test_faults.py's.
ROUNDS = [["trainer.stage", "trainer.takeover"], ["trainer.handover", "trainer.resume"], ["trainer.taken"]]


def standby(run: RunDir) -> dict | None:
    return (read_json(run.root / "launcher.json") or {}).get("standby_trainer")


@pytest.mark.parametrize(
    "rounds",
    [pytest.param(ROUNDS[:1], id="first-round"), pytest.param(ROUNDS, id="every-point", marks=pytest.mark.thorough)],
)
def test_kill9_at_every_point_of_the_handover_loses_nothing_and_trains_nothing_twice(short_tmp, rounds):
    """CI kills at the first round's points (the trainer being replaced, and its standby); ``-m thorough`` at all."""
    plan = [point for points in rounds for point in points]
    run_dir = short_tmp / "run"
    fault_log = short_tmp / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: ",".join(f"{point}:1" for point in plan), LOG_ENV: str(fault_log)}
    launcher = start(
        run_dir,
        "training.max_steps=100000",
        "training.checkpoint_every=4",
        "eval.every_steps=0",
        # trainer.json every step: each round below waits for steps read from it.
        "logging.log_every=1",
        "launch.standby_trainer_after_s=0",
        *ONE_PRODUCER,  # the handover is the trainer's: one producer feeds it (two: test_pipeline.py, test_faults.py)
        env=env,
    )
    run = RunDir(run_dir)
    fired = lambda: len(fault_log.read_text().splitlines()) if fault_log.exists() else 0  # noqa: E731
    taken_over = 0
    for index, points in enumerate(rounds):
        # Each round: a trainer that trains, with a standby beside it, is replaced; the round's faults fire.
        wait_for(
            lambda: (
                standby(run) is not None
                and trainer_step(run) > 0
                and (read_json(run.trainer_status) or {}).get("state") == "training"
            ),
            f"a standby (round {index})",
            120,
        )
        step_before = trainer_step(run)
        answer = run_all("restart-trainer", "--run-dir", str(run_dir), f"training.lr={1e-3 / (index + 2)}")
        assert answer.returncode == 0, answer.stdout + answer.stderr
        expected = len(plan[: plan.index(points[-1]) + 1])
        wait_for(lambda: fired() >= expected, f"faults {points} to fire", 120)
        wait_for(lambda: trainer_step(run) > step_before + 2, f"training to go on after {points}", 180)
        taken_over += "takes over" in (run_dir / "logs" / "launcher.log").read_text()
    stop_and_finish(launcher, run_dir)
    assert taken_over, "a standby trainer took over"
    triples = Counter(tuple(t) for line in lineage(run) for t in line["samples"])
    assert triples and not [t for t, n in triples.items() if n > 1], "nothing trained twice"
    steps = [line["step"] for line in lineage(run)]
    assert steps == list(range(1, len(steps) + 1)), "every step in the lineage once, none missing"
    assert sorted(json.loads(line)["point"] for line in fault_log.read_text().splitlines()) == sorted(plan)


def test_restart_trainer_through_a_standby_is_fast_and_keeps_the_run(short_tmp):
    """The standby takes over; the producers stay; the new trainer resumes from the old one's last step."""
    run_dir = short_tmp / "run"
    with open(run_dir.parent / "launcher.out", "w") as out:
        launcher = subprocess.Popen(
            [
                str(ROOT / "launch" / "run_all.sh"),
                "--run-dir",
                str(run_dir),
                *SMALL,
                "training.max_steps=100000",
                "eval.every_steps=0",
                "logging.log_every=1",
                "launch.standby_trainer_after_s=0",
                *ONE_PRODUCER,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    run = RunDir(run_dir)
    wait_for(lambda: standby(run) is not None and trainer_step(run) > 2, "a standby trainer", 120)
    spare = standby(run)["pid"]
    trainer_log = run_dir / "logs" / "trainer.log"
    # The standby builds its warm start (trainer/warm.py) while the trainer trains: head, drafter, a step.
    wait_for(lambda: "warm start: head, drafter" in trainer_log.read_text(), "the standby's warm start", 60)
    producers = [s.pid for s in ProducerStatus.read_all(run)]
    staging = lambda: {
        p.name.rsplit(".", 2)[1]: p for p in Path("/dev/shm").glob(f"dflash.{run_tag(run_dir)}.trainer-*")
    }  # noqa: E731
    wait_for(
        lambda: {"trainer-drafter", "trainer-optimizer"} <= staging().keys(),
        "the old trainer's staging (a checkpoint)",
        60,
    )
    inodes_before = {role: path.stat().st_ino for role, path in staging().items()}
    began = time.monotonic()
    answer = run_all("restart-trainer", "--run-dir", str(run_dir), "training.lr=2e-4")
    assert answer.returncode == 0, answer.stderr
    old_step = read_json(run.trainer_handover)["step"]
    wait_for(
        lambda: (read_json(run.trainer_status) or {}).get("pid") == spare and trainer_step(run) > old_step,
        "the standby's first step",
        60,
    )
    seconds = time.monotonic() - began
    assert f"trainer pid {spare}, started ahead, takes over" in (run_dir / "logs" / "launcher.log").read_text()
    assert [s.pid for s in ProducerStatus.read_all(run)] == producers
    assert seconds < 15, seconds
    # The old trainer wrote no checkpoint of its last step: it handed the state over in shared memory, and
    # the successor wrote that checkpoint in the background; its segments are gone from /dev/shm.
    text = trainer_log.read_text()
    assert "handed over in shared memory" in text and "it handed its state over" in text
    took_over = next(line for line in text.splitlines() if "took over the state handed over" in line)
    assert "(warm start:" in took_over, took_over  # it loaded the state into the drafter it built ahead
    written = f"checkpoint step-{old_step:08d} written"  # (later ones may have pruned it already)
    wait_for(
        lambda: written in (run_dir / "logs" / "trainer.log").read_text().split("it handed its state over")[-1],
        "the successor's checkpoint of the step handed over",
        30,
    )
    owners = lambda: {p.name.rsplit(".", 1)[1] for p in Path("/dev/shm").glob(f"dflash.{run_tag(run_dir)}.trainer-*")}  # noqa: E731
    successor = f"{spare}-{process_start_ticks(spare)}"
    wait_for(lambda: owners() == {successor}, "the successor's own staging, and no other", 30)
    # It adopted the segments handed over as its own staging: its checkpoints copy into the very same pages.
    next_checkpoint = f"checkpoint step-{(old_step // 8 + 1) * 8:08d} written"
    wait_for(lambda: next_checkpoint in trainer_log.read_text(), "the successor's next checkpoint", 60)
    inodes_after = {role: path.stat().st_ino for role, path in staging().items()}
    handed_line = next(line for line in text.splitlines() if "handed over in shared memory" in line)
    if "superseded" not in handed_line:  # a write in flight at the handover (rare here) gets new segments
        assert inodes_after["trainer-drafter"] == inodes_before["trainer-drafter"]
        assert inodes_after["trainer-optimizer"] == inodes_before["trainer-optimizer"]
    stop_and_finish(launcher, run_dir)
    assert not list(Path("/dev/shm").glob(f"dflash.{run_tag(run_dir)}.trainer-*")), (
        "a trainer that stops removes its segments"
    )


WRITE_S = 6.0  # every checkpoint write held open this long (DFLASH_FAULT_DELAY), so that a restart comes during one


def test_a_restart_during_a_checkpoint_write_does_not_wait_for_it_and_loses_nothing(short_tmp):
    """restart-trainer while a background write is in flight: the old trainer hands its later state over in new
    segments at once instead of waiting for the write, which dies with it. Twice: the first successor is killed
    -9 after it mapped that state (before its own write of it), the second trains on. latest.json never goes
    back, the ledger audit holds, and nothing is left in checkpoints/ or /dev/shm."""
    run_dir = short_tmp / "run"
    fault_log = short_tmp / "faults.jsonl"
    env = {
        **os.environ,
        DELAY_ENV: f"trainer.checkpoint={WRITE_S}",
        PLAN_ENV: "trainer.taken:1",
        LOG_ENV: str(fault_log),
    }
    launcher = start(
        run_dir,
        "training.max_steps=100000",
        # Each write takes WRITE_S, so writes follow one another: a new one begins within a few seconds of training
        # (every 200 steps, each round trained 200 steps for it). A restart-trainer still lands within WRITE_S of
        # its write's start, or the write it finds is done, as with writes far apart.
        "training.checkpoint_every=60",
        "eval.every_steps=0",
        "logging.log_every=1",
        "launch.standby_trainer_after_s=0",
        *ONE_PRODUCER,
        env=env,
    )
    run = RunDir(run_dir)
    latest_steps, watching = [], threading.Event()

    def watch_latest() -> None:  # every value latest.json takes, in order
        while not watching.is_set():
            step = (read_json(run.checkpoints / "latest.json") or {}).get("step")
            if step is not None and (not latest_steps or latest_steps[-1] != step):
                latest_steps.append(step)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_latest, daemon=True)
    watcher.start()
    trainer_log = run_dir / "logs" / "trainer.log"
    handed = []
    for index in range(2):
        wait_for(
            lambda: (
                standby(run) is not None
                and "warm start: head, drafter" in trainer_log.read_text().split("takes over" if index else "\0")[-1]
                and (read_json(run.trainer_status) or {}).get("state") == "training"
            ),
            f"a warm standby (round {index})",
            120,
        )
        writing = (read_json(run.trainer_status) or {}).get("checkpoint_writing")
        # Right after a new write began: it has about WRITE_S to go when the restart arrives.
        new_write = wait_for(
            lambda: (
                ((read_json(run.trainer_status) or {}).get("checkpoint_writing") or writing) != writing
                and read_json(run.trainer_status)["checkpoint_writing"]
            ),
            f"a new checkpoint write (round {index})",
            120,
        )
        answer = run_all("restart-trainer", "--run-dir", str(run_dir))
        assert answer.returncode == 0, answer.stdout + answer.stderr
        line = wait_for(
            lambda: [x for x in trainer_log.read_text().splitlines() if "handed over in shared memory" in x][index:],
            f"the handover (round {index})",
            60,
        )[0]
        assert f"checkpoint {new_write} was still being written, and is superseded" in line, line
        seconds = float(re.search(r"in ([0-9.]+) s", line).group(1))
        assert seconds < WRITE_S / 3, line  # it did not wait for the write
        handed.append(int(re.search(r"state of step (\d+)", line).group(1)))
        wait_for(lambda: trainer_step(run) > handed[-1] + 2, f"training after the handover (round {index})", 120)
    # The first successor was killed before its write of the state handed over: the run went back to the last
    # disk checkpoint, earlier than the superseded write. The second one's write of its state lands.
    assert [json.loads(x)["point"] for x in fault_log.read_text().splitlines()] == ["trainer.taken"]
    wait_for(
        lambda: latest_steps and latest_steps[-1] >= handed[1], "the checkpoint of the second state handed over", 60
    )
    stop_and_finish(launcher, run_dir)
    watching.set()
    watcher.join()
    assert latest_steps == sorted(latest_steps), f"latest.json went back: {latest_steps}"
    text = trainer_log.read_text()
    assert f"checkpoint step-{handed[1]:08d} written" in text
    triples = Counter(tuple(t) for line in lineage(run) for t in line["samples"])
    assert triples and not [t for t, n in triples.items() if n > 1], "nothing trained twice"
    leftovers = [p.name for p in run.checkpoints.iterdir() if p.name.startswith(".step-")]
    assert not leftovers, leftovers  # the superseded writes' folders were swept
    assert not list(Path("/dev/shm").glob(f"dflash.{run_tag(run_dir)}.*")), "nothing of the run left in /dev/shm"


def test_the_progress_line_names_a_handover_and_an_evaluation_in_flight(tmp_path, capsys):
    from common.rundir import atomic_write_json
    from launch.progress import ProgressView

    run = RunDir(tmp_path / "run")
    (run.root / "producers").mkdir(parents=True)
    view = ProgressView(run, terminal=False)
    for step, state in [(40, "handing over"), (41, "taking over"), (42, "training")]:
        atomic_write_json(
            run.trainer_status,
            {
                "step": step,
                "max_steps": 100,
                "state": state,
                "updated": 1000.0 + step,
                "loss": 2.0 + step,
                "evals_in_flight": [40],
                "checkpoint_writing": "step-00000040" if step == 40 else None,
            },
        )
        view.update(trainer_started_wall=900.0, trainer_alive=True)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "handing over" in lines[0] and "taking over" in lines[1], lines
    assert (
        lines[1].count("taking over") == 1 and "over" not in lines[2] and all("evaluating 40" in line for line in lines)
    )
    assert "writing step-00000040" in lines[0] and "writing" not in lines[1] + lines[2]

"""Fault injection: kill -9 of the trainer and of the producers at named points, in one supervised run.

The plan (common/faults.py) is a sequence of (point, count): the trainer killed inside a step, while
writing a checkpoint, before latest.json follows it, holding a batch while more are leased to it,
during its handshake; a producer killed filling a slot, right after announcing one, during a
handshake. The launcher restarts every killed process; nothing else helps the pipeline recover.
At the end, audited from the run directory alone:

- every fault fired and the launcher restarted its victim (recovered);
- the sample ledger: in the checkpoint lineage no sample is trained twice and every epoch a
  producer has moved two past is complete (samples lost = 0, repeated = 0);
- every checkpoint folder is complete and loads, nothing half-written is left in checkpoints/, and
  the temporary folder of every kill inside a checkpoint write was found and removed.

The CI form (no marker) kills the trainer at 3 points and a producer at 1. The full form (marker
``faults``) kills the trainer 20 times and the producers 10 times. Points and counts come from a
seed that is printed; DFLASH_FAULT_SEED=N repeats a run.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from peers import wait_for
from safetensors.torch import load_file
from test_pipeline import ROOT, SMALL, lineage, run_all, shard

from common.faults import (
    DELAY_ENV,
    LOG_ENV,
    PLAN_ENV,
    POINTS,
    Delay,
    Fault,
    format_plan,
    parse_delays,
    parse_plan,
    read_log,
)
from common.naming import process_alive
from common.rundir import RunDir, read_json
from common.status import ProducerStatus
from trainer.checkpoint import read_train_state

# Points an ordinary run reaches. The handover points fire only on restart-trainer (tests/test_handover.py),
# producer.evaluate and trainer.export only on an evaluation (tests/test_acceptance_in_producer.py): a plan drawn here
# would wait forever.
ONLY_ON_REQUEST = {
    "trainer.stage",
    "trainer.handover",
    "trainer.takeover",
    "trainer.resume",
    "trainer.taken",
    "producer.evaluate",
    "trainer.export",
}
TRAINER_POINTS = sorted(p for p in POINTS if p.startswith("trainer.") and p not in ONLY_ON_REQUEST)
PRODUCER_POINTS = sorted(p for p in POINTS if p.startswith("producer.") and p not in ONLY_ON_REQUEST)
COUNTS = {  # the count-th time the point is reached (range, both ends included)
    "trainer.handshake": (1, 1),  # one HELLO per producer per incarnation
    "trainer.batch": (1, 12),
    "trainer.step": (1, 12),
    "trainer.checkpoint": (1, 2),
    "trainer.latest": (1, 2),
    "producer.handshake": (1, 1),
    "producer.fill": (1, 15),
    "producer.publish": (1, 15),
}
FAULT_RUN = [
    "training.max_steps=0",
    "training.epochs=1000",
    "training.checkpoint_every=5",
    "logging.log_every=5",
    # Every kill is a crash to the launcher: restart at once, and never give up on this run.
    "launch.restart_backoff_s=0",
    "launch.max_restarts=100",
    "logging.wandb_mode=disabled",  # each trainer start would also start wandb's service: seconds of CPU
]
LAUNCHER_EVENT = re.compile(
    r"(?:re)?started (?P<started>trainer|producer-\d+) pid (?P<pid>\d+)|(?P<ready>producer-\d+) ready in"
)


def make_plan(rng: random.Random, trainer_kills: int, producer_kills: int) -> list[Fault]:
    """Points drawn so that each is used about equally often, counts at random; shuffled together."""

    def draw(points: list[str], n: int) -> list[str]:
        picked = []
        while len(picked) < n:
            picked += rng.sample(points, min(len(points), n - len(picked)))
        return picked

    plan = [
        Fault(p, rng.randint(*COUNTS[p]))
        for p in draw(TRAINER_POINTS, trainer_kills) + draw(PRODUCER_POINTS, producer_kills)
    ]
    rng.shuffle(plan)
    return plan


@dataclass
class Outcome:
    injected: int
    recovered: int
    audited: int
    """Samples of finished epochs checked for completeness."""
    lost: int
    repeated: int
    steps: int
    trainer_incarnations: int


def run_plan(run_dir: Path, plan: list[Fault], epochs_after: int, timeout_s: float) -> Outcome:
    """Run the pipeline under ``plan`` until every fault fired and training went on ``epochs_after``
    epochs of every producer past the last one; stop it cleanly and audit the run directory."""
    fault_log = run_dir.parent / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: format_plan(plan), LOG_ENV: str(fault_log)}
    with open(run_dir.parent / "launcher.out", "w") as out:
        launcher = subprocess.Popen(
            [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run_dir), *SMALL, *FAULT_RUN],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    run = RunDir(run_dir)
    try:
        wait_for(
            lambda: len(read_log(fault_log)) == len(plan) or launcher.poll() is not None,
            f"all {len(plan)} faults to fire",
            timeout_s,
        )
        fired = read_log(fault_log)
        assert len(fired) == len(plan), f"the run ended after {len(fired)} of {len(plan)} faults: {_logs(run_dir)}"
        # Only lines written after the last fault are sure to stay in the lineage (a killed trainer's
        # unsaved steps are trained again), and the audit needs epoch 2 of every producer in it.
        last_fault = fired[-1]["time"]
        goal = {p: max(_epoch_reached(run, p) + epochs_after, 2) for p in (0, 1)}
        wait_for(
            lambda: (
                (all(_epoch_reached(run, p, after=last_fault) >= goal[p] for p in goal) and _all_serving(run))
                or launcher.poll() is not None
            ),
            "training to go on from every producer after the last fault",
            timeout_s,
        )
        stopped = run_all("stop", "--run-dir", str(run_dir))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert launcher.wait(timeout=120) == 0, _logs(run_dir)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
    assert [(f["point"], f["count"]) for f in fired] == [(f.point, f.count) for f in plan]
    recovered = _recovered(run, fired)
    audited, lost, repeated, lines = _audit_ledger(run)
    _audit_checkpoints(
        run, sum(f.point == "trainer.checkpoint" for f in plan), sum(f.point.startswith("trainer.") for f in plan)
    )
    return Outcome(
        len(fired), recovered, audited, lost, repeated, len(lines), len({line["incarnation"] for line in lines})
    )


def _logs(run_dir: Path) -> str:
    parts = [(run_dir.parent / "launcher.out").read_text()[-3000:]]
    parts += [f"\n--- {p.name}\n" + p.read_text()[-2500:] for p in sorted((run_dir / "logs").glob("*.log"))]
    return "".join(parts)


def _epoch_reached(run: RunDir, producer: int, after: float = 0.0) -> int:
    """The highest epoch of ``producer`` in ledger lines written after time ``after`` (-1: none)."""
    try:
        lines = run.ledger.read_text().splitlines()
    except FileNotFoundError:
        return -1
    records = [json.loads(line) for line in lines if line.endswith("}")]
    epochs = [s[1] for r in records if r["time"] > after for s in r["samples"] if s[0] == producer]
    return max(epochs, default=-1)


def _all_serving(run: RunDir) -> bool:
    """Every producer's current process is ready and the trainer has taken batches from it."""
    statuses = ProducerStatus.read_all(run)
    return len(statuses) == 2 and all(
        s.ready and process_alive(s.pid) and s.server.get("released", 0) > 0 for s in statuses
    )


def _recovered(run: RunDir, fired: list[dict]) -> int:
    """How many victims came back by themselves: the launcher restarted the process and the new
    one went back to work (a trainer trained a step; a producer loaded its target and said ready)."""
    events = [
        (m["started"], int(m["pid"]), None) if m["started"] else (None, None, m["ready"])
        for m in LAUNCHER_EVENT.finditer(run.log("launcher").read_text())
    ]
    incarnations = {json.loads(line)["incarnation"] for line in run.ledger.read_text().splitlines()}
    recovered = 0
    for fault in fired:
        killed_at = next((i for i, (_, pid, _) in enumerate(events) if pid == fault["pid"]), None)
        assert killed_at is not None, f"fault {fault} killed pid {fault['pid']}, which the launcher did not start"
        role = events[killed_at][0]
        assert role.startswith(fault["point"].split(".")[0]), f"fault {fault} killed the {role}"
        later = events[killed_at + 1 :]
        restarted = next((i for i, (started, _, _) in enumerate(later) if started == role), None)
        assert restarted is not None, f"the launcher never restarted the {role} after fault {fault}"
        if role == "trainer":
            # Incarnations are start times in microseconds: one that started after the kill trained.
            back = any(incarnation > fault["time"] * 1e6 for incarnation in incarnations)
        else:
            back = any(ready == role for _, _, ready in later[restarted + 1 :])
        assert back, f"the {role} restarted after fault {fault} never went back to work"
        recovered += 1
    return recovered


def _audit_ledger(run: RunDir) -> tuple[int, int, int, list[dict]]:
    """(samples audited, lost, repeated, its lines) of the checkpoint lineage up to the final checkpoint.

    Lines past the final checkpoint belong to no lineage (their trainer died before checkpointing
    them). An epoch counts as finished for a producer once that producer trained two epochs past it
    (see tests/test_pipeline.assert_exactly_once for why two).
    """
    final = read_json(run.checkpoints / "latest.json")["step"]
    lines = [line for line in lineage(run) if line["step"] <= final]
    assert len(lines) == final
    triples = Counter(tuple(t) for line in lines for t in line["samples"])
    repeated = sum(n - 1 for n in triples.values() if n > 1)
    audited = lost = 0
    for producer in (0, 1):
        reached = max(e for p, e, _ in triples if p == producer)
        assert reached >= 2, f"producer {producer} only reached epoch {reached}"
        for epoch in range(reached - 1):
            expected = shard(producer, epoch)
            audited += len(expected)
            lost += len(expected - {s for p, e, s in triples if p == producer and e == epoch})
    return audited, lost, repeated, lines


def _audit_checkpoints(run: RunDir, checkpoint_kills: int, trainer_kills: int) -> None:
    leftovers = [p.name for p in run.checkpoints.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"half-written leftovers in checkpoints/: {leftovers}"
    latest = read_json(run.checkpoints / "latest.json")
    folders = sorted(p for p in run.checkpoints.glob("step-*"))
    assert folders and folders[-1].name == latest["name"]
    for folder in folders:
        state = read_json(folder / "trainer_state.json")
        assert state is not None and folder.name == f"step-{state['step']:08d}", f"{folder} is incomplete"
        assert load_file(str(folder / "drafter" / "model.safetensors")), f"{folder}: no weights"
        assert read_json(folder / "drafter" / "config.json") is not None
        assert "optimizer" in read_train_state(folder)
    # Each kill at the checkpoint point left a half-written folder for the next trainer to clean up. A kill
    # elsewhere may too: checkpoints are written in the background while training goes on.
    cleaned = run.log("trainer").read_text().count("left by a trainer killed while checkpointing")
    assert checkpoint_kills <= cleaned <= trainer_kills, (
        f"{checkpoint_kills} kills inside a checkpoint write, {trainer_kills} trainer kills, {cleaned} leftovers cleaned up"
    )


def _seed() -> int:
    seed = int(os.environ.get("DFLASH_FAULT_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"fault seed {seed} (DFLASH_FAULT_SEED={seed} repeats this plan)")
    return seed


def _report(outcome: Outcome, plan: list[Fault]) -> None:
    print(f"plan: {format_plan(plan)}")
    print(
        json.dumps(
            {
                "faults_injected": outcome.injected,
                "recovered": outcome.recovered,
                "samples_audited": outcome.audited,
                "samples_lost": outcome.lost,
                "samples_repeated": outcome.repeated,
                "steps": outcome.steps,
                "trainer_incarnations_in_lineage": outcome.trainer_incarnations,
            }
        )
    )


REACH = "import sys\nfrom common import faults\nfor i in range(int(sys.argv[2])):\n    faults.point(sys.argv[1])\n    print(i + 1, flush=True)\n"


def _reach(point: str, times: int, env: dict[str, str]) -> tuple[int, int]:
    """(exit code, times reached before it) of a process that reaches ``point`` ``times`` times."""
    out = subprocess.run(
        [sys.executable, "-c", REACH, point, str(times)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    return out.returncode, len(out.stdout.split())


def test_a_plan_is_consumed_in_order_across_processes_each_fault_once(tmp_path):
    log = tmp_path / "faults.jsonl"
    env = {**os.environ, PLAN_ENV: "producer.publish:3,producer.fill:2,producer.publish:1", LOG_ENV: str(log)}
    assert _reach("producer.fill", 5, env) == (0, 5), "not the current entry: no effect"
    assert _reach("producer.publish", 5, env) == (-signal.SIGKILL, 2), "killed on the 3rd reach"
    assert _reach("producer.publish", 5, env) == (0, 5), "that entry is spent; the next one is another point"
    assert _reach("producer.fill", 5, env) == (-signal.SIGKILL, 1)
    assert _reach("producer.publish", 5, env) == (-signal.SIGKILL, 0)
    assert _reach("producer.publish", 5, env) == (0, 5), "the plan is done"
    assert [(f["index"], f["point"], f["count"]) for f in read_log(log)] == [
        (0, "producer.publish", 3),
        (1, "producer.fill", 2),
        (2, "producer.publish", 1),
    ]
    assert _reach("producer.publish", 5, {k: v for k, v in env.items() if k != PLAN_ENV}) == (0, 5)


def test_a_point_can_kill_a_peer_and_the_killer_goes_on(tmp_path):
    log = tmp_path / "faults.jsonl"
    peer = subprocess.Popen(["sleep", "60"])
    program = f"from common import faults\nfaults.point('trainer.handshake', victim={peer.pid})\nprint('alive')\n"
    out = subprocess.run(
        [sys.executable, "-c", program],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, PLAN_ENV: "trainer.handshake:1", LOG_ENV: str(log)},
    )
    assert out.stdout.strip() == "alive", out.stderr
    assert peer.wait(timeout=10) == -signal.SIGKILL
    [fired] = read_log(log)
    assert fired["pid"] == peer.pid and fired["by"] != peer.pid


@pytest.mark.parametrize(
    "plan, message",
    [
        ("trainer.nowhere:1", "unknown fault point"),
        ("trainer.step:0", "count >= 1"),
        ("trainer.step", "count >= 1"),
        ("trainer.batch:3=-1", "seconds >= 0"),
        ("trainer.batch:3=soon", "seconds >= 0"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_entry(plan, message):
    with pytest.raises(ValueError, match=message):
        parse_plan(plan)


@pytest.mark.parametrize(
    "delays, message",
    [
        ("trainer.nowhere=1", "unknown fault point"),
        ("trainer.checkpoint=-1", "seconds >= 0"),
        ("trainer.checkpoint", "seconds >= 0"),
        ("trainer.checkpoint=soon", "seconds >= 0"),
        ("trainer.batch=1/0", "seconds >= 0"),
        ("trainer.batch=1/x", "seconds >= 0"),
    ],
)
def test_a_bad_delay_is_refused_naming_the_entry(delays, message):
    with pytest.raises(ValueError, match=message):
        parse_delays(delays)
    assert parse_delays("trainer.checkpoint=2.5, trainer.stage=0, trainer.batch=10/50") == {
        "trainer.checkpoint": Delay(2.5),
        "trainer.stage": Delay(0.0),
        "trainer.batch": Delay(10.0, every=50),
    }
    plan = parse_plan("trainer.step:7,trainer.batch:10=120")
    assert plan == [Fault("trainer.step", 7), Fault("trainer.batch", 10, hold_s=120.0)]
    assert parse_plan(format_plan(plan)) == plan


def test_a_hold_fires_once_in_the_run_and_ends_early_on_a_stop(tmp_path):
    """A plan's hold is logged and held where a kill would fire; the next process of the run does not hold again,
    and a stop ends a hold at once. A periodic delay sleeps at every N-th reach only."""
    log = tmp_path / "faults.jsonl"
    program = (
        "import time\nfrom common import faults\nstarted = time.monotonic()\n"
        "for _ in range(3):\n    faults.point('trainer.batch', stop=lambda: time.monotonic() - started > 1.0)\n"
        "print(round(time.monotonic() - started, 1))\n"
    )

    def held_s(env: dict[str, str]) -> float:
        out = subprocess.run(
            [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env
        )
        assert out.returncode == 0, out.stderr
        return float(out.stdout)

    env = {**os.environ, PLAN_ENV: "trainer.batch:2=60", LOG_ENV: str(log)}
    assert 1.0 <= held_s(env) < 10, "held at the second reach until the stop, not for 60 s"
    assert [(f["point"], f["count"], f["hold_s"]) for f in read_log(log)] == [("trainer.batch", 2, 60.0)]
    assert held_s(env) < 0.5, "a successor does not hold again"
    assert 0.5 <= held_s({**os.environ, DELAY_ENV: "trainer.batch=0.5/2"}) < 1.0, "one sleep: the second reach of 3"


@pytest.fixture
def run_dir(short_tmp) -> Path:
    return short_tmp / "run"


def test_kill9_at_three_trainer_points_and_one_producer_point_recovers_exactly_once(run_dir):
    rng = random.Random(_seed())
    # The producer's kill first: its replacement loads its target while the trainer is killed.
    plan = [Fault(p, rng.randint(*COUNTS[p])) for p in [rng.choice(PRODUCER_POINTS)] + rng.sample(TRAINER_POINTS, 3)]
    outcome = run_plan(run_dir, plan, epochs_after=1, timeout_s=240)
    _report(outcome, plan)
    assert (outcome.injected, outcome.recovered, outcome.lost, outcome.repeated) == (4, 4, 0, 0)


@pytest.mark.faults
@pytest.mark.timeout(3600)
def test_kill9_trainer_20_times_and_producers_10_times_recovers_exactly_once(run_dir):
    rng = random.Random(_seed())
    plan = make_plan(rng, trainer_kills=20, producer_kills=10)
    outcome = run_plan(run_dir, plan, epochs_after=1, timeout_s=3000)
    _report(outcome, plan)
    assert (outcome.injected, outcome.recovered, outcome.lost, outcome.repeated) == (30, 30, 0, 0)

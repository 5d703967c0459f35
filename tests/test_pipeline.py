"""The whole pipeline on CPU through launch/run_all.sh: real producers, trainer, supervisor.

Each test runs a small synthetic epoch (2 producers) and audits the sample ledger: in the
checkpoint lineage (for every step, the line of the latest trainer incarnation) every sample of
epoch 0 appears exactly once, and nothing appears twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from peers import child_pids, parent_pid, wait_for
from wandb_log import history

from common.faults import LOG_ENV, PLAN_ENV
from common.rundir import RunDir, read_json
from common.status import ProducerStatus
from producer.data.order import OrderConfig, ShardOrder

ROOT = Path(__file__).resolve().parents[1]
NUM_SAMPLES = 160
SMALL = [
    f"data.num_samples={NUM_SAMPLES}",
    "data.mean_len=48",
    "data.min_len=16",
    "data.max_seq_len=256",
    "batching.token_budget=512",
    "batching.window_docs=32",
    "drafter.num_anchors=32",
    "training.checkpoint_every=8",
    "logging.log_every=4",
    "ring.heartbeat_interval_s=0.25",
    "ring.heartbeat_timeout_s=2.0",
    "launch.restart_backoff_s=0.5",
    "launch.standby_trainer_after_s=600",  # no standby trainer's imports on these 2 cores, but where a test asks
    # No wandb service beside each trainer (seconds of CPU at its start and stop), but where a test asks.
    "logging.wandb_mode=disabled",
    # No evaluation, but where a test asks (eval.every_steps=N after these): tiny.toml's every 300 steps had producer 0
    # of every run without a step limit make the evaluation's reference (16 greedy continuations, 3 s of CPU on each
    # start) for evaluations that never came.
    "eval.every_steps=0",
]
# wandb as a run has it by default: where a test reads wandb's files, and in one kill -9 and one restart-trainer
# test, so that a trainer resuming its wandb run after either stays covered.
WANDB = "logging.wandb_mode=offline"
# One producer, for a test whose guarantee is not about two (a kind's run, a run that must stop at once, a trainer's
# fault): each producer start is about 5 s of CPU (torch, transformers with torch._dynamo, the target, its warm-up).
# The guarantees of two producers (both feed the trainer, a kill -9 of one, exactly once across shards) are this
# file's and test_faults.py's.
ONE_PRODUCER = ("launch.num_producers=1", 'launch.producer_devices=["cpu"]')


def held_at_batch(fault_log: Path, batch: int) -> dict[str, str]:
    """An environment whose first trainer holds its ``batch``-th batch (up to 120 s, until it is stopped), so that
    restart-trainer replaces it there whatever the machine's speed; the hold fires once in the run."""
    return {**os.environ, PLAN_ENV: f"trainer.batch:{batch}=120", LOG_ENV: str(fault_log)}


def wait_held(fault_log: Path) -> None:
    wait_for(lambda: fault_log.exists() and fault_log.read_text().strip() != "", "the first trainer's hold", 120)


def run_all(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def start(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The launcher on the small config, its output in launcher.out beside the run; ``env``: its environment
    (a fault plan), else this one's."""
    log = open(run_dir.parent / "launcher.out", "w")
    return subprocess.Popen(
        [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run_dir), *SMALL, *overrides],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def trainer_step(run: RunDir) -> int:
    return (read_json(run.trainer_status) or {}).get("step", 0)


def producer_pids(run: RunDir) -> dict[int, int]:
    return {s.id: s.pid for s in ProducerStatus.read_all(run)}


def finish(launcher: subprocess.Popen, run_dir: Path, timeout: float = 240.0) -> None:
    """Wait for the launcher's exit 0; on another code or a timeout, fail with the run's logs."""
    try:
        code = launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = f"still running after {timeout} s"
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=60)
    output = (run_dir.parent / "launcher.out").read_text()
    logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-2500:] for p in sorted((run_dir / "logs").glob("*.log")))
    assert code == 0, f"launcher: {code}\n" + output[-3000:] + logs


def stop_and_finish(launcher: subprocess.Popen, run_dir: Path) -> None:
    """``run_all.sh stop``, then the launcher's clean exit (see ``finish``)."""
    stopped = run_all("stop", "--run-dir", str(run_dir))
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    finish(launcher, run_dir, timeout=120)


def kill_producer_until_back(run: RunDir, producer: int) -> dict[int, int]:
    """kill -9 of ``producer``; returns once the launcher's replacement says ready. The pids before."""
    before = producer_pids(run)
    os.kill(before[producer], signal.SIGKILL)
    wait_for(
        lambda: (
            producer_pids(run).get(producer) not in (None, before[producer])
            and (read_json(run.producer_status(producer)) or {}).get("ready")
        ),
        f"producer {producer} restarted",
        120,
    )
    return before


def lineage(run: RunDir) -> list[dict]:
    """For each step, the ledger line of the latest incarnation that wrote it."""
    by_step: dict[int, dict] = {}
    for line in run.ledger.read_text().splitlines():
        record = json.loads(line)
        current = by_step.get(record["step"])
        if current is None or record["incarnation"] >= current["incarnation"]:
            by_step[record["step"]] = record
    steps = sorted(by_step)
    assert steps == list(range(1, len(steps) + 1)), "the lineage has a line for every step"
    return [by_step[s] for s in steps]


def epochs_trained(run: RunDir, since_incarnation: float = 0.0) -> dict[int, int]:
    """Per producer, the highest epoch in ledger lines of trainer incarnations that started after
    ``since_incarnation`` (incarnations are start times in microseconds)."""
    try:
        lines = run.ledger.read_text().splitlines()
    except FileNotFoundError:
        return {}
    reached: dict[int, int] = {}
    for line in lines:
        if not line.endswith("}"):
            continue  # being written
        record = json.loads(line)
        if record["incarnation"] > since_incarnation:
            for producer, epoch, _ in record["samples"]:
                reached[producer] = max(reached.get(producer, -1), epoch)
    return reached


def every_producer_reached(run: RunDir, epoch: int, since_incarnation: float = 0.0, producers: int = 2) -> bool:
    """Whether each of ``producers`` producers has a sample of ``epoch`` or later in ledger lines of incarnations
    after ``since_incarnation``. One read of the ledger: two reads race the trainer, and a first one that holds
    only producer 1 at epoch 2 with a second that adds producer 0's first line of epoch 1 passed as both."""
    reached = epochs_trained(run, since_incarnation)
    return len(reached) == producers and min(reached.values()) >= epoch


def shard(producer: int, epoch: int) -> set[int]:
    order = ShardOrder(NUM_SAMPLES, OrderConfig(seed=0, num_shards=2, shard_index=producer))
    return {int(i) for i in order.epoch_ids(epoch)}


def assert_exactly_once(run: RunDir, must_reach: set[int] | None = None) -> Counter:
    """Nothing trained twice, and every producer that reached epoch 2 delivered all of its epoch 0.

    Why epoch 2: after a trainer restart, batches a producer already had in its ring (possibly of
    epoch 1) are served before the recomputed ones, so a run that stops just past an epoch boundary
    may legitimately still owe a few. A producer is never more than its ring, the trainer's credits
    and staging queue ahead (10 batches here, less than an epoch), so once it trains epoch 2
    anything of epoch 0 still missing was lost.
    """
    lines = lineage(run)
    triples = Counter(tuple(t) for line in lines for t in line["samples"])
    repeated = [t for t, n in triples.items() if n > 1]
    assert not repeated, f"trained twice: {repeated[:5]}"
    reached = {p for (p, epoch, _) in triples if epoch >= 2}
    # The trainer takes from whichever producer has a batch ready, so shards need not advance evenly.
    assert reached >= (must_reach or set()) and reached, f"only producers {sorted(reached)} reached epoch 2"
    for producer in reached:
        got = {sample for (p, epoch, sample) in triples if p == producer and epoch == 0}
        missing = shard(producer, 0) - got
        assert not missing, f"producer {producer}: {len(missing)} samples of epoch 0 never trained"
    return Counter(line["incarnation"] for line in lines)


@pytest.fixture
def run_dir(short_tmp) -> Path:
    return short_tmp / "run"


def test_every_producer_reached_reads_the_ledger_once(tmp_path):
    """The trainer appends between two reads: a wait that read the ledger twice saw producer 1 alone at epoch 2
    in the first and producer 0 at epoch 1 joining in the second, and passed as though both were at epoch 2."""

    def line(step: int, producer: int, epoch: int) -> str:
        return json.dumps({"step": step, "incarnation": 1, "samples": [[producer, epoch, step]], "batches": []}) + "\n"

    class GrowingRun(RunDir):
        """Each read of the ledger finds one more line, as a trainer appends them."""

        reads = 0

        @property
        def ledger(self) -> Path:
            self.reads += 1
            path = self.root / f"ledger-{self.reads}.jsonl"
            path.write_text(line(1, 1, 2) + line(2, 0, 1) * (self.reads > 1))
            return path

    run = GrowingRun(tmp_path)
    assert not every_producer_reached(run, 2)
    assert run.reads == 1
    both = RunDir(tmp_path)
    both.ledger.write_text(line(1, 1, 2) + line(2, 0, 3))
    assert every_producer_reached(both, 2) and not every_producer_reached(both, 3)
    assert not every_producer_reached(both, 2, since_incarnation=1)


def test_end_to_end_two_producers_learns_and_logs_ring_occupancy(run_dir):
    profiled = ("logging.profile_steps=3", "logging.profile_after=40")  # steps 41-43: no log line, no checkpoint
    launcher = start(run_dir, "training.max_steps=60", "training.checkpoint_every=20", WANDB, *profiled)
    finish(launcher, run_dir)
    run = RunDir(run_dir)
    assert read_json(run.trainer_status)["state"] == "finished"
    assert (run.checkpoints / "step-00000060" / "drafter" / "model.safetensors").is_file()
    # No tokenizer next to a random target: the mask is the last id, which the data never holds.
    exported = json.loads((run.checkpoints / "step-00000060" / "drafter" / "config.json").read_text())
    assert (
        exported["dflash_config"]["mask_token_id"]
        == json.loads((run.target_head / "config.json").read_text())["vocab_size"] - 1
    )
    assert len(list(run.checkpoints.glob("step-*"))) == 2  # keep_last = 2 in tiny.toml
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert metrics[-1]["step"] == 60 and all(f"ring/{p}/free" in metrics[-1] for p in (0, 1))
    # The checkpoints of steps 20 and 40 are taken after that step's metrics line: each stands in the window
    # logged next. The last one, at 60, comes after the last window.
    windows = [m for m in metrics if "steps_per_s" in m]
    holding = {min(m["step"] for m in windows if m["step"] > c) for c in (20, 40)}
    assert {m["step"] for m in windows if m["checkpoint_fraction"] > 0} == holding
    assert all(m["checkpoint_fraction"] < 1 for m in windows)
    rows = history(run_dir)
    assert rows and all("ring/0/ready" in row and "ring/1/leased" in row for row in rows), "wandb holds the ring series"
    assert {
        "train/loss",
        "train/tau",
        "producer/0/tokens_per_s",
        "train/starved_fraction",
        "train/checkpoint_fraction",
    } <= set(rows[-1])
    lines = lineage(run)
    assert len(lines) == 60 and {p for line in lines for p, _, _ in line["samples"]} == {0, 1}
    # The run's own profile of three steady steps (logging.profile_steps): its summary, its tables, its log line.
    profiled = (run.logs / "trainer-profile.txt").read_text()
    summary = json.loads(profiled.split("\n\n")[0])
    assert summary["name"] == "steps 41-43" and summary["steps"] == 3 and summary["aten_ops_per_step"] > 100
    assert "aten::mm" in profiled and "By calls:" in profiled
    assert "profiled steps 41-43: " in run.log("trainer").read_text()


def test_kill9_trainer_resumes_without_reloading_targets_exactly_once(run_dir):
    launcher = start(run_dir, "training.max_steps=0", "training.epochs=3", WANDB)
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 12, "step 12", 120)
    producers = producer_pids(run)
    victim = read_json(run.trainer_status)["pid"]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: (read_json(run.trainer_status) or {}).get("pid") not in (None, victim), "a new trainer", 120)
    finish(launcher, run_dir)
    assert producer_pids(run) == producers, "targets were not reloaded"
    incarnations = assert_exactly_once(run)
    assert len(incarnations) == 2
    assert read_json(run.trainer_status)["state"] == "finished"


def test_restart_trainer_with_a_new_learning_rate(run_dir):
    # The first trainer holds its tenth batch, so that restart-trainer replaces it there whatever the machine's
    # speed: waiting for step 10 and restarting raced the end of the 48 steps.
    fault_log = run_dir.parent / "faults.jsonl"
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=3",
        "training.lr=1e-3",
        "training.warmup_ratio=0.0",
        "training.min_lr_ratio=1.0",
        WANDB,
        env=held_at_batch(fault_log, 10),
    )
    run = RunDir(run_dir)
    wait_held(fault_log)
    producers = producer_pids(run)
    answer = run_all("restart-trainer", "--run-dir", str(run_dir), "training.lr=2e-4")
    assert answer.returncode == 0, answer.stdout + answer.stderr
    refused = run_all("restart-trainer", "--run-dir", str(run_dir), "drafter.num_layers=3")
    assert refused.returncode == 2 and "drafter.num_layers" in refused.stdout + refused.stderr
    finish(launcher, run_dir)
    assert producer_pids(run) == producers
    assert_exactly_once(run)
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    rates = {round(m["lr"], 8) for m in metrics}
    assert rates == {1e-3, 2e-4}, rates  # constant schedule: the old rate, then the new one
    assert metrics[-1]["lr"] == pytest.approx(2e-4)


def test_kill9_producer_trainer_keeps_going_and_shard_resumes(run_dir):
    # No step limit: the run is stopped once the restarted producer 0 has delivered epoch 2 (a fixed
    # length could end while its replacement still loads its target). Metrics every 2 steps, so the
    # seconds producer 0 is down show in them even when steps are slow.
    launcher = start(
        run_dir, "training.max_steps=0", "training.epochs=1000", "training.checkpoint_every=50", "logging.log_every=2"
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 120)
    killed_at_step = trainer_step(run)
    before = kill_producer_until_back(run, 0)
    wait_for(lambda: epochs_trained(run).get(0, -1) >= 2, "producer 0's epoch 2 trained", 180)
    stop_and_finish(launcher, run_dir)
    after = producer_pids(run)
    assert after[1] == before[1] and after[0] != before[0]
    assert_exactly_once(run, must_reach={0})
    assert trainer_step(run) > killed_at_step
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any(m.get("producer/0/up") == 0 for m in metrics), "the trainer reported producer 0 down and kept training"


def test_two_ranks_two_producers_kill9_of_each_exactly_once(run_dir):
    """A 2-rank trainer (DDP over gloo) on 2 producers: every rank takes from both producers, both
    producers serve both ranks. kill -9 of a producer and then of the trainer: nothing trained twice,
    nothing of an epoch lost. The restarted producer hears HELLOs from ranks that had received
    different batches; the ranks' agreement before each step drops any batch served twice.

    The run has no step limit and is stopped once the restarted trainer trained epoch 2 of both
    producers: a fixed length raced the restarted producer's load on a fast machine."""
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=1000",
        "training.checkpoint_every=10",
        'launch.trainer_devices=["cpu", "cpu"]',
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 180)
    kill_producer_until_back(run, 1)
    step = trainer_step(run)
    wait_for(lambda: trainer_step(run) >= step + 4, "training after the producer came back", 120)
    trainer_pid = read_json(run.trainer_status)["pid"]
    killed_at_us = time.time() * 1e6
    os.kill(trainer_pid, signal.SIGKILL)  # rank 0; torchrun takes rank 1 down, the supervisor restarts both
    wait_for(
        lambda: every_producer_reached(run, 2, since_incarnation=killed_at_us),
        "the restarted trainer to train epoch 2 of both producers",
        240,
    )
    stop_and_finish(launcher, run_dir)
    lines = lineage(run)
    assert all(len({tuple(b) for b in line["batches"]}) == 2 for line in lines), "each step trains two distinct batches"
    assert len({p for line in lines for p, _ in line["batches"]}) == 2
    incarnations = assert_exactly_once(run, must_reach={0, 1})
    assert len(incarnations) >= 2, "the trainer was restarted"


def test_a_stop_that_reaches_one_rank_stops_every_rank_after_the_same_step(run_dir):
    """SIGTERM to rank 1 of a 2-rank trainer alone (a signal reaches the ranks at different steps): both ranks stop
    after the same step at once, and the launcher starts a new trainer that goes on exactly once. A rank that left
    its loop on its own flag waited in the checkpoint's barrier while the other waited in the next step's agreement,
    until torchrun ended both about a minute later."""
    launcher = start(run_dir, "training.max_steps=0", "training.epochs=1000", 'launch.trainer_devices=["cpu", "cpu"]')
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 180)
    rank0 = read_json(run.trainer_status)["pid"]
    (rank1,) = set(child_pids(parent_pid(rank0))) - {rank0}  # torchrun's other rank
    os.kill(rank1, signal.SIGTERM)
    log = run_dir / "logs" / "trainer.log"
    wait_for(lambda: log.read_text().count("trainer stopped at step") == 2, "both ranks stopped", 20)
    steps = {line.split("trainer stopped at step ")[1] for line in log.read_text().splitlines() if "stopped at" in line}
    assert len(steps) == 1, steps
    wait_for(lambda: (read_json(run.trainer_status) or {}).get("pid") not in (None, rank0), "a new trainer", 120)
    step = trainer_step(run)
    wait_for(lambda: trainer_step(run) >= step + 4, "training after the stop", 120)
    stop_and_finish(launcher, run_dir)
    assert_exactly_once(run)


def test_a_hung_producer_does_not_slow_training_on_the_other(run_dir):
    """SIGSTOP of a producer (a hung process that still looks ready): the trainer drops its link
    after the heartbeat timeout and keeps a normal pace on the other producer while its HELLOs to
    the hung one go unanswered; after SIGCONT it takes that producer back, exactly once."""
    launcher = start(run_dir, "training.max_steps=0", "training.epochs=1000", "training.checkpoint_every=20")
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 120)
    hung = producer_pids(run)[0]
    os.kill(hung, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        wait_for(lambda: time.time() > stopped_at + 12, "12 s", 30)
    finally:
        os.kill(hung, signal.SIGCONT)
    resumed_at = time.time()
    times = [json.loads(line)["time"] for line in run.ledger.read_text().splitlines() if line.endswith("}")]
    during = [t for t in times if stopped_at + 4 < t < resumed_at]  # past the 2 s heartbeat timeout
    assert len(during) >= 5, f"only {len(during)} steps in the 8 s with one producer hung"
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert max(gaps) < 6.0, f"training paused {max(gaps):.1f}s while a producer was hung"

    def trained_from_hung_after_resume() -> bool:
        return any(
            p == 0
            for line in run.ledger.read_text().splitlines()
            if line.endswith("}")
            for p, _ in json.loads(line)["batches"]
            if json.loads(line)["time"] > resumed_at
        )

    wait_for(trained_from_hung_after_resume, "a batch of the resumed producer trained", 90)
    wait_for(
        lambda: every_producer_reached(run, 2),
        "both producers at epoch 2",
        180,
    )
    stop_and_finish(launcher, run_dir)
    # A replaced producer is the launcher's doing or the producer's crash: their logs say which.
    why = (run.logs / "launcher.log").read_text()[-3000:] + (run.logs / "producer-0.log").read_text()[-4000:]
    assert producer_pids(run)[0] == hung, f"the hung producer was not replaced:\n{why}"
    assert_exactly_once(run, must_reach={0, 1})


def test_a_hung_trainer_goes_on_exactly_once_after_sigcont(run_dir):
    """SIGSTOP of the trainer for several heartbeat timeouts: the producers take its leases back and
    hand those batches out again; after SIGCONT the same trainer (no restart) reconnects, drops what
    it had already received, and trains on: nothing twice, nothing lost."""
    launcher = start(run_dir, "training.max_steps=0", "training.epochs=1000", "training.checkpoint_every=20")
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 120)
    trainer = read_json(run.trainer_status)["pid"]
    os.kill(trainer, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        # Hung for 3 heartbeat timeouts (2 s each) at least, and until the producers took its leases back.
        wait_for(
            lambda: (
                time.monotonic() > stopped_at + 6.0
                and sum(s.server.get("reclaimed", 0) for s in ProducerStatus.read_all(run)) > 0
            ),
            "the producers to take the hung trainer's leases back",
            60,
        )
    finally:
        os.kill(trainer, signal.SIGCONT)
    step = trainer_step(run)
    wait_for(lambda: trainer_step(run) >= step + 20, "training after SIGCONT", 120)
    wait_for(
        lambda: every_producer_reached(run, 2),
        "both producers at epoch 2",
        180,
    )
    stop_and_finish(launcher, run_dir)
    incarnations = assert_exactly_once(run, must_reach={0, 1})
    assert len(incarnations) == 1, "the hung trainer went on itself; the launcher did not replace it"
    assert sum(s.server.get("reclaimed", 0) for s in ProducerStatus.read_all(run)) > 0, (
        "the producers took its leases back"
    )

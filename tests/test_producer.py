"""The producer process: real target, real ring, real sockets; exactly-once replay at HELLO."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from common.config import load_config, save_config
from common.naming import SHM_DIR
from common.rundir import RunDir, read_json
from common.transport import HandshakeRefused, RingClient
from producer.target_model.load import load_target_model

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [
    "data.num_samples=60",
    "data.mean_len=48",
    "data.min_len=8",
    "data.max_seq_len=128",
    "batching.token_budget=256",
    "batching.window_docs=16",
    "launch.num_producers=1",
    "ring.num_slots=3",
    "ring.heartbeat_interval_s=0.2",
    "ring.heartbeat_timeout_s=2.0",
    "training.label_mode=\"target_hard\"",
    # No evaluation: with tiny.toml's (every 300 of 1,200 steps) producer 0 made the evaluation's reference whenever
    # its ring was full, 3 s of CPU per start, for a trainer that never asks.
    "eval.every_steps=0",
]


def start_producer(
    run_dir: RunDir, producer_id: int = 0, module: tuple[str, ...] = ("producer.server",)
) -> subprocess.Popen:
    """A producer process, ready; ``module``: what ``python -m`` runs (a wrapper may come before producer.server)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *module, "--run-dir", str(run_dir.root), "--producer-id", str(producer_id)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = read_json(run_dir.producer_status(producer_id))
        if status and status.get("ready") and status.get("pid") == proc.pid:
            return proc
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read())
        time.sleep(0.1)
    raise AssertionError("producer not ready")


@pytest.fixture
def run_dir(short_tmp):
    cfg = load_config(ROOT / "launch" / "tiny.toml", OVERRIDES)
    root = RunDir(short_tmp / "run")
    root.root.mkdir()
    save_config(cfg, root.config)
    return root


def receive(client: RingClient, count: int, timeout: float = 60.0) -> list[dict]:
    """Exactly ``count`` deliveries, each acked; one poll can bring two (two credits are out), and the
    one past ``count`` stays leased, unacked, as a consumer that stopped there would leave it."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        for delivery in client.poll(timeout_s=0.1):
            if len(got) == count:
                break
            got.append({"meta": delivery.meta, "tensors": {k: v.clone() for k, v in delivery.tensors.items()}})
            client.ack(delivery)
            client.grant(1)
    assert len(got) == count, f"received {len(got)} of {count}"
    return got


def test_features_match_a_plain_forward_and_shutdown_is_clean(run_dir):
    proc = start_producer(run_dir)
    status = read_json(run_dir.producer_status(0))
    client = RingClient(status["endpoint"], "trainer/r0", 1, credits=2)
    welcome = client.connect(10)
    layer_ids = welcome.describe["layer_ids"]
    assert layer_ids == [1, 3]  # 6 target layers, 2 draft layers: round(1 + i * (6 - 4) / 1)
    batches = receive(client, 3)
    client.close()

    model = load_target_model(load_config(run_dir.config).target)  # same config and seed: same weights
    for batch in batches:
        t = batch["tensors"]
        cu = t["cu_seqlens"].tolist()
        assert t["input_ids"].numel() == cu[-1] and t["sample_ids"].numel() == len(cu) - 1  # packed, no padding
        assert batch["meta"]["tokens"] == cu[-1]
        for start, end in zip(cu[:-1], cu[1:]):
            ids = t["input_ids"][start:end].long().unsqueeze(0)
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            want = torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1)
            torch.testing.assert_close(t["aux_hidden"][start:end], want, rtol=1e-4, atol=1e-4)
            last = model.model.norm  # hidden_states[-1] is after the final norm; the ring ships it before
            torch.testing.assert_close(
                last(t["last_hidden"][start:end]), out.hidden_states[-1][0], rtol=1e-4, atol=1e-4
            )
    assert (run_dir.target_head / "model.safetensors").is_file()

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not [p for p in SHM_DIR.iterdir() if f".{proc.pid}-" in p.name]
    assert not list(run_dir.sockets.glob(f"p0.{proc.pid}-*"))


def test_mismatched_trainer_is_refused_with_the_reason(run_dir):
    proc = start_producer(run_dir)
    status = read_json(run_dir.producer_status(0))
    try:
        for expect, word in [
            ({"target_identity": "qwen3-other"}, "target_identity"),
            ({"layer_ids": [0, 1]}, "layer_ids"),
            ({"dtype": "bfloat16"}, "dtype"),
            ({"last_hidden": False}, "last_hidden"),
        ]:
            client = RingClient(status["endpoint"], "trainer/r0", 1, expect=expect)
            with pytest.raises(HandshakeRefused, match=word):
                client.connect(10)
            client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_new_incarnation_gets_uncommitted_batches_recomputed(run_dir):
    proc = start_producer(run_dir)
    endpoint = read_json(run_dir.producer_status(0))["endpoint"]
    try:
        first = RingClient(endpoint, "trainer/r0", 1, credits=2)
        first.connect(10)
        seen = receive(first, 6)
        first.close()  # consumed and acked 0..5; suppose its checkpoint committed only 0..1
        by_ordinal = {b["meta"]["ordinal"]: b for b in seen}
        assert sorted(by_ordinal) == list(range(6))
        committed = {"ordinal": 2, "last_cursor": by_ordinal[1]["meta"]["cursor"], "extra": [4]}
        second = RingClient(endpoint, "trainer/r0", 2, credits=2, committed=committed)
        second.connect(10)
        again = receive(second, 8)
        second.close()
        ordinals = [b["meta"]["ordinal"] for b in again]
        assert len(set(ordinals)) == len(ordinals), "nothing served twice"
        assert not {0, 1, 4} & set(ordinals), "committed batches are not served again"
        assert {2, 3, 5} <= set(ordinals), "batches consumed after the checkpoint come back"
        for b in again:
            o = b["meta"]["ordinal"]
            if o in by_ordinal:  # recomputed: same documents, same features
                assert torch.equal(b["tensors"]["sample_ids"], by_ordinal[o]["tensors"]["sample_ids"])
                torch.testing.assert_close(b["tensors"]["aux_hidden"], by_ordinal[o]["tensors"]["aux_hidden"])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_feeder_with_a_full_queue_loses_no_batch(run_dir):
    """A slow trainer keeps its staging queue full; batches arriving meanwhile must wait in the
    socket, not be taken off it and forgotten (they would stay leased and never be trained)."""
    from trainer.feeder import Commits, Feeder

    proc = start_producer(run_dir)
    feeder = Feeder(
        run_dir,
        consumer_id="trainer/r0",
        incarnation=1,
        expect={},
        commits=Commits(),
        device=torch.device("cpu"),
        credits=2,
        heartbeat_interval_s=0.2,
        handshake_timeout_s=10,
        depth=1,
    )
    try:
        feeder.start()
        ordinals = []
        while len(ordinals) < 10:
            received = feeder.get(timeout=30)
            assert received is not None, f"stalled after {ordinals}"
            ordinals.append(received.ordinal)
            time.sleep(0.3)  # a slow step: the queue refills and more batches arrive meanwhile
        assert ordinals == list(range(10))
    finally:
        feeder.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_headroom_stays_free_while_the_consumer_takes_and_fills_when_it_pauses(short_tmp):
    cfg = load_config(
        ROOT / "launch" / "tiny.toml",
        OVERRIDES + ["ring.num_slots=6", "ring.headroom_slots=3", "ring.pause_detect_s=1.0"],
    )
    run = RunDir(short_tmp / "run")
    run.root.mkdir()
    save_config(cfg, run.config)
    proc = start_producer(run)

    def free() -> int:
        return read_json(run.producer_status(0))["ring"]["free"]

    try:
        deadline = time.monotonic() + 60
        while free() != 0:  # no consumer yet: a new trainer must find a full ring
            assert time.monotonic() < deadline, "the ring never filled without a consumer"
            time.sleep(0.1)
        client = RingClient(read_json(run.producer_status(0))["endpoint"], "trainer/r0", 1, credits=1)
        client.connect(10)
        # A consumer slower than the producer (one batch per 0.3 s): without headroom the ring would
        # stay full; with it the producer keeps 3 slots free once the backlog is drained.
        seen_free = []
        until = time.monotonic() + 9.0
        while time.monotonic() < until:
            for delivery in client.poll(timeout_s=0.3):
                client.ack(delivery, grant=1)
            seen_free.append(client.producer_stats.get("ring", {}).get("free", -1))
        steady = seen_free[len(seen_free) // 2 :]
        assert min(steady) >= 3 and max(seen_free) >= 3, seen_free
        # The consumer pauses (it holds its credit but takes nothing): the headroom fills.
        deadline = time.monotonic() + 20
        while True:
            client.keepalive()
            if free() == 0:
                break
            assert time.monotonic() < deadline, "the headroom was not filled during the pause"
            time.sleep(0.1)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0

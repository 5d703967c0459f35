"""Producers on other hosts: payload as ZeroMQ frames over tcp with CURVE, on loopback.

Real processes and sockets: a producer process reachable only over tcp serving a frames consumer
(every batch checked bit for bit against its recomputation), the run's keys required, malformed
multipart messages dropped by the client, and a whole run training from one local producer and one
remote producer (killed and restarted on its "host" meanwhile) with an exactly-once ledger.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (the helper producer below), not by pytest
    sys.path.insert(0, str(ROOT))

from common.codec import ALIGN, TensorSpec, write_tensors  # noqa: E402
from common.config import ConfigError, load_config, save_config  # noqa: E402
from common.protocol import Batch, Heartbeat, Hello, Welcome, decode, payload_bytes  # noqa: E402
from common.ring import HostRing  # noqa: E402
from common.rundir import RunDir, read_json  # noqa: E402
from common.sockets import CurveKeys, ipc_endpoint, make_socket, run_keys, start_authenticator  # noqa: E402
from common.transport import HandshakeRefused, HandshakeTimeout, RingClient, RingServer  # noqa: E402
from launch.tools.demo import checksum, make_batch  # noqa: E402

SEED = 5
SLOT_BYTES = 256 * 1024  # batches of up to 128 KiB: some below pyzmq's copy threshold (64 KiB), some above


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- a producer process that serves only tcp -------------------------------------------------------


def serve(endpoint: str, keys_path: str) -> None:
    """Publish batch i = make_batch(SEED, i) with its CRC, for i = 0, 1, ... until SIGTERM."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    ring = HostRing.create("remote-test", "p0", num_slots=3, slot_bytes=SLOT_BYTES)
    server = RingServer(
        endpoint, ring, heartbeat_interval_s=0.2, heartbeat_timeout_s=3.0, curve=CurveKeys.load(Path(keys_path))
    )
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    server.start()
    print(json.dumps({"event": "ready"}), flush=True)
    index = 0
    try:
        while not stop:
            slot = server.acquire(timeout_s=0.2)
            if slot is None:
                continue
            tensors = make_batch(SEED, index, SLOT_BYTES // 2)
            server.publish(
                slot, write_tensors(server.slot_view(slot), tensors), {"index": index, "crc": checksum(tensors)}
            )
            index += 1
    finally:
        server.close()
        ring.close()


@pytest.fixture
def tcp_producer(short_tmp):
    """(endpoint, keys, process, log file) of a ``serve`` process bound to loopback tcp only."""
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    log_path = short_tmp / "producer.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [sys.executable, __file__, "serve", endpoint, str(short_tmp / "secrets" / "curve.json")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    assert json.loads(proc.stdout.readline())["event"] == "ready", log_path.read_text()
    yield endpoint, keys, proc, log_path
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]


def _take(client: RingClient, count: int, timeout_s: float = 30.0) -> list[int]:
    """Receive at least ``count`` batches, each checked against its recomputation; their indices in order."""
    indices = []
    deadline = time.monotonic() + timeout_s
    while len(indices) < count:
        assert time.monotonic() < deadline, f"received {len(indices)} of {count}"
        for delivery in client.poll(timeout_s=0.05):
            index = delivery.meta["index"]
            got = checksum(delivery.tensors)
            assert got == delivery.meta["crc"] == checksum(make_batch(SEED, index, SLOT_BYTES // 2)), (
                f"batch {index} differs"
            )
            indices.append(index)
            client.ack(delivery, grant=1)
    return indices


def test_frames_over_tcp_carry_every_batch_bit_for_bit(tcp_producer):
    endpoint, keys, _, _ = tcp_producer
    remote = RingClient(endpoint, "remote/r0", 1, credits=2, curve=keys, payload="frames")
    welcome = remote.connect(timeout_s=20)
    assert welcome.ring == {"backend": "frames", "num_slots": 3, "slot_bytes": SLOT_BYTES}, (
        "no segment named to a remote host"
    )
    assert remote.ring is None, "a frames consumer maps no ring"
    first = _take(remote, 60)
    remote.close()
    assert first == list(range(len(first))), "every batch once, in order"
    assert remote.dropped_malformed == 0

    # A consumer on the producer's host reads the same ring in place through the same tcp socket.
    local = RingClient(endpoint, "local/r0", 1, credits=2, curve=keys)
    assert local.connect(timeout_s=20).ring["backend"] == "host"
    after = _take(local, 20)
    local.close()
    assert after == list(range(len(first), len(first) + len(after))) and local.dropped_malformed == 0


def test_only_the_run_keys_get_in_and_the_producer_keeps_serving(tcp_producer):
    endpoint, keys, _, log_path = tcp_producer
    good = RingClient(endpoint, "trainer/r0", 1, credits=2, curve=keys, payload="frames")
    good.connect(timeout_s=20)
    before = _take(good, 5)
    assert before == list(range(len(before)))
    stranger = CurveKeys.generate()
    wrong_client = RingClient(
        endpoint,
        "intruder",
        2,
        curve=CurveKeys(keys.server_public, b"", stranger.client_public, stranger.client_secret),
        payload="frames",
    )
    with pytest.raises(HandshakeTimeout):
        wrong_client.connect(timeout_s=1.5)
    wrong_client.close()
    # Had its HELLO (incarnation 2) got through, the good consumer's leases would now be superseded.
    after = _take(good, 10)
    assert after == list(range(len(before), len(before) + len(after))), "the run's own consumer is still served"
    good.close()
    assert "refused a tcp client whose CURVE key is not the run's client key" in log_path.read_text()


# -- the client against a hostile producer ------------------------------------------------------------


class _FakeProducer:
    """A ROUTER speaking the protocol by hand over tcp + CURVE, to send what no RingServer sends."""

    def __init__(self, keys: CurveKeys) -> None:
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, keys)
        self.endpoint = f"tcp://127.0.0.1:{_free_port()}"
        self.sock = make_socket(self.ctx, zmq.ROUTER, bind=self.endpoint, curve=keys)
        self.peer = b""

    def welcome(self, ring: dict) -> Hello:
        """Answer the next HELLO (skipping other messages, e.g. a previous client's BYE)."""
        while True:
            assert self.sock.poll(20_000), "no HELLO"
            self.peer, frame = self.sock.recv_multipart()
            hello = decode(frame)
            if isinstance(hello, Hello):
                break
        self.send(
            Welcome(
                producer_id=0, pid=1, ring=ring, describe={}, heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0
            ).encode()
        )
        return hello

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def acks(self) -> list[tuple[int, int, int]]:
        got = []
        while self.sock.poll(200):
            message = decode(self.sock.recv_multipart()[1])
            if message.TYPE == "ack":
                got.append((message.slot, message.generation, message.credit))
        return got

    def close(self) -> None:
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


def _batch(slot: int, generation: int, layout: list[TensorSpec]) -> bytes:
    return Batch(
        slot=slot, generation=generation, seq=generation, layout=tuple(layout), meta={"n": generation}
    ).encode()


def _poll_until(client: RingClient, dropped: int) -> list:
    got = []
    deadline = time.monotonic() + 10
    while client.dropped_malformed < dropped or not got:
        assert time.monotonic() < deadline, f"dropped {client.dropped_malformed}, delivered {len(got)}"
        got += client.poll(timeout_s=0.05)
    return got


def test_malformed_multipart_messages_are_dropped_never_read(short_tmp):
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    fake = _FakeProducer(keys)
    client = RingClient(fake.endpoint, "trainer/r0", 1, credits=8, curve=keys, payload="frames")
    try:
        client.hello()
        assert fake.welcome({"backend": "frames", "num_slots": 4, "slot_bytes": 4096}).payload == "frames"
        assert client.await_welcome(10) is not None
        x = torch.arange(300, dtype=torch.int64)  # 2400 bytes: the payload is 2560, rounded up to the alignment
        layout = [TensorSpec("x", "int64", (300,), 0)]
        body = x.view(torch.uint8).numpy().tobytes() + bytes(2560 - 2400)
        assert payload_bytes(layout, 4096) == len(body) == 2560
        fake.send(_batch(0, 1, layout))  # no payload
        fake.send(_batch(1, 2, layout), body[:-1])  # one byte short
        fake.send(_batch(2, 3, layout), body + b"\0")  # one byte long
        fake.send(_batch(3, 4, layout), body, b"extra")  # a third frame
        fake.send(_batch(0, 5, [TensorSpec("x", "int64", (600,), 0)]), bytes(4096))  # past the slot
        fake.send(Heartbeat().encode(), b"x")  # payload on a message that has none
        fake.send(body)  # a payload without its batch
        fake.send(_batch(1, 6, layout), body)  # the one good batch
        delivered = _poll_until(client, dropped=7)
        assert client.dropped_malformed == 7
        assert len(delivered) == 1 and torch.equal(delivered[0].tensors["x"], x) and delivered[0].meta == {"n": 6}
        client.ack(delivered[0])
        # Every dropped batch went back with its credit, as a ring consumer's would.
        assert sorted(fake.acks()) == [(0, 1, 1), (0, 5, 1), (1, 2, 1), (1, 6, 0), (2, 3, 1), (3, 4, 1)]
    finally:
        client.close()
        fake.close()


def test_a_ring_consumer_drops_a_batch_with_a_payload_frame(short_tmp):
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    fake = _FakeProducer(keys)
    ring = HostRing.create("remote-test", "fake", num_slots=2, slot_bytes=4096)
    client = RingClient(fake.endpoint, "trainer/r0", 1, credits=4, curve=keys)
    try:
        client.hello()
        assert fake.welcome(ring.spec()).payload == "ring"
        assert client.await_welcome(10) is not None
        layout = write_tensors(ring.slot(0), {"x": torch.arange(8, dtype=torch.int32)})
        fake.send(_batch(0, 1, layout), b"unexpected")
        fake.send(_batch(0, 2, layout))
        delivered = _poll_until(client, dropped=1)
        assert client.dropped_malformed == 1 and [d.meta["n"] for d in delivered] == [2]
        assert torch.equal(delivered[0].tensors["x"], torch.arange(8, dtype=torch.int32))
    finally:
        client.close()
        fake.close()
        ring.close()


def test_frames_and_ring_answers_must_match_what_was_asked(short_tmp):
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    fake = _FakeProducer(keys)
    try:
        greedy = RingClient(fake.endpoint, "trainer/r0", 1, curve=keys, payload="frames", max_payload_bytes=1 << 20)
        greedy.hello()
        fake.welcome({"backend": "frames", "num_slots": 4, "slot_bytes": (1 << 20) + ALIGN})
        with pytest.raises(HandshakeRefused, match="more than this consumer accepts"):
            greedy.await_welcome(10)
        greedy.close()
        confused = RingClient(fake.endpoint, "trainer/r0", 2, curve=keys)
        confused.hello()
        fake.welcome({"backend": "frames", "num_slots": 4, "slot_bytes": 4096})
        with pytest.raises(HandshakeRefused, match="payload by ring"):
            confused.await_welcome(10)
        confused.close()
    finally:
        fake.close()


class _GpuRing(HostRing):
    """Host memory posing as a CUDA ring: the server must not offer it to a frames consumer."""

    backend = "cuda"


def test_a_gpu_ring_refuses_frames_consumers_naming_the_setting(short_tmp):
    ring = _GpuRing.create("remote-test", "gpu", num_slots=2, slot_bytes=4096)
    server = RingServer(ipc_endpoint(short_tmp / "p.ipc"), ring)
    server.start()
    try:
        client = RingClient(server.endpoint, "trainer/r0", 1, payload="frames")
        with pytest.raises(HandshakeRefused, match="ring.backend=host"):
            client.connect(timeout_s=10)
        client.close()
        assert server.counters.refused == 1
    finally:
        server.close()
        ring.close()


# -- configuration ----------------------------------------------------------------------------------


def test_remote_settings_are_checked_naming_the_key(short_tmp):
    from producer.exits import remote_keys
    from trainer.train import Trainer

    with pytest.raises(ConfigError, match=r"launch\.remote_producers\[1\]: must look like tcp://host:port"):
        load_config(None, ['launch.remote_producers=["tcp://a:1", "tcp://0.0.0.0:2"]'])
    with pytest.raises(ConfigError, match="launch.num_producers: must be >= 1 unless launch.remote_producers"):
        load_config(None, ["launch.num_producers=0"])
    cfg = load_config(None, ["launch.num_producers=0", 'launch.remote_producers=["tcp://a:1", "tcp://b:2"]'])
    assert cfg.launch.remote_producer_ids() == {0: "tcp://a:1", 1: "tcp://b:2"} and cfg.launch.total_producers == 2
    cfg = load_config(None, ['launch.producer_devices=["cpu"]', 'launch.remote_producers=["tcp://a:1"]'])
    assert cfg.launch.remote_producer_ids() == {1: "tcp://a:1"} and cfg.launch.total_producers == 2

    run = RunDir(short_tmp / "remote")
    with pytest.raises(ConfigError, match="--producer-id 0: .* one of launch.remote_producers.*\\[1\\]"):
        remote_keys(cfg, run, 0, "tcp://0.0.0.0:5555")
    with pytest.raises(ConfigError, match="--listen ipc:///x: must be a tcp:// endpoint"):
        remote_keys(cfg, run, 1, "ipc:///x")
    with pytest.raises(ConfigError, match="curve.json.*missing.*Copy the run's secrets/curve.json.*0600"):
        remote_keys(cfg, run, 1, "tcp://0.0.0.0:5555")
    keys = run_keys(run.curve_keys)
    assert remote_keys(cfg, run, 1, "tcp://0.0.0.0:5555") == keys
    os.chmod(run.curve_keys, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        remote_keys(cfg, run, 1, "tcp://0.0.0.0:5555")
    gpu = load_config(
        None, ['launch.producer_devices=["cpu"]', 'launch.remote_producers=["tcp://a:1"]', 'ring.backend="cuda"']
    )
    with pytest.raises(ConfigError, match="ring.backend: .* not cuda"):
        remote_keys(gpu, run, 1, "tcp://0.0.0.0:5555")
    # Epoch sizing counts each shard where its producer runs: with remote ones the steps must be given.
    with pytest.raises(ConfigError, match="training.max_steps: must be > 0 with launch.remote_producers"):
        Trainer._steps_from_epochs(SimpleNamespace(cfg=cfg))


# -- a run over a local and a remote producer ------------------------------------------------------

NUM_SAMPLES = 96
RUN = [
    f"data.num_samples={NUM_SAMPLES}",
    "data.mean_len=48",
    "data.min_len=16",
    "data.max_seq_len=256",
    "batching.token_budget=512",
    "batching.window_docs=32",
    "drafter.num_anchors=32",
    "training.max_steps=10000",
    "training.checkpoint_every=8",
    "logging.log_every=2",
    'logging.wandb_mode="disabled"',
    "ring.heartbeat_interval_s=0.25",
    "ring.heartbeat_timeout_s=2.0",
    'launch.producer_devices=["cpu"]',
    "eval.every_steps=0",  # no evaluation's reference made by producer 0 (3 s of CPU) for evaluations never asked
]


def _start_remote(remote: RunDir, endpoint: str) -> subprocess.Popen:
    with open(remote.root / "producer.log", "a") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "producer.server",
                "--run-dir",
                str(remote.root),
                "--producer-id",
                "1",
                "--listen",
                endpoint,
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _step(run: RunDir) -> int:
    return (read_json(run.trainer_status) or {}).get("step", 0)


def _wait(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_training_from_a_local_and_a_remote_producer_exactly_once(short_tmp):
    from common.rundir import RunDir as LauncherRunDir
    from producer.data.order import OrderConfig, ShardOrder

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    run = LauncherRunDir(short_tmp / "run")
    run.create()  # as run_all.sh does: the folders and the run's CURVE keys
    save_config(
        load_config(ROOT / "launch" / "tiny.toml", RUN + [f'launch.remote_producers=["{endpoint}"]']), run.config
    )
    # The other "host": a folder of its own holding copies of config.toml and secrets/curve.json only.
    remote = RunDir(short_tmp / "remote")
    (remote.root / "secrets").mkdir(parents=True, mode=0o700)
    shutil.copy2(run.config, remote.config)
    shutil.copy2(run.curve_keys, remote.curve_keys)
    producer = _start_remote(remote, endpoint)
    with open(short_tmp / "launcher.out", "w") as out:
        launcher = subprocess.Popen(
            [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run.root)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    trainer_log = run.logs / "trainer.log"

    def reconnected() -> bool:
        return "producer 1 back after" in trainer_log.read_text()

    try:
        # Step 4 with the remote producer connected: the local one may be ready seconds before it.
        _wait(lambda: _step(run) >= 4 and "connected to producer 1" in trainer_log.read_text(), "step 4, both")
        producer.send_signal(signal.SIGKILL)  # the producer on the other host dies, and its host restarts it
        producer.wait()
        killed_at = _step(run)
        producer = _start_remote(remote, endpoint)
        _wait(reconnected, "the trainer back on the restarted remote producer")
        back_at = _step(run)

        def trained_from_restarted_remote() -> bool:
            lines = [json.loads(line) for line in run.ledger.read_text().splitlines() if line.endswith("}")]
            return any(p == 1 for line in lines if line["step"] > back_at for p, _ in line["batches"])

        # Steps on, and at least one of them from the restarted remote producer (a loaded machine may
        # train several steps from the local one before the remote's first batch arrives).
        _wait(
            lambda: _step(run) >= back_at + 8 and trained_from_restarted_remote(),
            "training after the remote producer came back",
        )
        stopped = subprocess.run(
            [str(ROOT / "launch" / "run_all.sh"), "stop", "--run-dir", str(run.root)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        code = launcher.wait(timeout=120)
    finally:
        for proc in (launcher, producer):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
    logs = "".join(
        f"\n--- {p}\n" + p.read_text()[-2500:]
        for p in [short_tmp / "launcher.out", remote.root / "producer.log", *sorted(run.logs.glob("*.log"))]
    )
    assert stopped.returncode == 0 and code == 0, stopped.stderr + logs
    assert not run.producer_status(1).exists(), "the launcher started only the local producer"
    assert "connected to producer 1 (pid" in trainer_log.read_text() and "ring frames" in trainer_log.read_text(), logs

    by_step: dict[int, dict] = {}
    for line in run.ledger.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record  # one trainer incarnation: one line per step
    assert sorted(by_step) == list(range(1, len(by_step) + 1)) and len(by_step) >= back_at + 8 > killed_at
    triples = Counter(tuple(t) for record in by_step.values() for t in record["samples"])
    assert not [t for t, n in triples.items() if n > 1], "a sample trained twice"
    for producer_id in (0, 1):
        # Each shard's batches trained in stream order with none skipped or repeated, the restarted
        # producer resuming where the trainer's HELLO said it had got to.
        ordinals = [o for record in by_step.values() for p, o in record["batches"] if p == producer_id]
        assert ordinals == list(range(len(ordinals))), f"producer {producer_id}: {ordinals}"
        trained = {s for p, epoch, s in triples if p == producer_id and epoch == 0}
        if any(p == producer_id and epoch >= 1 for p, epoch, _ in triples):
            shard = ShardOrder(NUM_SAMPLES, OrderConfig(seed=0, num_shards=2, shard_index=producer_id))
            assert trained == {int(i) for i in shard.epoch_ids(0)}, f"producer {producer_id}: epoch 0 incomplete"
    after_restart = [o for step in range(back_at + 1, len(by_step) + 1) for p, o in by_step[step]["batches"] if p == 1]
    assert after_restart, "the restarted remote producer's batches were trained"
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any(m.get("producer/1/up") == 0 for m in metrics), "the trainer reported the remote producer down"


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(*sys.argv[2:4])

"""Who can reach a run: owner-only sockets and segments, CURVE on tcp, nothing received is unpickled."""

import ast
import os
import socket
import time
from pathlib import Path

import pytest
import zmq

from common.codec import write_tensors
from common.protocol import Hello
from common.ring import HostRing
from common.rundir import RunDir
from common.sockets import CurveKeys, SecretsError, ipc_endpoint, run_keys
from common.transport import HandshakeTimeout, RingClient, RingServer

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(endpoint: str, ring: HostRing, **kwargs) -> RingServer:
    server = RingServer(endpoint, ring, heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, **kwargs)
    server.start()
    for _ in range(3):
        slot = server.acquire(timeout_s=1)
        layout = write_tensors(server.slot_view(slot), {"x": ring.slot(slot)[:16].clone().fill_(slot)})
        server.publish(slot, layout, {"slot": slot})
    return server


def _answered(endpoint: str, curve: CurveKeys | None, timeout_s: float = 1.5) -> bool:
    """Whether a HELLO over a raw socket (with these keys, or none) gets any answer."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            curve.server_public,
            curve.client_public,
            curve.client_secret,
        )
    sock.connect(endpoint)
    sock.send(Hello(consumer_id="intruder", incarnation=1, pid=1, credits=4).encode())
    answered = bool(sock.poll(timeout_s * 1000))
    sock.close()
    ctx.term()
    return answered


def test_run_sockets_folder_and_socket_files_are_owner_only(short_tmp):
    run = RunDir(short_tmp / "run")
    run.create()
    assert _mode(run.sockets) == 0o700
    assert _mode(run.curve_keys) == 0o600 and _mode(run.curve_keys.parent) == 0o700, "the run's keys are made with it"
    ring = HostRing.create("sec", "p0", num_slots=3, slot_bytes=4096)
    server = _serve(ipc_endpoint(run.sockets / "p0.ipc"), ring)
    try:
        assert _mode(run.sockets / "p0.ipc") == 0o600
        assert _mode(ring.path) == 0o600
        if os.getuid() != 0:
            return  # the modes are what keeps other users out; as root we can also show it
        # A child that becomes another user tries both (fork, not exec: that user cannot run our Python).
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            results = []
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                for attempt in (
                    lambda: socket.socket(socket.AF_UNIX).connect(str(run.sockets / "p0.ipc")),
                    lambda: os.open(ring.path, os.O_RDONLY),
                ):
                    try:
                        attempt()
                        results.append("open")
                    except PermissionError:
                        results.append("denied")
            finally:
                os.write(write_end, " ".join(results).encode())
                os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        assert os.read(read_end, 100).decode().split() == ["denied", "denied"]
        os.close(read_end)
    finally:
        server.close()
        ring.close()


def test_tcp_endpoints_admit_only_holders_of_the_run_keys(short_tmp):
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    ring = HostRing.create("sec", "tcp", num_slots=3, slot_bytes=4096)
    server = _serve(endpoint, ring, curve=keys)
    try:
        with pytest.raises(ValueError, match="CURVE keys"):
            RingClient(endpoint, "plain", 1)  # tcp without keys is refused at once
        stranger = CurveKeys.generate()
        assert not _answered(endpoint, None), "a plain-text peer got an answer"
        assert not _answered(
            endpoint, CurveKeys(keys.server_public, b"", stranger.client_public, stranger.client_secret)
        ), "a client key that is not the run's got an answer"
        assert server.counters.messages == 0, "nothing from a peer without the keys reached the protocol"

        client = RingClient(endpoint, "trainer/r0", 1, curve=keys)
        client.connect(timeout_s=10)
        got = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            for delivery in client.poll(timeout_s=0.1):
                got.append(int(delivery.tensors["x"][0]))
                client.ack(delivery, grant=1)
        client.close()
        assert sorted(got) == [0, 1, 2]
    finally:
        server.close()
        ring.close()


def test_a_producer_without_the_run_keys_cannot_pose_as_one(short_tmp):
    keys = run_keys(short_tmp / "secrets" / "curve.json")
    endpoint = f"tcp://127.0.0.1:{_free_tcp_port()}"
    ring = HostRing.create("sec", "fake", num_slots=3, slot_bytes=4096)
    impostor = _serve(endpoint, ring, curve=CurveKeys.generate())
    try:
        client = RingClient(endpoint, "trainer/r0", 1, curve=keys)
        with pytest.raises(HandshakeTimeout):
            client.connect(timeout_s=1.5)
        client.close()
        assert impostor.counters.messages == 0
    finally:
        impostor.close()
        ring.close()


def test_key_file_is_owner_only_and_refused_otherwise(short_tmp):
    path = short_tmp / "secrets" / "curve.json"
    keys = run_keys(path)
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert run_keys(path) == keys, "made once, then read back"
    path.chmod(0o644)
    with pytest.raises(SecretsError, match="chmod 600"):
        CurveKeys.load(path)
    path.chmod(0o600)
    path.write_text('{"server_public": "short"}')
    with pytest.raises(SecretsError, match="not a CURVE key file"):
        CurveKeys.load(path)


FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized"}  # pyzmq's pickling helpers


def test_nothing_received_is_unpickled_or_evaluated():
    """No module that runs in a producer or trainer imports a pickle-like codec or evaluates code,
    torch.load only loads tensors, and msgpack is decoded in exactly one place, with no hooks."""
    problems = []
    for path in sorted(
        p for folder in ("common", "producer", "trainer", "launch") for p in (ROOT / folder).rglob("*.py")
    ):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [
                    f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                problems.append(f"{where}: from {node.module} import")
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
                keywords = {k.arg: k.value for k in node.keywords}
                if (isinstance(func, ast.Name) and name in FORBIDDEN_BUILTINS) or (
                    isinstance(func, ast.Attribute) and name in FORBIDDEN_METHODS
                ):
                    problems.append(f"{where}:{node.lineno}: {name}()")
                if name == "load" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "torch":
                    if not (
                        isinstance(keywords.get("weights_only"), ast.Constant)
                        and keywords["weights_only"].value is True
                    ):
                        problems.append(f"{where}:{node.lineno}: torch.load without weights_only=True")
                if name in ("unpackb", "Unpacker", "unpack"):
                    if where != Path("common/protocol.py"):
                        problems.append(f"{where}:{node.lineno}: msgpack decoded outside common/protocol.py")
                    hooks = {"object_hook", "object_pairs_hook", "list_hook", "ext_hook"} & set(keywords)
                    if hooks:
                        problems.append(f"{where}:{node.lineno}: msgpack hooks {sorted(hooks)}")
    assert not problems, problems

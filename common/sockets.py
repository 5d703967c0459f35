"""The one place that makes ZeroMQ sockets: bind/connect, high-water marks, linger, permissions, CURVE.

Who may talk to a producer:
- ipc:// endpoints: the socket file is mode 0600 in a 0700 folder, so only the run's user connects.
- tcp:// endpoints (across hosts): ZeroMQ CURVE, always. The run's keys live in
  ``DIR/secrets/curve.json`` (mode 0600, folder 0700; made once by ``run_keys``). Producers serve
  with the server key pair and admit only clients that present the run's client key (a ZAP
  handler checks it); consumers need the server's public key, so a process that lacks the file can
  neither connect to a producer nor pose as one. Copy the file (keeping its mode) to the other hosts.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread

log = logging.getLogger(__name__)

MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux, minus margin
MAX_FRAME_BYTES = 1 << 20
ZAP_DOMAIN = "dflash"


class SecretsError(RuntimeError):
    """The run's key file is missing, malformed, or readable by others."""


@dataclass(frozen=True)
class CurveKeys:
    """A run's CURVE keys, Z85-encoded: producers serve with the server pair, consumers present the client pair."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def save(self, path: Path) -> None:
        """Write the keys readable by their owner only (folder 0700, file 0600, never another mode in between)."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(path.parent, 0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: v.decode() for k, v in vars(self).items()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> CurveKeys:
        """Read the keys, refusing a file that others could read or write."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise SecretsError(f"{path}: the run's CURVE key file is missing (tcp endpoints need it)") from None
        with os.fdopen(fd) as f:
            info = os.fstat(f.fileno())
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise SecretsError(
                    f"{path}: mode {stat.S_IMODE(info.st_mode):04o}, owner uid {info.st_uid}: the run's keys must be "
                    f"readable by their owner only (chmod 600 {path})"
                )
            try:
                data = json.load(f)
                keys = cls(
                    **{
                        name: data[name].encode()
                        for name in ("server_public", "server_secret", "client_public", "client_secret")
                    }
                )
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise SecretsError(f"{path}: not a CURVE key file ({type(exc).__name__}: {exc})") from None
        for name, value in vars(keys).items():
            if len(value) != 40:
                raise SecretsError(f"{path}: key {name!r} must be 40 Z85 characters, got {len(value)}")
        return keys


def run_keys(path: Path) -> CurveKeys:
    """The run's keys at ``path``, made on first use."""
    if not path.exists():
        CurveKeys.generate().save(path)
    return CurveKeys.load(path)


def ipc_endpoint(path: Path) -> str:
    """``ipc://`` endpoint for a socket file, refusing paths the kernel would truncate."""
    text = str(path)
    if len(text) > MAX_IPC_PATH:
        raise ValueError(
            f"socket path {text} is {len(text)} characters; the limit is {MAX_IPC_PATH}: use a shorter run directory"
        )
    return "ipc://" + text


class _AllowRunClient:
    """ZAP credentials check: only the run's client key may connect. Refusals are logged (at most
    one line per minute, with the count) so that a misconfigured trainer host shows up in the
    producer's log; ZeroMQ itself tells neither side why a CURVE handshake failed."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.refused = 0
        self._logged_at = float("-inf")

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 60.0:
            self._logged_at = now
            log.warning(
                "refused a tcp client whose CURVE key is not the run's client key (%d refused so far): "
                "it needs a copy of this run's secrets/curve.json",
                self.refused,
            )
        return False


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> zmq.auth.thread.ThreadAuthenticator:
    """The ZAP handler of ``ctx`` that admits only the run's client key; stop it when the socket goes.

    One per context: a CURVE server socket gets a context of its own (see RingServer).
    """
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowRunClient(keys.client_public))
    return auth


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = 10_000,
    linger_ms: int = 0,
    identity: bytes | None = None,
    curve: CurveKeys | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> zmq.Socket:
    """A socket bound or connected to one endpoint.

    ROUTER sockets are made "mandatory" so that a send to a gone or full peer raises at once
    (zmq.Again / EHOSTUNREACH) instead of vanishing; callers send with NOBLOCK and never wait on
    a peer. ipc socket files are made readable and writable by their owner only. tcp endpoints
    need ``curve``: a binding socket serves as the CURVE server (its context needs a ZAP handler,
    ``start_authenticator``), a connecting one authenticates the server by its public key.
    Incoming frames longer than ``max_frame_bytes`` are dropped by ZeroMQ before they are allocated
    (raised only for consumers that receive batch payloads as frames).
    """
    endpoint = _endpoint(bind, connect, curve)
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # larger frames are dropped by zmq itself
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:port works too; IPv4 addresses are unaffected
    if curve is not None:
        _set_curve_keys(sock, curve, server=bind is not None)
    if bind is not None:
        _bind_private(sock, bind)
    else:
        sock.connect(connect)
    return sock


def _endpoint(bind: str | None, connect: str | None, curve: CurveKeys | None) -> str:
    """The one endpoint of ``bind`` and ``connect``, checked: a scheme ZeroMQ serves here, CURVE keys over tcp."""
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind or connect")
    endpoint = bind if bind is not None else connect
    if not endpoint.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"endpoint {endpoint!r}: use ipc:// (one host) or tcp:// (across hosts)")
    if endpoint.startswith("tcp://") and curve is None:
        raise ValueError(f"endpoint {endpoint}: tcp endpoints need the run's CURVE keys (DIR/secrets/curve.json)")
    return endpoint


def _set_curve_keys(sock: zmq.Socket, curve: CurveKeys, server: bool) -> None:
    """The binding side serves as the CURVE server (checked by the ZAP handler); the connecting side authenticates
    the server by its public key."""
    if server:
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
    else:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.client_public
        sock.curve_secretkey = curve.client_secret


def _bind_private(sock: zmq.Socket, bind: str) -> None:
    """Bind; an ipc socket file (and the folder it is made in) is its owner's only."""
    if not bind.startswith("ipc://"):
        sock.bind(bind)
        return
    path = Path(bind[len("ipc://") :])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    old = os.umask(0o077)
    try:
        sock.bind(bind)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)


def send_nowait(sock: zmq.Socket, frames: list[bytes], payload: memoryview | None = None) -> bool | zmq.MessageTracker:
    """Send without ever blocking; False when the peer is gone or its queue is full.

    Frame by frame rather than send_multipart, whose checks cost a few microseconds per lease;
    zmq still delivers the parts all or none (a full queue or a gone peer fails the first).
    ``payload``, when given, is sent last and not copied: ZeroMQ reads that memory while it sends,
    so it must stay unchanged until the peer has the whole message. Then the return value is that
    send's MessageTracker (``done`` once ZeroMQ no longer reads the memory), else True.
    """
    try:
        for frame in frames[:-1]:
            sock.send(frame, zmq.SNDMORE | zmq.NOBLOCK)
        if payload is None:
            sock.send(frames[-1], zmq.NOBLOCK)
            return True
        sock.send(frames[-1], zmq.SNDMORE | zmq.NOBLOCK)
        return sock.send(payload, zmq.NOBLOCK, copy=False, track=True)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise

"""The one place that makes ZeroMQ sockets: bind/connect, high-water marks, linger, permissions."""

from __future__ import annotations

import os
from pathlib import Path

import zmq

MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux, minus margin


def ipc_endpoint(path: Path) -> str:
    """``ipc://`` endpoint for a socket file, refusing paths the kernel would truncate."""
    text = str(path)
    if len(text) > MAX_IPC_PATH:
        raise ValueError(f"socket path {text} is {len(text)} characters; the limit is {MAX_IPC_PATH}: use a shorter run directory")
    return "ipc://" + text


def make_socket(
    ctx: zmq.Context,
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    hwm: int = 10_000,
    linger_ms: int = 0,
    identity: bytes | None = None,
) -> zmq.Socket:
    """A socket bound or connected to one endpoint.

    ROUTER sockets are made "mandatory" so that a send to a gone or full peer raises at once
    (zmq.Again / EHOSTUNREACH) instead of vanishing; callers send with NOBLOCK and never wait on
    a peer. ipc socket files are made readable and writable by their owner only.
    """
    if (bind is None) == (connect is None):
        raise ValueError("give exactly one of bind or connect")
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # larger frames are dropped by zmq itself
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if bind is not None:
        if bind.startswith("ipc://"):
            path = Path(bind[len("ipc://") :])
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            old = os.umask(0o077)
            try:
                sock.bind(bind)
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
        else:
            sock.bind(bind)
    else:
        sock.connect(connect)
    return sock


def send_nowait(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without ever blocking; False when the peer is gone or its queue is full."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise

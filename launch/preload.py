"""The preloader (``python -m launch.preload``): the producers and trainers that run on the CPU, forked from one
interpreter that has torch and transformers imported instead of started as a fresh Python each (``launch.preload``;
the launcher's side is launch/preload_client.py).

Importing torch, transformers and the torch._dynamo that both pull in is about 3.5 s of CPU at every producer and
trainer start; on a machine of two cores that is most of what a start costs. The launcher keeps one preloader that
imports those libraries once and waits. To start a role it forks: the fork takes its environment, log file, process
group and command line (``ps`` and ``pgrep -f`` show ``python -m producer.server ...``), imports the project's own
modules (never preloaded, so that what they read at import time is read in the child, as in a fresh interpreter) and
runs the role's module as ``__main__``. The preloader reaps its children and reports each exit code, so the launcher
sees a crash, a kill -9 or a clean exit as it sees those of a child it started itself. (One thing differs from a
fresh interpreter: /proc/PID/environ, which the kernel keeps from the exec, shows the preloader's environment; the
role's own is its os.environ.) A child gets SIGTERM when the preloader dies, as the preloader does when the launcher
dies; the launcher then starts a new preloader and restarts the children as after any crash.

A group of ranks (``python -m launch.torchrun --standalone --nproc-per-node N -m ROLE ...``: a tensor-parallel
producer's, a trainer's) is forked as well. The fork, shown with torchrun's command line, is the group's leader and
does what torchrun --standalone does for one node: it holds the group's store (TORCHELASTIC_USE_AGENT_STORE), forks
the N ranks with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), ends them all
(the same signal, then SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT) when one fails or it is told to stop, and exits
as launch.torchrun does: 0, 2 when a rank exited 2, 1 for another failure, 128 + N after signal N. Its ranks get
SIGTERM when it dies.

Only for processes on the CPU: a process must fork before anything has touched CUDA (the preloader checks that
nothing did), and a GPU process's start is dominated by loading weights anyway. Other commands (the testing hooks,
torchrun with other options) start as fresh interpreters.

``python -m launch.preload --serve PATH`` is a preloader server: it imports once and forks a preloader for each
launcher that connects to the Unix socket PATH (DFLASH_PRELOAD_SERVER), which serves that launcher over the
connection. The test suite runs one per test process; its launchers then start no import of their own.

Protocol (JSON lines): the launcher writes ``{"module", "args", "env", "cwd", "log"}`` (and ``"ranks"`` and
``"command"`` for a group) to the preloader's stdin; the preloader answers ``{"pid": N}`` (or ``{"error": "..."}``)
on its stdout, and later ``{"exit": N, "code": C}`` with C as ``Popen.returncode`` has it (negative: the signal). A
server's fork first says ``{"preloader": PID, "env": {...}}``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

LIBRARIES = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "safetensors.torch",
    "zmq",
    "msgpack",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.llama.modeling_llama",
)
"""What the preloader imports: third-party libraries only (their import-time reads of the environment see the
launcher's, which every child shares). The project's modules are imported in each child."""

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# -- the preloader -----------------------------------------------------------------------------------


def _send(message: dict) -> None:
    os.write(1, json.dumps(message).encode() + b"\n")


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _show_command(words: list[str]) -> None:
    """Write ``words`` over this process's command line (the room the preloader was started with), as
    /proc/self/cmdline, ps and pgrep read it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end, fields 48 and 49 of proc(5)
    text = ("\0".join(words).encode() + b"\0")[: end - start - 1]
    with open("/proc/self/mem", "r+b", buffering=0) as memory:
        memory.seek(start)
        memory.write(text.ljust(end - start, b"\0"))


def _run_child(request: dict, preloader_pid: int) -> None:
    """In the forked child: become the role's process (or a group of ranks' leader) as a fresh interpreter would
    be, run it, never return."""

    def become_and_run() -> int:
        _become("launch.torchrun" if request.get("ranks") else request["module"], preloader_pid)
        os.setpgid(0, 0)
        _show_command(request.get("command") or [sys.executable, "-m", request["module"], *request["args"]])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        return _lead_ranks(request) if request.get("ranks") else _run_role(request["module"], request["args"])

    _end_with(become_and_run)


def _end_with(body: Callable[[], int]) -> None:
    """End this forked process with ``body``'s exit code (1 after printing what it raised), never returning."""
    code = 1
    try:
        code = body()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        from common.lifecycle import end_now  # the project's, imported here in the child (never preloaded)

        end_now(code)


def _become(name: str, parent: int) -> None:
    """The first steps of a forked child: default signal handling, SIGTERM when ``parent`` dies, ``name`` for
    ps; leave at once if ``parent`` is already gone."""
    import ctypes

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # a forked child dies with the process it was forked from
    libc.prctl(_PR_SET_NAME, name.encode()[:15])  # what ps -o comm and top show
    if os.getppid() != parent:
        os._exit(128 + signal.SIGTERM)


def _run_role(module: str, args: list[str]) -> int:
    """Run ``module`` as ``__main__`` with ``args``, as ``python -m module args`` would; its exit code."""
    import atexit
    import runpy

    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads.isdigit():  # read by OpenMP when torch was loaded: the preloader's, not this child's
        torch.set_num_threads(int(threads))
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    return code


# -- a group of ranks: torchrun --standalone, forked ------------------------------------------------------


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _lead_ranks(request: dict) -> int:
    """Do what ``launch.torchrun --standalone --nproc-per-node N -m ROLE`` does, with the ranks forked from this
    process: host the group's store, start N ranks with torchrun's environment, end them all when one fails or
    this process is told to stop, and exit as launch.torchrun would (0; 2 when a rank exited 2; 1 for any other
    failure; 128 + N after signal N)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from common.lifecycle import EXIT_CONFIG_ERROR

    leader, count = os.getpid(), request["ranks"]
    # A stop signal that comes while the ranks start waits for the handlers below, in the leader and in each rank
    # (whose default handling it then gets), instead of being lost or taken by the wrong one.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    told: list[int] = []
    for sig in _STOP_SIGNALS:
        signal.signal(sig, lambda received, _: told.append(received))
    ranks: list[int] = []
    port_writers: list[int] = []
    for rank in range(count):
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:
            for other in port_writers + [writer]:
                os.close(other)
            _run_rank(request, rank, reader, leader)
        os.close(reader)
        ranks.append(pid)
        port_writers.append(writer)
    # The ranks are forked before the store starts its thread; they wait for its port. torchrun's agent holds
    # the store the same way (TORCHELASTIC_USE_AGENT_STORE): every rank is its client.
    store = TCPStore("127.0.0.1", 0, count, True, timedelta(seconds=900), wait_for_workers=False)
    for writer in port_writers:
        os.write(writer, f"{store.port}\n".encode())
        os.close(writer)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    codes: dict[int, int] = {}
    os.set_blocking(wake_r, False)
    while not told and not any(codes.values()) and len(codes) < count:
        select.select([wake_r], [], [], 1.0)  # woken by SIGCHLD and by the stop signals
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        codes.update(_reap())
    failures = [code for code in codes.values() if code != 0]
    if len(codes) < count:
        _stop_ranks(set(ranks) - set(codes), told[0] if told else signal.SIGTERM, codes)
    if told:
        return 128 + told[0]
    if failures:
        return EXIT_CONFIG_ERROR if EXIT_CONFIG_ERROR in failures else 1
    return 0


def _reap() -> dict[int, int]:
    """The exit codes of the children that have exited since the last call, by pid (without waiting)."""
    codes: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return codes
        if pid == 0:
            return codes
        codes[pid] = _returncode(status)


def _stop_ranks(running: set[int], sig: int, codes: dict[int, int]) -> None:
    """Send ``sig`` to the ranks still running, give them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default,
    as torchrun), then SIGKILL."""
    for pid in running:
        os.kill(pid, sig)
    deadline = time.monotonic() + float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    while not running <= set(codes) and time.monotonic() < deadline:
        time.sleep(0.05)
        codes.update(_reap())
    for pid in running - set(codes):
        os.kill(pid, signal.SIGKILL)
        codes[pid] = _returncode(os.waitpid(pid, 0)[1])


def _run_rank(request: dict, rank: int, port_reader: int, leader: int) -> None:
    """In a rank forked from the group's leader: torchrun's environment for ``rank``, then the role."""

    def become_rank_and_run() -> int:
        _become(request["module"], leader)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        _show_command([sys.executable, "-u", "-m", request["module"], *request["args"]])  # as torchrun starts it
        port = os.read(port_reader, 64).decode().strip()
        os.close(port_reader)
        if not port:  # the leader failed before its store started
            return 1
        count = str(request["ranks"])
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            ROLE_RANK=str(rank),
            ROLE_NAME="default",
            WORLD_SIZE=count,
            LOCAL_WORLD_SIZE=count,
            GROUP_WORLD_SIZE="1",
            ROLE_WORLD_SIZE=count,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID=f"preloaded-{leader}",
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks on one node
        return _run_role(request["module"], request["args"])

    _end_with(become_rank_and_run)


def _import_libraries() -> None:
    import importlib

    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library this install lacks: its users import it (and fail) as before
            pass
    import torch

    if torch.cuda.is_initialized():
        raise SystemExit("launch.preload: CUDA was initialized while preloading; a fork could not use it")


def serve() -> None:
    """The preloader's loop: fork what is asked on stdin, answer and report exits on stdout, until stdin ends (the
    launcher closed it, or died: the children still running then get SIGTERM as the preloader exits)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = b""
    me = os.getpid()
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        for pid, code in _reap().items():
            _send({"exit": pid, "code": code})
        if 0 in readable:
            data = os.read(0, 1 << 20)
            if not data:
                return
            requests += data
            while b"\n" in requests:
                line, requests = requests.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    _send({"error": str(exc)})
                    continue
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    _run_child(request, me)
                _send({"pid": pid})


def serve_preloaders(path: str) -> None:
    """``python -m launch.preload --serve PATH``: import the libraries once, then fork a preloader for each launcher
    that connects to the Unix socket PATH (DFLASH_PRELOAD_SERVER), until this process's parent is gone. A fork
    first says its pid and the environment it imported with, then serves its launcher over the connection as a
    launcher's own preloader serves it over its pipes."""
    import socket

    imported_with = dict(os.environ)  # libraries add to it as they import (torch: TORCHINDUCTOR_CACHE_DIR)
    _import_libraries()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(1.0)
    while os.getppid() == parent:
        _reap()  # the preloaders whose launchers are done
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        if os.fork() == 0:
            listener.close()
            os.dup2(connection.fileno(), 0)
            os.dup2(connection.fileno(), 1)
            connection.close()
            _send({"preloader": os.getpid(), "env": imported_with})
            serve()
            os._exit(0)
        connection.close()


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        serve_preloaders(argv[1])
        return
    _import_libraries()
    serve()


if __name__ == "__main__":
    main(sys.argv[1:])

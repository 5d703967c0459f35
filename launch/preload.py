"""Preloaded starts: the producers and trainers that run on the CPU, forked from one interpreter that has torch
and transformers imported instead of started as a fresh Python each (``launch.preload``).

Importing torch, transformers and the torch._dynamo that both pull in is about 3.5 s of CPU at every producer and
trainer start; on a machine of two cores that is most of what a start costs. The launcher keeps one child, the
preloader (``python -m launch.preload``), that imports those libraries once and waits. To start a role it forks:
the fork takes its environment, log file, process group and command line (``ps`` and ``pgrep -f`` show
``python -m producer.server ...``), imports the project's own modules (never preloaded, so that what they read at
import time is read in the child, as in a fresh interpreter) and runs the role's module as ``__main__``. The
preloader reaps its children and reports each exit code, so the launcher sees a crash, a kill -9 or a clean exit
as it sees those of a child it started itself. (One thing differs from a fresh interpreter: /proc/PID/environ, which
the kernel keeps from the exec, shows the preloader's environment; the role's own is its os.environ.) A child gets SIGTERM when the preloader dies, as the preloader does
when the launcher dies; the launcher then starts a new preloader and restarts the children as after any crash.

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

Protocol (JSON lines): the launcher writes ``{"module", "args", "env", "cwd", "log"}`` (and ``"ranks"`` and
``"command"`` for a group) to the preloader's stdin; the preloader answers ``{"pid": N}`` (or ``{"error": "..."}``)
on its stdout, and later ``{"exit": N, "code": C}`` with C as ``Popen.returncode`` has it (negative: the signal).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

PRELOADED_ROLES = ("producer.server", "trainer.train")
"""The modules the preloader starts, alone or as a group of ranks; any other command is started as a fresh
process."""

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

log = logging.getLogger("launch.supervisor")

COMMAND_ROOM = 8192
"""Bytes of blank command line the preloader is started with, so that each child can show its own command there
(``ps``, ``pgrep -f``: ``python -m producer.server --run-dir ...``, as a fresh interpreter would)."""

SPAWN_TIMEOUT_S = 120.0
"""How long a start waits for the preloader (its first start waits for the imports)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


# -- the launcher's side ---------------------------------------------------------------------------------


class PreloadedProcess:
    """A role process the preloader forked, seen through the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, pid: int, parent: _PreloaderProcess) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._parent = parent

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._parent.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class _PreloaderProcess:
    """One preloader process, and the starts and exits it reported."""

    def __init__(self, env: dict[str, str], preexec: Callable[[], None] | None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launch.preload", " " * COMMAND_ROOM],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,  # a Ctrl-C reaches the launcher only, as with its other children
            preexec_fn=preexec,
        )
        self.answers: queue.Queue[dict] = queue.Queue()
        self.exits: dict[int, int] = {}
        self.gone = False
        self.lock = threading.Lock()
        threading.Thread(target=self._read, name="preloader", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            if "exit" in message:
                with self.lock:
                    self.exits[message["exit"]] = message["code"]
            else:
                self.answers.put(message)
        with self.lock:
            self.gone = True
        self.answers.put({"error": "the preloader exited"})

    def fork(self, request: dict) -> int:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.answers.get(timeout=SPAWN_TIMEOUT_S)
        if "error" in answer:
            raise OSError(answer["error"])
        return answer["pid"]

    def exit_code(self, pid: int) -> int | None:
        """A child's exit code once reported; after the preloader died, SIGTERM's once the child is gone (it got
        SIGTERM when its parent died)."""
        with self.lock:
            if pid in self.exits:
                return self.exits.pop(pid)
            if not self.gone:
                return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGTERM
        return None


def _request_for(command: list[str]) -> dict | None:
    """What the preloader is asked to start for ``command``: ``python -m ROLE ARGS``, or ``python -m
    launch.torchrun --standalone --nproc-per-node N -m ROLE ARGS`` (N ranks, forked); None for anything else."""
    if command[:2] != [sys.executable, "-m"] or len(command) < 3:
        return None
    if command[2] in PRELOADED_ROLES:
        return {"module": command[2], "args": command[3:]}
    head = command[2:8]
    if (
        len(head) == 6
        and head[:3] == ["launch.torchrun", "--standalone", "--nproc-per-node"]
        and head[3].isdigit()
        and head[4] == "-m"
        and head[5] in PRELOADED_ROLES
    ):
        return {"module": head[5], "args": command[8:], "ranks": int(head[3]), "command": command}
    return None


class Preloader:
    """The launcher's preloader: started at the first start it is asked for, again after it died, closed with
    the run."""

    def __init__(self, env: dict[str, str], preexec: Callable[[], None] | None = None) -> None:
        self.env = env
        self.preexec = preexec
        self.current: _PreloaderProcess | None = None

    def spawn(self, command: list[str], env: dict[str, str], log_file: IO[bytes]) -> PreloadedProcess | None:
        """Start ``command`` (``python -m ROLE ARGS``) forked from the preloader, its output appended to
        ``log_file``; None when it is not a role the preloader starts, or the preloader failed (logged: the
        caller starts a fresh interpreter)."""
        request = _request_for(command)
        if request is None:
            return None
        if self.current is None or self.current.proc.poll() is not None:
            self.current = _PreloaderProcess(self.env, self.preexec)
        request.update(env=env, cwd=os.getcwd(), log=log_file.name)
        try:
            return PreloadedProcess(self.current.fork(request), self.current)
        except (OSError, queue.Empty) as exc:
            log.warning("the preloader could not start %s (%s): starting a fresh interpreter", command[2], exc)
            return None

    def close(self) -> None:
        """End the preloader (after the run's processes have stopped): it exits when its stdin closes."""
        if self.current is None:
            return
        proc, self.current = self.current.proc, None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    code = 1
    try:
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
        code = _lead_ranks(request) if request.get("ranks") else _run_role(request["module"], request["args"])
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
        _reap(codes)
    failures = [code for code in codes.values() if code != 0]
    if len(codes) < count:
        _stop_ranks(set(ranks) - set(codes), told[0] if told else signal.SIGTERM, codes)
    if told:
        return 128 + told[0]
    if failures:
        return EXIT_CONFIG_ERROR if EXIT_CONFIG_ERROR in failures else 1
    return 0


def _reap(codes: dict[int, int]) -> None:
    """Record the exit codes of the children that have exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        codes[pid] = _returncode(status)


def _stop_ranks(running: set[int], sig: int, codes: dict[int, int]) -> None:
    """Send ``sig`` to the ranks still running, give them TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (30 by default,
    as torchrun), then SIGKILL."""
    for pid in running:
        os.kill(pid, sig)
    deadline = time.monotonic() + float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
    while not running <= set(codes) and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap(codes)
    for pid in running - set(codes):
        os.kill(pid, signal.SIGKILL)
        codes[pid] = _returncode(os.waitpid(pid, 0)[1])


def _run_rank(request: dict, rank: int, port_reader: int, leader: int) -> None:
    """In a rank forked from the group's leader: torchrun's environment for ``rank``, then the role."""
    code = 1
    try:
        _become(request["module"], leader)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        _show_command([sys.executable, "-u", "-m", request["module"], *request["args"]])  # as torchrun starts it
        port = os.read(port_reader, 64).decode().strip()
        os.close(port_reader)
        if not port:  # the leader failed before its store started
            os._exit(1)
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
        code = _run_role(request["module"], request["args"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        from common.lifecycle import end_now

        end_now(code)


def main() -> None:
    import importlib

    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional library this install lacks: its users import it (and fail) as before
            pass
    import torch

    if torch.cuda.is_initialized():
        raise SystemExit("launch.preload: CUDA was initialized while preloading; a fork could not use it")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    requests = b""
    me = os.getpid()
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            _send({"exit": pid, "code": _returncode(status)})
        if 0 in readable:
            data = os.read(0, 1 << 20)
            if not data:  # the launcher closed us (or died): children still running get SIGTERM as we exit
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
                children.add(pid)
                _send({"pid": pid})


if __name__ == "__main__":
    main()

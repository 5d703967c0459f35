"""The launcher's side of preloaded starts (``launch.preload``; the preloader itself is launch/preload.py): which
commands the preloader starts, the preloader the launcher keeps, and the processes it forked seen as
``subprocess.Popen`` children.

The launcher starts its preloader as its own child (``python -m launch.preload``), or, where DFLASH_PRELOAD_SERVER
names the socket of a preloader server (the test suite runs one per test process, shared by the launchers its
tests start), has the server fork one for it: the same preloader, without importing torch and transformers once
more. It takes the server's fork only where the server imported them with the environment its own preloader would
have had (``imports_alike``), since libraries read some of it at import time.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from common.naming import process_alive

PRELOADED_ROLES = ("producer.server", "trainer.train")
"""The modules the preloader starts, alone or as a group of ranks; any other command is started as a fresh
process."""

PRELOAD_SERVER_ENV = "DFLASH_PRELOAD_SERVER"
"""The Unix socket of a preloader server (``python -m launch.preload --serve PATH``) that forks the launcher's
preloader, if set."""

COMMAND_ROOM = 8192
"""Bytes of blank command line the preloader is started with, so that each child can show its own command there
(``ps``, ``pgrep -f``: ``python -m producer.server --run-dir ...``, as a fresh interpreter would)."""

SPAWN_TIMEOUT_S = 120.0
"""How long a start waits for the preloader (its first start waits for the imports)."""

NOT_READ_AT_IMPORT = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONPATH",
    "_",
    "SHLVL",
    "PWD",
    "OLDPWD",
    "COLUMNS",
    "LINES",
    "PYTEST_CURRENT_TEST",
)
"""Environment variables in which a served preloader's environment may differ from the launcher's: the thread
counts (set in each child), PYTHONPATH (compared as the set of its folders: each child has its own sys.path from
it), what a shell or terminal sets for itself (read when printing, not importing) and pytest's name of the running
test. The project's own DFLASH_* variables may differ too: the project's modules are imported in each child."""

log = logging.getLogger("launch.supervisor")


def request_for(command: list[str]) -> dict | None:
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


def imports_alike(mine: dict[str, str], theirs: dict[str, str]) -> bool:
    """Whether a preloader that imported its libraries with the environment ``theirs`` stands for one started
    with ``mine`` (see NOT_READ_AT_IMPORT)."""

    def imported_with(env: dict[str, str]) -> tuple[dict[str, str], set[str]]:
        kept = {k: v for k, v in env.items() if k not in NOT_READ_AT_IMPORT and not k.startswith("DFLASH_")}
        return kept, set(filter(None, env.get("PYTHONPATH", "").split(os.pathsep)))

    return imported_with(mine) == imported_with(theirs)


def preload_server_command(path: Path) -> list[str]:
    """The command of a preloader server on the Unix socket ``path`` (see PRELOAD_SERVER_ENV)."""
    return [sys.executable, "-m", "launch.preload", "--serve", str(path), " " * COMMAND_ROOM]


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
    """One preloader, the launcher's child or a server's fork, and the starts and exits it reported."""

    def __init__(
        self, pid: int, requests: IO[bytes], answers: IO[bytes], child: subprocess.Popen | None = None
    ) -> None:
        self.pid = pid
        self.requests = requests
        self.child = child
        """The preloader as the launcher's child; None for a server's fork (it ends when its connection does)."""
        self.connection: socket.socket | None = None
        self.answers: queue.Queue[dict] = queue.Queue()
        self.exits: dict[int, int] = {}
        self.gone = False
        self.lock = threading.Lock()
        threading.Thread(target=self._read, args=(answers,), name="preloader", daemon=True).start()

    @classmethod
    def start(cls, env: dict[str, str], preexec: Callable[[], None] | None) -> _PreloaderProcess:
        """The launcher's own preloader, started as its child."""
        child = subprocess.Popen(
            [sys.executable, "-m", "launch.preload", " " * COMMAND_ROOM],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            process_group=0,  # a Ctrl-C reaches the launcher only, as with its other children
            preexec_fn=preexec,
        )
        return cls(child.pid, child.stdin, child.stdout, child)

    @classmethod
    def from_server(cls, path: str, env: dict[str, str]) -> _PreloaderProcess | None:
        """A preloader forked by the server at ``path``; None where there is no server there or it imported with
        another environment than ``env`` (the connection then closes and the fork exits)."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.settimeout(SPAWN_TIMEOUT_S)
            connection.connect(path)
            answers = connection.makefile("rb")
            hello = json.loads(answers.readline() or b"{}")
        except (OSError, ValueError):
            connection.close()
            return None
        if "preloader" not in hello or not imports_alike(env, hello["env"]):
            connection.close()
            return None
        connection.settimeout(None)
        preloader = cls(hello["preloader"], connection.makefile("wb"), answers)
        preloader.connection = connection
        return preloader

    def alive(self) -> bool:
        return not self.gone and (self.child is None or self.child.poll() is None)

    def _read(self, answers: IO[bytes]) -> None:
        for line in answers:
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
        self.requests.write(json.dumps(request).encode() + b"\n")
        self.requests.flush()
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

    def close(self) -> None:
        """End the preloader: it exits when its requests end; SIGKILL if it has not within 10 s."""
        try:
            self.requests.close()
            if self.connection is not None:
                self.connection.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        deadline = time.monotonic() + 10
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._running():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.child is not None:
            self.child.wait()

    def _running(self) -> bool:
        """Whether the process runs: a served preloader's connection ends a moment before its process does."""
        return self.child.poll() is None if self.child is not None else process_alive(self.pid)


class Preloader:
    """The launcher's preloader: started (or had from the preloader server) at the first start it is asked for,
    again after it died, closed with the run."""

    def __init__(self, env: dict[str, str], preexec: Callable[[], None] | None = None) -> None:
        self.env = env
        self.preexec = preexec
        self.current: _PreloaderProcess | None = None

    def spawn(self, command: list[str], env: dict[str, str], log_file: IO[bytes]) -> PreloadedProcess | None:
        """Start ``command`` (see ``request_for``) forked from the preloader, its output appended to ``log_file``;
        None when it is not a command the preloader starts, or the preloader failed (logged: the caller starts a
        fresh interpreter)."""
        request = request_for(command)
        if request is None:
            return None
        if self.current is None or not self.current.alive():
            server = os.environ.get(PRELOAD_SERVER_ENV, "")
            self.current = (server and _PreloaderProcess.from_server(server, self.env)) or _PreloaderProcess.start(
                self.env, self.preexec
            )
        request.update(env=env, cwd=os.getcwd(), log=log_file.name)
        try:
            return PreloadedProcess(self.current.fork(request), self.current)
        except (OSError, queue.Empty) as exc:
            log.warning("the preloader could not start %s (%s): starting a fresh interpreter", command[2], exc)
            return None

    def close(self) -> None:
        """End the preloader (after the run's processes have stopped)."""
        if self.current is not None:
            current, self.current = self.current, None
            current.close()

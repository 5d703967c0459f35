"""Fault injection for the reliability tests and benchmarks: a process is SIGKILLed, or held, at a named point of its
code.

    DFLASH_FAULT="trainer.step:7,producer.publish:3,trainer.checkpoint:1"   the plan, in order
    DFLASH_FAULT_LOG=/tmp/run/faults.jsonl                                   what fired (needed with a plan)

Code marks its fault points with ``point("trainer.step")`` (names and meanings in ``POINTS``). The
first plan entry not yet in the log is the current one. The process that reaches the current
entry's point for the count-th time (counted from when that entry became current for it) appends
the entry to the log, synced to disk, then SIGKILLs the victim: itself, or the ``victim`` pid given
at the point (a producer handling a trainer's HELLO kills that trainer). The launcher restarts the
killed process; its successor reads the log and waits for the next entry. So one run carries a
whole sequence of kills, across processes, each at an exact place.

An entry with seconds holds instead of killing: ``trainer.batch:10=120`` holds the trainer at its tenth batch for
up to 120 s, or until the process is asked to stop (a test's restart-trainer at a known step, whatever the
machine's speed). Like a kill it fires once in the run: the successor does not hold again.

An entry ``=oom`` raises ``torch.OutOfMemoryError`` at the point instead, as a step that does not fit the GPU
would (only where a real one would surface: ``OOM_POINTS``). ``trainer.step:5=oom,trainer.step:5=oom`` makes the
first trainer and its successor each run out of memory in their fifth step: an out-of-memory error that repeats
at the same step, on the CPU.

A point can also be slowed at every reach, or at every N-th, to hold a window open (a checkpoint write in flight
when a restart comes) or to stand in for the pauses of real training in a benchmark:

    DFLASH_FAULT_DELAY="trainer.checkpoint=3"    sleep 3 s at every reach of the point
    DFLASH_FAULT_DELAY="trainer.batch=10/50"     sleep 10 s at every 50th reach (in each process)

Without DFLASH_FAULT and DFLASH_FAULT_DELAY (every real run) ``point`` returns at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PLAN_ENV = "DFLASH_FAULT"
LOG_ENV = "DFLASH_FAULT_LOG"
DELAY_ENV = "DFLASH_FAULT_DELAY"

POINTS = {
    # The trainer is killed ...
    "trainer.handshake": "after a producer reconciled its stream for the trainer's HELLO, before WELCOME "
    "(checked in the producer, which kills the trainer)",
    "trainer.batch": "holding a batch taken from the feeder (received and acked, not trained) while the "
    "producers have more leased to it",
    "trainer.step": "inside a step: after backward, before the optimizer step",
    "trainer.checkpoint": "writing a checkpoint: every file written and synced, before the folder is renamed into place",
    "trainer.latest": "after a checkpoint folder is in place, before latest.json points at it",
    "trainer.stage": "a trainer being replaced (restart-trainer), its last step done, before it copies its state "
    "into shared memory",
    "trainer.handover": "a trainer being replaced: its final state handed over (or checkpointed), leases and status "
    "done, before the handover mark its successor waits for",
    "trainer.takeover": "a standby trainer told to take over, before it waits for the trainer it replaces",
    "trainer.resume": "a successor trainer after the handover, before it reads the state handed over or the latest "
    "checkpoint",
    "trainer.taken": "a successor trainer that mapped the state handed over, before it trains or writes its checkpoint",
    "trainer.export": "asking for an evaluation: its drafter exported, before the request is written (the export thread)",
    # The producer is killed ...
    "producer.handshake": "handling a trainer's HELLO: before reconciling and before WELCOME",
    "producer.fill": "filling a slot: batch taken from the stream, slot FILLING, nothing announced",
    "producer.publish": "right after announcing a batch (the slot is READY, possibly leased at once)",
    "producer.evaluate": "evaluating a drafter for the trainer: the request claimed, no result written",
}
OOM_POINTS = ("trainer.step",)
"""Points where ``=oom`` may stand: where a step's memory runs out (its forward and backward are done there)."""
OOM = "oom"


@dataclass(frozen=True)
class Fault:
    point: str
    count: int
    hold_s: float | None = None
    """Hold this long at the point instead of a kill (None: kill)."""
    oom: bool = False
    """Raise torch.OutOfMemoryError at the point instead of a kill."""


@dataclass(frozen=True)
class Delay:
    seconds: float
    every: int = 1
    """Sleep at every this-many-th reach of the point."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return -1.0
    return value if value >= 0 else -1.0


def parse_plan(text: str) -> list[Fault]:
    """``"point:count,point:count=seconds,point:count=oom"`` as Faults; unknown points, counts below 1, negative holds
    and ``=oom`` outside ``OOM_POINTS`` are errors."""
    plan = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kill, equals, hold = item.partition("=")
        name, colon, count = kill.rpartition(":")
        oom = bool(equals) and hold == OOM
        if not colon or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{PLAN_ENV}: {item!r} is not point:count with a count >= 1")
        if equals and not oom and _seconds(hold) < 0:
            raise ValueError(f"{PLAN_ENV}: {item!r} holds for {hold!r}, not seconds >= 0 (or {OOM})")
        if name not in POINTS:
            raise ValueError(f"{PLAN_ENV}: unknown fault point {name!r} in {item!r}; known: {', '.join(POINTS)}")
        if oom and name not in OOM_POINTS:
            raise ValueError(f"{PLAN_ENV}: {item!r}: ={OOM} only at {', '.join(OOM_POINTS)}")
        plan.append(Fault(name, int(count), _seconds(hold) if equals and not oom else None, oom=oom))
    return plan


def format_plan(plan: list[Fault]) -> str:
    """The DFLASH_FAULT value of ``plan``."""
    return ",".join(
        f"{fault.point}:{fault.count}"
        + (f"={OOM}" if fault.oom else f"={fault.hold_s}" if fault.hold_s is not None else "")
        for fault in plan
    )


def parse_delays(text: str) -> dict[str, Delay]:
    """``"point=seconds,point=seconds/every"`` as {point: Delay}; unknown points, negative times and periods below 1
    are errors."""
    delays = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = item.partition("=")
        seconds, slash, every = value.partition("/")
        if not equals or _seconds(seconds) < 0 or (slash and not (every.isdigit() and int(every) >= 1)):
            raise ValueError(f"{DELAY_ENV}: {item!r} is not point=seconds or point=seconds/every with seconds >= 0")
        if name not in POINTS:
            raise ValueError(f"{DELAY_ENV}: unknown fault point {name!r} in {item!r}; known: {', '.join(POINTS)}")
        delays[name] = Delay(_seconds(seconds), int(every) if slash else 1)
    return delays


def read_log(path: Path) -> list[dict]:
    """The faults that fired, in order (one JSON object per line)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class _Injector:
    def __init__(self, plan: list[Fault], log_path: Path) -> None:
        self.plan = plan
        self.log_path = log_path
        self._lock = threading.Lock()  # points are reached from several threads (producer: compute, publisher, server)
        self._stamp: tuple[int, int] | None = None
        self._current = 0
        self._reached = 0

    def reach(self, name: str, victim: int | None) -> Fault | None:
        """Count a reach of ``name``; kills when the plan says so, or returns the hold or out-of-memory that fired."""
        with self._lock:
            self._refresh()
            if self._current >= len(self.plan) or self.plan[self._current].point != name:
                return None
            self._reached += 1
            if self._reached >= self.plan[self._current].count:
                return self._fire(name, victim)
            return None

    def _refresh(self) -> None:
        """Follow the log: a fault fired elsewhere makes the next entry current, counted from zero."""
        try:
            info = os.stat(self.log_path)
            stamp = (info.st_size, info.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self._advance_to(len(read_log(self.log_path)))

    def _advance_to(self, fired: int) -> None:
        if fired != self._current:
            self._current, self._reached = fired, 0

    def _fire(self, name: str, victim: int | None) -> Fault | None:
        pid = os.getpid() if victim is None else victim
        with open(self.log_path, "a+") as log:
            fcntl.flock(log, fcntl.LOCK_EX)  # another process may be firing the same entry right now
            log.seek(0)
            fired = sum(1 for line in log.read().splitlines() if line.strip())
            if fired != self._current:
                self._advance_to(fired)  # it fired elsewhere first; this reach does not count for the next
                return None
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None  # the victim is already gone: wait for the next reach
            fault = self.plan[self._current]
            log.write(
                json.dumps(
                    {
                        "index": self._current,
                        "point": name,
                        "count": fault.count,
                        "pid": pid,
                        "by": os.getpid(),
                        "time": time.time(),
                        **({"hold_s": fault.hold_s} if fault.hold_s is not None else {}),
                        **({OOM: True} if fault.oom else {}),
                    }
                )
                + "\n"
            )
            log.flush()
            os.fsync(log.fileno())
            self._advance_to(self._current + 1)
            if fault.hold_s is not None or fault.oom:
                return fault
            os.kill(pid, signal.SIGKILL)
            return None


def _from_environment() -> _Injector | None:
    text = os.environ.get(PLAN_ENV, "").strip()
    if not text:
        return None
    if not os.environ.get(LOG_ENV):
        raise ValueError(f"{PLAN_ENV} is set but {LOG_ENV} (the file that records what fired) is not")
    return _Injector(parse_plan(text), Path(os.environ[LOG_ENV]))


_INJECTOR = _from_environment()
_DELAYS = parse_delays(os.environ.get(DELAY_ENV, ""))
_REACHED: dict[str, int] = {}


def point(name: str, victim: int | None = None, stop: Callable[[], bool] | None = None) -> None:
    """A fault point: sleep here if DFLASH_FAULT_DELAY says so, then SIGKILL (of this process, or of
    ``victim``), hold, or raise torch.OutOfMemoryError when the plan says so. ``stop``: a hold ends early once it
    returns True."""
    if _DELAYS and name in _DELAYS:
        _REACHED[name] = _REACHED.get(name, 0) + 1
        if _REACHED[name] % _DELAYS[name].every == 0:
            time.sleep(_DELAYS[name].seconds)
    fault = _INJECTOR.reach(name, victim) if _INJECTOR is not None else None
    if fault is not None and fault.oom:
        import torch  # only a process that has it reaches an =oom point (OOM_POINTS)

        raise torch.OutOfMemoryError(f"out of memory, injected by {PLAN_ENV} ({name}:{fault.count}={OOM})")
    if fault is not None and fault.hold_s is not None:
        until = time.monotonic() + fault.hold_s
        while time.monotonic() < until and not (stop is not None and stop()):
            time.sleep(min(0.05, max(0.0, until - time.monotonic())))

"""The control files of RUN/control/ (common/rundir.py names them): what one process asks of another, as typed
records written and read in one place. The launcher's command line asks the running launcher for a
restart-trainer (``RestartRequest``) and reads its answer (``RestartResult``); the launcher tells a standby
trainer to take over (``StandbyGo``) and asks a running one to hand its state over (``HandoverRequest``); a trainer
that ends leaves its ``HandoverMark`` for its successor, and a trainer started by restart-trainer is told the one it
replaces through ``PREDECESSOR_ENV``.

Each is a ``JsonRecord`` (common/records.py): written whole and durably; ``read`` returns None where there is none
(or what is there is not such a record).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from common.records import JsonRecord

PREDECESSOR_ENV = "DFLASH_TRAINER_AFTER"
"""Set by the launcher on restart-trainer: ``pid:start_ticks`` of the trainer this one replaces."""


@dataclass
class RestartRequest(JsonRecord):
    """``run_all.sh restart-trainer``'s request to the running launcher (which SIGUSR1 wakes)."""

    request_id: str
    overrides: list[str]
    requested: float = field(default_factory=time.time)


@dataclass
class RestartResult(JsonRecord):
    """The launcher's answer to the request ``request_id``."""

    request_id: str
    ok: bool
    error: str | None = None
    trainer_pid: int | None = None
    """The new trainer, or None where it starts once the producers are ready."""
    changed: list[str] = field(default_factory=list)
    answered: float = field(default_factory=time.time)


@dataclass
class StandbyGo(JsonRecord):
    """The launcher's word to a standby trainer: take over the run."""

    predecessor: str | None = None
    """``pid:start_ticks`` of the trainer it replaces, still finishing its step (None: there is none)."""


@dataclass
class HandoverRequest(JsonRecord):
    """The launcher's request to a single-process trainer that restart-trainer replaces: hand the state over in
    shared memory instead of writing a disk checkpoint; its successor runs on ``successor_devices``."""

    successor_devices: list[str]


@dataclass
class HandoverMark(JsonRecord):
    """What a trainer leaves as it ends, after everything of the run is done: its successor may start."""

    pid: int
    start_ticks: int | None
    step: int
    time: float
    state: dict[str, Any] | None = None
    """The state handed over in shared memory (trainer/handover.py), or None (the disk checkpoint is the state)."""

"""The trainer's status file, RUN/trainer.json: written by the trainer, read by the launcher, ``status`` and the
progress view. One typed record, so that writer and readers agree on every field's name and meaning."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.rundir import atomic_write_json, read_json


@dataclass
class TrainerStatus:
    """What the trainer of a run is doing. A trainer that is still starting has written only ``pid``,
    ``incarnation``, ``state`` and ``updated``; a record read where there is no file has ``pid`` None."""

    pid: int | None = None
    incarnation: int | None = None
    state: str | None = None
    """starting, taking over, training, checkpointing, handing over, stalled, finished or stopped."""
    updated: float = 0.0
    """When it was written (time.time())."""
    step: int = 0
    start_step: int | None = None
    """The step this trainer started at (resumed from)."""
    max_steps: int | None = None
    trained_s: float | None = None
    """Seconds trained so far (training.max_minutes' clock, earlier trainers of the run included)."""
    max_minutes: float | None = None
    loss: float | None = None
    tau: float | None = None
    """Simulated tau of the last metrics window."""
    lr: float | None = None
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    kind: str | None = None
    """The drafter kind (drafter.kind)."""
    kind_metrics: dict[str, float] = field(default_factory=dict)
    """The kind's own figures of the last window (DFlash 2: the selector's)."""
    eval: dict[str, Any] | None = None
    """The last evaluation's figures (real tau, its step, ...), as the evaluation client keeps them."""
    evals_in_flight: list[int] = field(default_factory=list)
    """Steps whose evaluation is asked for and not yet back."""
    parallelism: str | None = None
    drafter_params_total: int | None = None
    drafter_params_per_rank: list[int] | None = None
    last_checkpoint: dict[str, Any] | None = None
    checkpoint_writing: str | None = None
    """The checkpoint being written in the background, if any."""

    def write(self, path: Path) -> None:
        """Every step while an evaluation is out: not durable, so it never waits behind a checkpoint's write."""
        atomic_write_json(path, dataclasses.asdict(self), durable=False)

    @classmethod
    def starting(cls, pid: int, incarnation: int, state: str) -> TrainerStatus:
        return cls(pid=pid, incarnation=incarnation, state=state, updated=time.time())

    @classmethod
    def read(cls, path: Path) -> TrainerStatus:
        """The record in ``path``; an empty one (pid None) where there is none yet. Keys of another version of the
        record are left out."""
        data = read_json(path) or {}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def figures(self) -> dict[str, Any]:
        """As plain data (``run_all.sh status --json``)."""
        return dataclasses.asdict(self)

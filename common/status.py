"""The run's status files, one typed record each, so that writer and readers agree on every field's name and
meaning: RUN/trainer.json (``TrainerStatus``), RUN/producers/p{I}.json (``ProducerStatus``), RUN/launcher.json
(``LauncherRecord``) and a synthesis producer's SHARDS/status-p{I}.json (``SynthesisStatus``). Each is a
``JsonRecord`` (common/records.py): readers leave out keys of another version of a record and give missing ones
their defaults. Live status is rewritten often and written without an fsync; launcher.json, which ``stop`` and a
second launcher rely on, with one."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from common.metrics import ProducerStats
from common.records import JsonRecord, known_fields
from common.rundir import RunDir


@dataclass
class TrainerStatus(JsonRecord):
    """What the trainer of a run is doing. A trainer that is still starting has written only ``pid``,
    ``incarnation``, ``state`` and ``updated``; a record read where there is no file has ``pid`` None."""

    pid: int | None = None
    incarnation: int | None = None
    state: str | None = None
    """starting, taking over, training, checkpointing, handing over, finished or stopped."""
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

    DURABLE: ClassVar[bool] = False  # every step while an evaluation is out

    @classmethod
    def starting(cls, pid: int, incarnation: int, state: str) -> TrainerStatus:
        return cls(pid=pid, incarnation=incarnation, state=state, updated=time.time())

    @classmethod
    def read(cls, path: Path) -> TrainerStatus:
        """The record in ``path``; an empty one (pid None) where there is none yet."""
        return super().read(path) or cls()

    def figures(self) -> dict[str, Any]:
        """As plain data (``run_all.sh status --json``)."""
        return dataclasses.asdict(self)


@dataclass
class ProducerStatus(JsonRecord):
    """What producer I is doing, RUN/producers/p{I}.json: written by the producer about once a second, read by the
    launcher (is it ready, at which endpoint), the trainer (where to connect; epoch sizes), ``status`` and the
    progress view. Fields a writer leaves out keep their defaults."""

    id: int = 0
    pid: int | None = None
    """The producer's process (rank 0's, for a tensor-parallel producer)."""
    torchrun_pid: int | None = None
    """A tensor-parallel producer's torchrun, the process the launcher started."""
    tensor_parallel: dict[str, Any] | None = None
    """A tensor-parallel producer's ``size`` and its ranks' ``pids``."""
    ready: bool = False
    """Its ring serves; False again once the launcher saw it die."""
    endpoint: str | None = None
    """Where its ring server listens (ZeroMQ)."""
    updated: float = 0.0
    """When it was written (time.time())."""
    load_s: float | None = None
    """Seconds the target took to load."""
    device: str | None = None
    kernels: dict[str, Any] = field(default_factory=dict)
    """The attention and linear-attention kernels the target runs, and whether it is compiled."""
    jobs: dict[str, Any] = field(default_factory=dict)
    """What each of its jobs is doing, by name (producer 0's ``evaluating``: ``step``, the step it evaluates or None,
    ``answered``, the step it answered last, ``doing``, the evaluator's phase, and ``held_s``, the seconds it batches
    before taking the next request)."""
    ring: dict[str, Any] = field(default_factory=dict)
    """Slot counts by state (``slots``, ``free``, ``filling``, ``ready``, ``leased``), ``backend``, ``slot_bytes``."""
    epoch_batches: int | None = None
    """Batches in one epoch of its shard, once planned (training.max_steps = 0 counts epochs by them)."""
    tokens_per_s: float | None = None
    """Tokens published per second over the last 10 s."""
    blocked_fraction: float | None = None
    """The share of the last 10 s it waited for a free slot (the trainer is the bottleneck)."""
    batching: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    """Its data source's counters and cache."""
    stream: dict[str, Any] = field(default_factory=dict)
    """Its position in the batch stream."""
    server: dict[str, Any] = field(default_factory=dict)
    """The ring server's counters (published, reclaimed, consumers, dropped messages, ...)."""

    DURABLE: ClassVar[bool] = False  # rewritten every second

    @classmethod
    def showing(cls, stats: ProducerStats, ring: dict[str, Any], **fields: Any) -> ProducerStatus:
        """A status with ``fields`` that shows ``stats``: each statistic this record has a field of in that field (the
        ring's counts beside the other keys of ``ring``), the others (the ring server's counters) in ``server``."""
        wire = stats.to_wire()
        shown = known_fields(cls, wire)
        server = {key: value for key, value in wire.items() if key not in shown}
        return cls(**fields, **shown | {"ring": {**shown["ring"], **ring}}, server=server)

    @classmethod
    def read_all(cls, run: RunDir) -> list[ProducerStatus]:
        """Every producer's status file in ``run``, by id."""
        found = [cls.read(path) for path in sorted(run.producers.glob("p*.json"))]
        return sorted((status for status in found if status is not None), key=lambda status: status.id)

    def written_by(self, pid: int | None) -> bool:
        """Whether the process ``pid`` the launcher started wrote it (rank 0 of a tensor-parallel producer is a child
        of that torchrun): a file of an earlier incarnation describes a ring that no longer exists."""
        return pid is not None and pid in (self.pid, self.torchrun_pid)


@dataclass
class ChildRecord:
    """A process the launcher started, as launcher.json keeps it."""

    pid: int | None = None
    start_ticks: int | None = None
    """Its start time in clock ticks since boot, so that a recycled pid is not mistaken for it."""
    started: float | None = None
    status_since: float | None = None
    """When its current status file began to describe it (a trainer's status of an earlier trainer is stale)."""
    incarnation: int | None = None
    restarts: int = 0
    """The role's restarts in this run."""
    id: int | None = None
    """A producer's id."""
    device: str | None = None
    """A producer's devices, comma-separated."""
    devices: list[str] | None = None
    """A trainer's devices."""
    ready: bool | None = None
    """A producer's readiness, as the launcher last saw it."""


@dataclass
class LauncherRecord(JsonRecord):
    """RUN/launcher.json: the launcher's pid file, with its children's. Written by the launcher; read by ``status``,
    ``stop``, a second launcher (which refuses to start beside it) and the tools."""

    pid: int | None = None
    start_ticks: int | None = None
    started: float | None = None
    run_dir: str | None = None
    state: str | None = None
    """starting, running, stopping, finished, failed or stopped."""
    exit_code: int | None = None
    producers: list[ChildRecord] = field(default_factory=list)
    trainer: ChildRecord = field(default_factory=ChildRecord)
    standby_trainer: ChildRecord | None = None
    """The trainer started ahead, waiting to take over, if any."""
    updated: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "updated": time.time()}  # stamped when written

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LauncherRecord | None:
        record = super().from_json(data)
        if record is not None:  # the children, read as plain dicts, as records
            record.producers = [_child(child) for child in data.get("producers") or []]
            record.trainer = _child(data.get("trainer") or {})
            record.standby_trainer = _child(data["standby_trainer"]) if data.get("standby_trainer") else None
        return record

    def children(self) -> list[ChildRecord]:
        """Its children, trainers first (the order they are stopped in)."""
        trainers = [self.trainer] + ([self.standby_trainer] if self.standby_trainer is not None else [])
        return [child for child in trainers + self.producers if child.pid is not None]


def _child(data: dict[str, Any]) -> ChildRecord:
    return ChildRecord(**known_fields(ChildRecord, data))


@dataclass
class SynthesisStatus(JsonRecord):
    """What synthesis producer I has done, FOLDER/status-p{I}.json beside its shards: written by the producer every
    few seconds (through a long generation batch too), read by ``run_all.sh synthesize`` for its progress line and
    summary. Counts are of this start unless they say otherwise; they are progress only: what is done is what the
    shards hold."""

    producer: int = 0
    pid: int | None = None
    job: str = "synthesize"
    written: int = 0
    """Records written this start (in whole shards)."""
    answered: int = 0
    """Prompts answered this start (kept, cut short or skipped), counted as each conversation ends, before its shard
    is written."""
    turns: int = 0
    """Turns the target wrote this start (its answers, and its own user turns for Magpie prompts)."""
    turns_planned: int = 0
    """Turns the prompts pending at this start plan (less those of conversations that ended early)."""
    eta_s: float | None = None
    """Seconds left to the end of its share: the tokens its turns still need (each kind of turn at the mean length
    of those written so far, its cap before any) at that kind's pace so far; None before the first token."""
    pending_at_start: int = 0
    """Prompts of its share not yet answered when this start began."""
    total: int = 0
    """Prompts of its share, earlier starts' included."""
    new_tokens: int = 0
    tokens_per_s: float = 0.0
    """New tokens per second of generation."""
    occupancy: float = 0.0
    """The share of the generator's rows that were busy."""
    engine: str | None = None
    seconds: float = 0.0
    """Seconds since this start began."""
    finished: bool = False
    skipped: dict[str, int] = field(default_factory=dict)
    """Prompts skipped, by reason."""
    first_skipped: list[str] = field(default_factory=list)
    """The first ten skipped prompts, ``file:line reason``."""
    cut: dict[str, int] = field(default_factory=dict)
    """Conversations ended early, by reason (a tool call the target made differently)."""
    cut_after_turn: dict[str, int] = field(default_factory=dict)

    DURABLE: ClassVar[bool] = False  # progress, rewritten every few seconds (the shards are durable)

    @staticmethod
    def path(folder: Path, producer_id: int) -> Path:
        """Producer ``producer_id``'s record in the shard folder ``folder``."""
        return folder / f"status-p{producer_id}.json"

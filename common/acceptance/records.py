"""The records of the evaluations the trainer asks of a producer: requests, claims and results through the run
directory.

The trainer never loads a target. At an evaluation step it exports the drafter it wants evaluated into
``evals/step-N-I/drafter`` (the z-lab format, as a checkpoint's; I is the asking trainer's incarnation) and then
writes ``request.json`` there.
Producer 0, which holds the target already, takes the oldest open request between two of its batches:
it writes ``claim.json`` (its pid and start time), runs real speculative decoding and the simulated
acceptance, and writes ``result.json``. The trainer logs the result at the step it belongs to.

Why files and a checkpoint-format export rather than shared memory: an evaluation happens every few
hundred steps and reads a few GB once, which a page-cached file serves as fast; the export is the very
format servers and ``python -m launch.evaluate`` read; and a request, a claim and a result survive the
death of either side, so a producer restarted during an evaluation marks it lost (the trainer logs that)
and no batch of data is touched. Every file is written whole (temporary name, fsync, rename), the request
last, so a reader never sees half an export.

A request belongs to one incarnation: a trainer that resumed from an earlier checkpoint asks again at a
step its predecessor already asked for, with other weights, and gets its own result. A successor adopts
its predecessor's requests up to the step it resumed at (``adoptable``) and marks each result it logged
(``mark_logged``), so a result is logged once whoever asked for it.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.naming import process_alive, process_start_ticks
from common.rundir import RunDir, atomic_write_json, read_json

STEP_DIR = re.compile(r"step-(\d+)-(\d+)$")


@dataclass
class AcceptanceRequest:
    """What the trainer wants evaluated."""

    step: int
    """The optimizer step whose weights these are."""
    drafter: str
    """The exported drafter's folder (z-lab format)."""
    incarnation: int
    """The asking trainer's incarnation."""
    requested: float = field(default_factory=time.time)
    final: bool = False
    """Asked at the run's last step: training has ended, the trainer waits for nothing else, so producer 0 takes it
    at once (eval.producer_share paces the evaluations asked during training only)."""


@dataclass
class AcceptanceResult:
    """A finished (or lost) evaluation."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    """``eval/*`` figures of common.acceptance.report.AcceptanceReport.metrics()."""
    lost: str | None = None
    """Why there is no figure (the producer died during it, the export could not be read, ...)."""
    incarnation: int = 0
    """The asking trainer's incarnation (the request's)."""
    producer: int = 0
    finished: float = field(default_factory=time.time)


def folder(run: RunDir, step: int, incarnation: int) -> Path:
    return run.root / "evals" / f"step-{step:08d}-{incarnation}"


def request(run: RunDir, req: AcceptanceRequest) -> None:
    """Publish a request whose export is already complete in ``req.drafter``."""
    atomic_write_json(folder(run, req.step, req.incarnation) / "request.json", asdict(req))


def _keys(run: RunDir) -> list[tuple[int, int]]:
    """(step, incarnation) of every request folder, oldest step first."""
    root = run.root / "evals"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), int(m.group(2))) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


def open_requests(run: RunDir) -> list[AcceptanceRequest]:
    """Requests without a claim or a result, oldest first."""
    found = []
    for step, incarnation in _keys(run):
        here = folder(run, step, incarnation)
        if (here / "result.json").exists() or (here / "claim.json").exists():
            continue
        data = read_json(here / "request.json")
        if data is not None:
            found.append(AcceptanceRequest(**data))
    return found


def claim(run: RunDir, req: AcceptanceRequest, producer_id: int, pid: int) -> None:
    atomic_write_json(
        folder(run, req.step, req.incarnation) / "claim.json",
        {"producer": producer_id, "pid": pid, "start_ticks": process_start_ticks(pid), "claimed": time.time()},
    )


def finish(run: RunDir, result: AcceptanceResult) -> None:
    """Write the result and drop the export (its weights were only needed for this evaluation)."""
    here = folder(run, result.step, result.incarnation)
    atomic_write_json(here / "result.json", asdict(result))
    shutil.rmtree(here / "drafter", ignore_errors=True)


def result(run: RunDir, step: int, incarnation: int) -> AcceptanceResult | None:
    data = read_json(folder(run, step, incarnation) / "result.json")
    return AcceptanceResult(**data) if data is not None else None


def finished_at(run: RunDir, step: int) -> AcceptanceResult | None:
    """The evaluation of ``step`` that has figures, by whichever trainer incarnation asked (None: never evaluated)."""
    for key_step, incarnation in reversed(_keys(run)):
        found = result(run, key_step, incarnation) if key_step == step else None
        if found is not None and found.lost is None and found.metrics:
            return found
    return None


def mark_logged(run: RunDir, step: int, incarnation: int) -> None:
    """Note that a trainer logged this result (or its loss), so that no successor logs it again."""
    (folder(run, step, incarnation) / "logged").touch()


def adoptable(run: RunDir, up_to_step: int, incarnation: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """A new trainer ``incarnation`` that resumed at ``up_to_step``: (the other incarnations' requests it
    adopts, at steps up to its own, whose results are not logged yet; those past its step, whose weights
    its lineage never had), as (step, incarnation)."""
    adopted, superseded = [], []
    for step, asked_by in _keys(run):
        here = folder(run, step, asked_by)
        if asked_by == incarnation or (here / "logged").exists() or not (here / "request.json").exists():
            continue
        (adopted if step <= up_to_step else superseded).append((step, asked_by))
    return adopted, superseded


def mark_abandoned_exports_lost(run: RunDir, incarnation: int) -> list[int]:
    """Export folders of other incarnations with neither a request nor a result, at the start of trainer
    ``incarnation``: their trainer stopped (was killed) before its request, and no one else exports now (a
    trainer starts once the one before is gone or has handed over). Written as lost, which also removes the
    partial export (gigabytes of weights). Their steps."""
    lost = []
    for step, asked_by in _keys(run):
        here = folder(run, step, asked_by)
        if asked_by == incarnation or (here / "request.json").exists() or (here / "result.json").exists():
            continue
        finish(
            run,
            AcceptanceResult(
                step=step,
                incarnation=asked_by,
                lost="the trainer that asked for it stopped before its export was complete",
            ),
        )
        lost.append(step)
    return lost


def mark_abandoned_claims_lost(run: RunDir, producer_id: int) -> list[int]:
    """Claims of this producer id by a process that is gone, without a result: written as lost. Their steps."""
    lost = []
    for step, incarnation in _keys(run):
        here = folder(run, step, incarnation)
        if (here / "result.json").exists():
            continue
        claimed = read_json(here / "claim.json")
        if (
            claimed
            and claimed.get("producer") == producer_id
            and not (isinstance(claimed.get("pid"), int) and process_alive(claimed["pid"], claimed.get("start_ticks")))
        ):
            finish(
                run,
                AcceptanceResult(
                    step=step,
                    lost="the producer evaluating it was restarted",
                    incarnation=incarnation,
                    producer=producer_id,
                ),
            )
            lost.append(step)
    return lost

"""The live view of a run in the foreground launcher: a progress bar on a terminal, a line per metrics update
elsewhere. Drawn from the trainer's and the producers' status files, so it follows the current trainer:
after a restart (or while a new trainer loads) the old one's figures are not shown as the new one's.

On a terminal (tqdm, as the ecosystem's trainers draw it)::

    step 1550/3000 ████████████        52% 1:02:10<0:58:03, loss 3.140  lr 3.1e-04  tau 3.64  real 3.20@1500
    6.8 samples/s  ring 4/4 3/4
"""

from __future__ import annotations

import logging
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from common.rundir import RunDir
from common.status import ProducerStatus, TrainerStatus


def trainer_figures(status: dict[str, Any], evaluating: Any = None) -> list[str]:
    """The training figures of trainer.json as short labelled texts (those it has); ``evaluating``: producer 0's
    evaluation job status (its status file's ``jobs``), which says what the evaluations asked for wait on."""
    parts = []
    for key, label, fmt in (("loss", "loss", "{:.3f}"), ("lr", "lr", "{:.1e}"), ("tau", "tau", "{:.2f}")):
        if status.get(key) is not None:
            parts.append(f"{label} {fmt.format(status[key])}")
    evaluation = status.get("eval")
    if evaluation and evaluation.get("tau") is not None:
        parts.append(f"real {evaluation['tau']:.2f}@{evaluation['step']}")
    if status.get("evals_in_flight"):
        final = status.get("state") == "final evaluation"
        parts.append(evaluations_waiting(status["evals_in_flight"], evaluating, final))
    if status.get("checkpoint_writing"):
        parts.append(f"writing {status['checkpoint_writing']}")
    if status.get("samples_per_s") is not None:
        parts.append(f"{status['samples_per_s']:.1f} samples/s")
    return parts


def evaluations_waiting(in_flight: list[int], job: Any, final: bool = False) -> str:
    """Where the evaluations asked for (their steps) are, from producer 0's evaluation job status (``step``,
    ``answered``, ``doing``, ``held_s``): ``evaluating 300: decoding, 0/16 prompts done``, or what it waits for.
    ``final``: training has ended, and producer 0 takes the last one whatever its hold (eval.producer_share)."""
    job = job if isinstance(job, dict) else {}
    step, doing, held = job.get("step"), job.get("doing"), None if final else job.get("held_s")
    if step in in_flight:
        queued = ",".join(str(other) for other in in_flight if other != step)
        return f"evaluating {step}" + (f": {doing}" if doing else "") + (f" ({queued} queued)" if queued else "")
    if job.get("answered") in in_flight:  # answered, and the trainer reads the result at its next look
        return f"evaluating {job['answered']}: done, the trainer reads its result"
    steps = ",".join(map(str, in_flight))
    if held:
        return f"evaluating {steps}: queued, producer 0 makes batches {held:.0f} s more (eval.producer_share)"
    if doing:
        return f"evaluating {steps}: queued, producer 0 is {doing}"
    return f"evaluating {steps}: waiting for producer 0 to start it"


def ring_occupancy(rings: list[dict[str, Any]]) -> str:
    """Full slots (ready or leased) of each producer's ring (its status's ``ring``): ``ring 3/4 4/4``."""
    cells = []
    for ring in rings:
        if ring.get("slots"):
            cells.append(f"{(ring.get('ready') or 0) + (ring.get('leased') or 0)}/{ring['slots']}")
        else:
            cells.append("-")
    return "ring " + " ".join(cells) if cells else ""


def eta_s(status: dict) -> float | None:
    """Seconds to the run's end from a trainer status: its steps left at its pace, or its time budget's rest
    (training.max_minutes), whichever ends first."""
    left = []
    if status.get("max_steps") and status.get("steps_per_s"):
        left.append(max(0, status["max_steps"] - (status.get("step") or 0)) / status["steps_per_s"])
    if status.get("max_minutes") and status.get("trained_s") is not None:
        left.append(max(0.0, 60 * status["max_minutes"] - status["trained_s"]))
    return min(left, default=None)


def significant(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits without an exponent, whole numbers kept whole: 0.27 stays 0.270
    (not 0, which reads as a hang), 99.6 stays 99.6, 1234.4 is 1234; ``-`` for None."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    rounded = float(f"{value:.{digits}g}")  # 9.996 -> 10.0: the digits counted after rounding
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{value:.{decimals}f}"


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressView:
    """The launcher's live view; ``update`` is called at every poll, ``write`` prints a log line above the bar."""

    def __init__(self, run: RunDir, enabled: bool = True, terminal: bool | None = None) -> None:
        self.run = run
        self.enabled = enabled
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self.started = time.monotonic()
        self._bar = None
        self._last_shown: tuple | None = None

    def update(self, trainer_started_wall: float, trainer_alive: bool) -> None:
        """Redraw from the status files. Figures of a trainer.json older than the current trainer (started at
        ``trainer_started_wall``, 0 before the first) are not shown."""
        if not self.enabled:
            return
        record = TrainerStatus.read(self.run.trainer_status)
        status = record.figures()
        # The current trainer's own file (a finished or crashed trainer's last figures are still its own).
        current = trainer_started_wall > 0 and record.updated >= trainer_started_wall
        step, max_steps = record.step, record.max_steps
        producers = ProducerStatus.read_all(self.run)
        if current:
            evaluating = next((p.jobs.get("evaluating") for p in producers if p.id == 0), None)
            parts = trainer_figures(status, evaluating)
        else:
            parts = ["trainer starting" if trainer_alive else "waiting for the producers"]
        if current and record.state not in (None, "training", "finished"):
            parts.insert(0, record.state)
        ring = ring_occupancy([producer.ring for producer in producers])
        if ring:
            parts.append(ring)
        postfix = "  ".join(parts)
        if self.terminal:
            self._draw(step if current else None, max_steps, postfix)
            return
        # Training over, a line each time what the run waits for changes (it would otherwise look hung).
        key = (step, record.loss, current, postfix if record.state == "final evaluation" else None)
        if current and record.loss is not None and key != self._last_shown:
            self._last_shown = key
            eta = eta_s(status)
            print(
                f"step {step}/{max_steps}  elapsed {format_duration(time.monotonic() - self.started)}  "
                f"eta {format_duration(eta)}  {postfix}",
                flush=True,
            )

    def _draw(self, step: int | None, max_steps: int | None, postfix: str) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(
                total=max_steps,
                initial=step or 0,
                desc="step",
                dynamic_ncols=True,
                leave=True,
                bar_format="{desc} {n_fmt}/{total_fmt} {bar} {percentage:3.0f}% {elapsed}<{remaining}{postfix}",
            )
        if max_steps and self._bar.total != max_steps:
            self._bar.total = max_steps
        if step is not None and step != self._bar.n:
            if step < self._bar.n:  # a new trainer resumed from an earlier checkpoint
                self._bar.reset(total=max_steps)
            self._bar.update(step - self._bar.n)
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()

    def write(self, line: str) -> None:
        """A log line, above the bar when there is one."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ViewHandler(logging.Handler):
    """The launcher's terminal log handler: its lines go above the progress bar instead of through it."""

    def __init__(self, view: ProgressView) -> None:
        super().__init__()
        self.view = view

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.view.write(self.format(record))
        except Exception:
            self.handleError(record)


def run_summary(run: RunDir) -> str:
    """What a finished run leaves and what to do next: the last checkpoint, the final simulated (training) and real
    tau, and the commands that evaluate and export it, each ready to paste."""
    status = TrainerStatus.read(run.trainer_status)
    checkpoint = run.latest_checkpoint()
    lines = [f"run finished at step {status.step}: {run.root}"]
    lines.append(f"  last checkpoint  {checkpoint}" if checkpoint else "  no checkpoint was written")
    if status.tau is not None:
        lines.append(f"  simulated tau    {status.tau:.3f} (training, the last metrics window)")
    evaluation = status.eval or {}
    if evaluation.get("tau") is not None:
        simulated = f", simulated {evaluation['sim_tau']:.3f}" if evaluation.get("sim_tau") is not None else ""
        lines.append(f"  real tau         {evaluation['tau']:.3f} at step {evaluation['step']}{simulated} (held out)")
    if checkpoint is None:
        return "\n".join(lines)
    run_all, export = run_all_command(), run.root / "export"
    lines += [
        "next (the export prints the commands that serve it, for each server that serves its kind):",
        f"  {run_all} evaluate --checkpoint {shlex.quote(str(checkpoint))}",
        f"  {run_all} export --checkpoint {shlex.quote(str(checkpoint))} --out {shlex.quote(str(export))}",
    ]
    return "\n".join(lines)


def run_all_command() -> str:
    """``launch/run_all.sh`` as the README writes it, from the repository root; elsewhere its whole path, so that
    the printed commands paste as they are."""
    run_all = Path(__file__).resolve().with_name("run_all.sh")
    inside = Path.cwd().resolve() == run_all.parents[1]
    return shlex.quote(str(run_all.relative_to(run_all.parents[1]) if inside else run_all))

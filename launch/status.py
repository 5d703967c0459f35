"""The live state of a run, from the files in its run directory (no sockets, no signals).

    python -m launch.status --run-dir DIR [--json]     (or: launch/run_all.sh status ...)

Exit 0 when a launcher runs this directory, 1 otherwise (the state is printed either way).
A pid counts as alive when the process exists and is the one recorded (pid plus start time from
launcher.json, so a recycled pid is not mistaken for it); without a launcher record, a producer
counts as alive when its pid exists and its p{I}.json was updated within the last 10 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.naming import process_alive
from common.rundir import RunDir, last_json_line
from common.status import ChildRecord, LauncherRecord, ProducerStatus, TrainerStatus
from launch.progress import eta_s, format_duration, ring_occupancy, trainer_figures

STALE_AFTER_S = 10.0
RING_FIELDS = ("slots", "free", "filling", "ready", "leased")


def _age(updated: object, now: float) -> float | None:
    return round(now - float(updated), 1) if isinstance(updated, (int, float)) else None


def _producer_status(producer_id: int, record: ChildRecord | None, status: ProducerStatus | None, now: float) -> dict:
    age = _age(status.updated, now) if status is not None else None
    if record is not None and record.pid:
        pid = record.pid
        alive = process_alive(pid, record.start_ticks)
    else:
        pid = status.pid if status is not None else None
        alive = process_alive(pid) and age is not None and age <= STALE_AFTER_S
    # p{I}.json of an earlier incarnation describes a ring that no longer exists.
    current = status if status is not None and status.written_by(pid) else None
    ring = current.ring if current is not None else {}
    return {
        "id": producer_id,
        "pid": pid,
        "alive": alive,
        "ready": bool(alive and current is not None and current.ready),
        "device": record.device if record is not None else None,
        "endpoint": current.endpoint if current is not None else None,
        "ring": {name: ring.get(name) for name in RING_FIELDS},
        "tokens_per_s": current.tokens_per_s if current is not None else None,
        "blocked_fraction": current.blocked_fraction if current is not None else None,
        "jobs": current.jobs if current is not None else {},
        "restarts": record.restarts if record is not None else 0,
        "updated_age_s": age,
    }


TRAINER_FIGURES = (
    "loss",
    "tau",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "steps_per_s",
    "eval",
    "evals_in_flight",
    "checkpoint_writing",
    "kind",
    "kind_metrics",
)
"""The trainer's figures shown only while trainer.json is the current trainer's."""


def _trainer_status(record: ChildRecord, status: TrainerStatus, now: float) -> dict:
    if record.pid:
        pid = record.pid  # under torchrun: torchrun's pid; trainer.json has rank 0's
        alive = process_alive(pid, record.start_ticks)
    else:
        pid = status.pid
        alive = process_alive(pid) and (_age(status.updated, now) or 0) <= STALE_AFTER_S
    # trainer.json of an earlier trainer (a new one still loading) is not this trainer's state.
    started = record.status_since or record.started
    current = not started or status.updated >= float(started)
    written = status.figures()
    return {
        "pid": pid,
        "alive": alive,
        "current": current,
        **{key: written[key] if current else None for key in TRAINER_FIGURES},
        **{key: written[key] for key in ("step", "max_steps", "trained_s", "max_minutes", "state", "incarnation")},
        "devices": record.devices,
        "restarts": record.restarts,
        "updated_age_s": _age(status.updated or None, now),
    }


def collect_status(run_dir: Path) -> dict:
    """The state of the run as plain data (the --json output)."""
    run = RunDir(Path(run_dir).resolve())
    now = time.time()
    launcher = LauncherRecord.read(run.launcher) or LauncherRecord()
    launcher_alive = process_alive(launcher.pid, launcher.start_ticks)
    records = {r.id: r for r in launcher.producers}
    files = {status.id: status for status in ProducerStatus.read_all(run)}
    producers = [_producer_status(i, records.get(i), files.get(i), now) for i in sorted(set(records) | set(files))]
    return {
        "run_dir": str(run.root),
        "launcher": {
            "pid": launcher.pid,
            "alive": launcher_alive,
            "state": launcher.state,
            "exit_code": launcher.exit_code,
            "uptime_s": _age(launcher.started, now) if launcher_alive else None,
        },
        "producers": producers,
        "trainer": _trainer_status(launcher.trainer, TrainerStatus.read(run.trainer_status), now),
        "metrics": last_json_line(run.metrics),
    }


def _cell(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def format_status(status: dict) -> str:
    """A compact human view."""
    launcher = status["launcher"]
    uptime = launcher["uptime_s"]
    lines = [
        f"run       {status['run_dir']}",
        f"launcher  pid {_cell(launcher['pid'])}  {'running' if launcher['alive'] else 'not running'}"
        f"  state {_cell(launcher['state'])}"
        + (f"  up {uptime:.0f} s" if uptime is not None else "")
        + (f"  exit {launcher['exit_code']}" if launcher["exit_code"] is not None and not launcher["alive"] else ""),
        "",
        f"{'producer':<9} {'pid':>8} {'alive':<6} {'ready':<6} {'device':<13} {'ring free/fill/ready/leased':<28} "
        f"{'tok/s':>10} {'blocked':>8} {'restarts':>8} {'updated':>8}",
    ]
    for p in status["producers"]:
        ring = p["ring"]
        ring_text = (
            "-"
            if ring["slots"] is None
            else f"{ring['free']}/{ring['filling']}/{ring['ready']}/{ring['leased']} of {ring['slots']}"
        )
        lines.append(
            f"{p['id']:<9} {_cell(p['pid']):>8} {'yes' if p['alive'] else 'no':<6} {'yes' if p['ready'] else 'no':<6} "
            f"{_cell(p['device']):<13} {ring_text:<28} {_cell(p['tokens_per_s'], '{:.0f}'):>10} "
            f"{_cell(p['blocked_fraction'], '{:.0%}'):>8} {p['restarts']:>8} {_cell(p['updated_age_s'], '{}s'):>8}"
        )
    t = status["trainer"]
    steps = f"{_cell(t['step'])}/{_cell(t['max_steps'])}"
    lines += [
        "",
        f"trainer   pid {_cell(t['pid'])}  {'alive' if t['alive'] else 'not alive'}  state {_cell(t['state'])}  step {steps}"
        f"  incarnation {_cell(t['incarnation'])}  restarts {t['restarts']}  devices {','.join(t['devices'] or []) or '-'}",
    ]
    if t["alive"] and not t["current"]:
        lines.append("training  the new trainer is starting: no figures of its own yet")
    elif t["loss"] is not None:
        evaluating = next((p["jobs"].get("evaluating") for p in status["producers"] if p["id"] == 0), None)
        step, max_steps = t["step"] or 0, t["max_steps"]
        done = f" ({step / max_steps:.0%})" if max_steps else ""
        eta = eta_s(t) if t["alive"] else None
        lines += [
            "",
            f"{'training':<9} step {step}/{_cell(max_steps)}{done}  elapsed {format_duration(uptime)}  "
            f"eta {format_duration(eta)}",
            f"{'':<9} " + "  ".join(trainer_figures(t, evaluating) + [f"{_cell(t['tokens_per_s'], '{:.0f}')} tok/s"]),
        ]
        if t.get("kind_metrics"):  # the drafter kind's own figures (DFlash 2: the selector's)
            lines.append(
                f"{_cell(t.get('kind')):<9} "
                + "  ".join(f"{key} {value:.3f}" for key, value in t["kind_metrics"].items())
            )
    if status["producers"]:
        lines.append(
            f"{'':<9} {ring_occupancy([p['ring'] for p in status['producers']])}  (full slots per producer ring)"
        )
    return "\n".join(lines)


def show_status(run_dir: Path, as_json: bool = False) -> int:
    """Print the state; 0 if a launcher runs the directory, else 1."""
    if not Path(run_dir).is_dir():
        print(f"error: no run directory {run_dir}", file=sys.stderr)
        return 1
    status = collect_status(run_dir)
    print(json.dumps(status, indent=1) if as_json else format_status(status))
    return 0 if status["launcher"]["alive"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/run_all.sh status", description="Show the live state of a pipeline.")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    return show_status(args.run_dir, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())

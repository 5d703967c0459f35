"""Owner identity in resource names, and the sweep of resources left by dead owners.

Every shared-memory segment and socket file carries the identity of the process that made it:
``<pid>-<start>`` where ``start`` is the process start time in clock ticks since boot (field 22 of
/proc/<pid>/stat). The pair is unique for the machine's uptime, so a recycled pid never makes a
dead owner look alive. At start we remove the resources of dead owners, and never those of live
ones.

Segments are named ``dflash.<run tag>.<role>.<pid>-<start>``; ``run_tag`` makes the run tag of a run
directory, the same in its producers and its trainers, and different for two run directories of the same
folder name. The sweep of /dev/shm at a ring's creation takes any run's dead segments but the trainers'
checkpoint staging (role ``trainer-...``, trainer/handover.py): a trainer that hands its state over has
exited by design before its successor maps it, so only a trainer of that run sweeps those, at its start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "dflash"
TRAINER_ROLE_PREFIX = "trainer-"
"""Roles of the trainers' checkpoint staging segments (trainer/handover.py), which may outlive their owner."""
_IDENTITY_RE = re.compile(r"\.(\d+)-(\d+)(?:\.[a-z]+)?$")


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is not running.

    A zombie (exited, not yet reaped) counts as not running: its resources are stale, and a
    supervisor in that state must not look alive to ``stop`` and ``status``.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def owner_identity(pid: int | None = None) -> str:
    """``<pid>-<start ticks>`` of this process (or of ``pid``)."""
    pid = os.getpid() if pid is None else pid
    start = process_start_ticks(pid)
    if start is None:
        raise ProcessLookupError(f"no process {pid}")
    return f"{pid}-{start}"


def owner_alive(pid: int, start: int) -> bool:
    """True if the process that had this identity still runs."""
    return process_start_ticks(pid) == start


def parse_owner(name: str) -> tuple[int, int] | None:
    """(pid, start) from a resource name ending in ``.<pid>-<start>[.ext]``, else None."""
    match = _IDENTITY_RE.search(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def run_tag(root: Path) -> str:
    """The run tag in the names of a run directory's segments: its folder name (cut) and a short hash of its
    resolved path, so that runs in two folders of the same name (``.../run``) never share names."""
    resolved = Path(root).resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', resolved.name)[:39]}-{digest}"  # 48 at most: segment_name keeps it whole


def segment_name(run_tag: str, role: str) -> str:
    """File name in /dev/shm of a segment of this process: ``dflash.<run tag>.<role>.<pid>-<start>``."""
    safe_tag = re.sub(r"[^A-Za-z0-9_-]", "_", run_tag)[:48]
    return f"{SEGMENT_PREFIX}.{safe_tag}.{role}.{owner_identity()}"


def sweep_stale(directory: Path, prefix: str = "", suffix: str = "", keep=None) -> list[Path]:
    """Remove files named ``<prefix>...<pid>-<start><suffix>`` whose owner is dead, but those whose name
    ``keep(name)`` is true of; return them."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if not (path.name.startswith(prefix) and path.name.endswith(suffix)) or (keep is not None and keep(path.name)):
            continue
        owner = parse_owner(path.name)
        if owner is None or owner_alive(*owner):
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        log.warning("removed stale %s of dead owner pid %d", path, owner[0])
        removed.append(path)
    return removed


def is_trainer_staging(name: str) -> bool:
    """True for a trainer's checkpoint staging segment, ``dflash.<run tag>.trainer-<tree>.<pid>-<start>``."""
    parts = name.split(".", 2)
    return len(parts) == 3 and parts[0] == SEGMENT_PREFIX and parts[2].startswith(TRAINER_ROLE_PREFIX)


def trainer_staging_prefix(run_tag: str) -> str:
    """What the /dev/shm names of this run's trainer staging segments begin with, ``dflash.<run tag>.trainer-``."""
    return segment_name(run_tag, "trainer").rsplit(".", 2)[0] + "." + TRAINER_ROLE_PREFIX


def sweep_stale_trainer_staging(run_tag: str) -> list[Path]:
    """Remove the staging segments of this run's trainers that are dead (killed before handing them over, or
    handed over to a successor that never came). Called by a trainer at its start, after it took over its
    predecessor's (trainer/handover.py ``take`` removes their names first), and by the launcher once every
    process of the run has exited. ``sweep_stale_segments`` leaves them."""
    return sweep_stale(SHM_DIR, prefix=trainer_staging_prefix(run_tag))


def sweep_stale_segments() -> list[Path]:
    """Remove /dev/shm segments of this project whose owning process is dead, of any run, but the trainers'
    staging: a dead owner's may be a state handed over that its successor has yet to map. A trainer sweeps
    its own run's (``sweep_stale_trainer_staging``)."""
    return sweep_stale(SHM_DIR, prefix=SEGMENT_PREFIX + ".", keep=is_trainer_staging)


def process_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs (and, when ``start_ticks`` is given, is the same process, not a reused pid)."""
    if not pid:
        return False
    ticks = process_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)

"""Owner identity in resource names, and the sweep of resources left by dead owners.

Every shared-memory segment and socket file carries the identity of the process that made it:
``<pid>-<start>`` where ``start`` is the process start time in clock ticks since boot (field 22 of
/proc/<pid>/stat). The pair is unique for the machine's uptime, so a recycled pid never makes a
dead owner look alive. At start we remove the resources of dead owners, and never those of live
ones.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "dflash"
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


def segment_name(run_tag: str, role: str) -> str:
    """File name in /dev/shm of a segment of this process: ``dflash.<run>.<role>.<pid>-<start>``."""
    safe_tag = re.sub(r"[^A-Za-z0-9_-]", "_", run_tag)[:48]
    return f"{SEGMENT_PREFIX}.{safe_tag}.{role}.{owner_identity()}"


def sweep_stale(directory: Path, prefix: str = "", suffix: str = "") -> list[Path]:
    """Remove files named ``<prefix>...<pid>-<start><suffix>`` whose owner is dead; return them."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        if not (path.name.startswith(prefix) and path.name.endswith(suffix)):
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


def sweep_stale_segments() -> list[Path]:
    """Remove /dev/shm segments of this project whose owning process is dead."""
    return sweep_stale(SHM_DIR, prefix=SEGMENT_PREFIX + ".")


def process_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs (and, when ``start_ticks`` is given, is the same process, not a reused pid)."""
    if not pid:
        return False
    ticks = process_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)

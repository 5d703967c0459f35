"""The run directory as the launcher sees it, and the file helpers the launcher, status and tests share.

Everything of one run lives in one folder (docs/design.md "Run directory"). The paths every process
shares (config.toml, producers/p{I}.json, trainer.json, sockets/, checkpoints/, metrics.jsonl ...)
come from ``common.rundir.RunDir``; the launcher adds its own::

    launcher.json      the launcher's pid file: its pid, its children's pids, restart counts
    secrets/curve.json the run's CURVE keys (mode 0600, folder 0700), made at creation
    logs/              producer-{I}.log, trainer.log, launcher.log (appended across restarts)
    control/           restart-trainer requests and their results

Status files are written atomically (temp file + rename), so a reader sees the old or the new
content, never half of one; readers here still treat unreadable JSON as absent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common.naming import process_start_ticks
from common.rundir import RunDir as SharedRunDir
from common.rundir import atomic_write_json as write_json_atomic
from common.rundir import read_json
from common.sockets import run_keys

__all__ = ["RunDir", "write_json_atomic", "read_json", "last_json_line", "process_start_ticks", "process_alive"]


class RunDir(SharedRunDir):
    """Paths inside one run directory, with the launcher's own files."""

    @property
    def launcher(self) -> Path:
        return self.root / "launcher.json"

    @property
    def producers(self) -> Path:
        return self.producer_status(0).parent  # the folder of p{I}.json, wherever common.rundir puts it

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def restart_request(self) -> Path:
        return self.control / "restart-trainer.json"

    @property
    def restart_result(self) -> Path:
        return self.control / "restart-trainer.result.json"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def create(self) -> None:
        """Make the run directory and the folders every process expects to exist; mark its format.

        Refuses (RunDirFormatError) a folder of another format before touching anything in it.
        """
        self.check_format()
        for folder in (self.root, self.logs, self.producers, self.sockets, self.control, self.checkpoints, self.wandb):
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.sockets, 0o700)  # only the run's user may reach the producers' sockets
        run_keys(self.curve_keys)  # the run's CURVE keys (0600), for producers and trainers on other hosts
        self.write_format()


def last_json_line(path: Path, tail_bytes: int = 65536) -> dict | None:
    """The last complete JSON object of a JSON-lines file (read from its end), or None."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            data = json.loads(line)
        except ValueError:
            continue  # a line being written right now, or cut by the tail window
        if isinstance(data, dict):
            return data
    return None


def process_alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """True if ``pid`` runs (and, when ``start_ticks`` is given, is the same process, not a reused pid)."""
    if not pid:
        return False
    ticks = process_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)

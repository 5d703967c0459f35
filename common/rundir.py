"""The run directory: where every file of a run lives, and atomic JSON files.

    DIR/format.json            the layout version of this folder (RUN_DIR_FORMAT); others are refused
    DIR/config.toml            resolved config
    DIR/producers/p{I}.json    producer I's status (written about once a second)
    DIR/trainer.json           the trainer's status
    DIR/sockets/               ipc sockets (names carry their owner's identity), mode 0700
    DIR/secrets/curve.json     the run's CURVE keys for tcp endpoints (common/sockets.py), mode 0600
    DIR/checkpoints/           step-XXXXXXXX/ folders and latest.json (pointer, written last)
    DIR/target/                the target's frozen head for the trainer when the target has no path
    DIR/ledger.jsonl, DIR/metrics.jsonl, DIR/logs/, DIR/wandb/
    DIR/launcher.json          the launcher's pid file: its pid, its children's pids, restart counts
    DIR/logs/                  producer-{I}.log, trainer.log, launcher.log (appended across restarts)
    DIR/control/               restart-trainer requests and results, standby and handover words, evaluations' marks

Status files are written atomically (temp file + rename), so a reader sees the old or the new content, never
half of one; readers treat unreadable JSON as absent.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
from pathlib import Path

from common.config import ConfigError
from common.naming import process_start_ticks
from common.sockets import run_keys

RUN_DIR_FORMAT = 2
"""Layout version of a run directory. Raise it when a change makes older run directories unreadable
(or newer ones unreadable by older code): each side then refuses the other's folder, clearly. Format 2: checkpoints
carry the seconds trained (training.max_minutes), train states are safetensors trees, saved configs state their
weighting and optimizer; format 1 folders (and those from before the marker) are refused, not converted."""


class RunDirFormatError(ConfigError):
    """The run directory was made by a version of this software with another layout."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk...); the previous one is still the latest."""


_RENAME_EXCHANGE = 2
_PARTIAL_RE = re.compile(r"^\.(.+)\.(\d+)\.(tmp|old)$")


def replace_dir(new: Path, final: Path) -> None:
    """Move the complete folder ``new`` to ``final``, replacing a folder there atomically.

    An existing ``final`` is swapped with ``new`` in one step (renameat2 RENAME_EXCHANGE), so a
    reader (or a crash) always finds a complete ``final``; the old contents are then removed.
    Where the file system cannot swap, the old folder is moved aside first.
    """
    import ctypes
    import shutil

    if not final.exists():
        os.replace(new, final)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(final), _RENAME_EXCHANGE) == 0:
        shutil.rmtree(new)  # now holds the old contents
        return
    aside = final.with_name(f".{final.name}.{os.getpid()}.old")
    os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)


_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


def atomic_write_json(path: Path, data: dict, durable: bool = True) -> None:
    """Write ``data`` so that readers see the old file or the new one, never a half-written one.

    ``durable``: on disk before this returns (fsync), for what a restart reads back: checkpoints, their
    pointer, requests between processes. Live status files, rewritten every few steps, pass False. Their
    fsync waited behind a background checkpoint's gigabytes, up to 1.5 s a step on an H200 host, and nothing
    reads them after a crash of the host.

    On failure (a full disk) the old file stays as it was and the temporary file is removed. Threads of one
    process that write the same file take turns: they share its temporary name (``.NAME.<pid>.tmp``, which
    the sweeps of dead processes' leftovers read), and one thread's rename would otherwise take the other's
    file away under it (a producer's status, written by two threads, crashed it with FileNotFoundError).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _WRITE_LOCKS_GUARD:
        lock = _WRITE_LOCKS.setdefault(str(tmp), threading.Lock())
    with lock:
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk (a checkpoint's files are flushed before latest.json names it)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class RunDir:
    """Paths of one run directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()

    @property
    def format_file(self) -> Path:
        return self.root / "format.json"

    def check_format(self) -> None:
        """Raise RunDirFormatError unless this folder has this software's layout (or is new).

        A run directory without ``format.json`` that holds training (a checkpoint or a ledger) predates the marker:
        format 1. Without either it is new (a folder prepared by hand holds its config alone).
        """
        path = self.format_file
        if not path.exists():
            if not (self.checkpoints / "latest.json").is_file() and not self.ledger.is_file():
                return  # new
            data = {"format": 1, "software": "a version from before the format marker"}
        else:
            data = read_json(path)
        found = data.get("format") if data is not None else None
        if type(found) is not int:
            raise RunDirFormatError(f"{path}: not a run directory format marker (expected {{\"format\": <int>}})")
        if found != RUN_DIR_FORMAT:
            raise RunDirFormatError(
                f"{self.root} is a run directory of format {found} (written by {data.get('software', 'an unknown version')}); "
                f"this version reads format {RUN_DIR_FORMAT}. Resume it with the version that made it, or use a new --run-dir. "
                "Nothing in it was changed."
            )

    def write_format(self) -> None:
        """Mark the folder with this software's layout version (kept if already there)."""
        if not self.format_file.exists():
            atomic_write_json(self.format_file, {"format": RUN_DIR_FORMAT, "software": "dflash-stream"})

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def sockets(self) -> Path:
        return self.root / "sockets"

    @property
    def curve_keys(self) -> Path:
        return self.root / "secrets" / "curve.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def target_head(self) -> Path:
        return self.root / "target"

    def head_dir(self, target_path: str | None) -> Path:
        """The folder of the target's head (embedding, final norm, lm_head): the stored target at
        ``target.path``, or for random weights the one its first producer exported (``target_head``)."""
        return Path(target_path) if target_path else self.target_head

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def held_out(self) -> Path:
        """The ids of the records the run holds out of its data for evaluation, fixed by its first start."""
        return self.root / "held_out.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def trainer_status(self) -> Path:
        return self.root / "trainer.json"

    def standby_go(self, pid: int) -> Path:
        """The launcher's word to a trainer started ahead (``trainer.train --standby``) that it takes over."""
        return self.control / f"standby-{pid}.json"

    def handover_request(self, pid: int) -> Path:
        """The launcher's word to trainer ``pid``, before its SIGTERM (restart-trainer): hand the state over to a
        successor in shared memory instead of writing a checkpoint (trainer/handover.py)."""
        return self.control / f"handover-{pid}.json"

    @property
    def trainer_handover(self) -> Path:
        """Written by a single-process trainer once its final checkpoint, leases, status and wandb are done:
        its successor need not wait for the interpreter's teardown."""
        return self.control / "trainer-handover.json"

    def producer_status(self, producer_id: int) -> Path:
        return self.root / "producers" / f"p{producer_id}.json"

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint folder ``checkpoints/latest.json`` points to, if it is complete."""
        pointer = read_json(self.checkpoints / "latest.json")
        if pointer is None:
            return None
        path = self.checkpoints / pointer["name"]
        return path if (path / "trainer_state.json").is_file() else None

    def advance_latest(self, name: str, step: int) -> bool:
        """Point ``checkpoints/latest.json`` at folder ``name`` (of ``step``), unless it already names a later
        step; True if it now names ``name``. Under a lock, so that a write two trainers finish at the same
        time never takes latest back: an older trainer's write, superseded by the state it handed over
        (trainer/handover.py), may end after its successor's checkpoint of a later step."""
        folder = os.open(self.checkpoints, os.O_RDONLY | os.O_DIRECTORY)  # the lock: the folder itself, no file
        try:
            try:
                fcntl.flock(folder, fcntl.LOCK_EX)
            except OSError:  # NFS or Lustre without flock: unlocked (the overlap is a process's last milliseconds)
                pass
            current = read_json(self.checkpoints / "latest.json") or {}
            if int(current.get("step", -1)) > step and (self.checkpoints / str(current.get("name"))).is_dir():
                return False
            atomic_write_json(self.checkpoints / "latest.json", {"name": name, "step": step})
            return True
        finally:
            os.close(folder)  # and with it the lock

    def sweep_partial_checkpoints(self) -> list[Path]:
        """Clean up what a trainer killed while checkpointing left in checkpoints/; return the leftovers.

        That is its temporary folder ``.step-N.<pid>.tmp``, a folder it moved aside
        (``.step-N.<pid>.old``) or a half-written ``.latest.json.<pid>.tmp``, once that pid no
        longer runs. Such leftovers are never loaded (only complete folders are renamed to
        ``step-N``), but each would keep a checkpoint's worth of disk forever. A folder moved aside
        whose replacement never arrived (``replace_dir`` without RENAME_EXCHANGE) is the only
        complete copy of that step: it is put back instead.
        """
        removed = []
        if not self.checkpoints.is_dir():
            return removed
        for path in self.checkpoints.iterdir():
            match = _PARTIAL_RE.match(path.name)
            if match is None or process_start_ticks(int(match.group(2))) is not None:
                continue
            final = self.checkpoints / match.group(1)
            if match.group(3) == "old" and not final.exists():
                os.replace(path, final)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        return removed

    def committed_for(self, producer_id: int) -> dict | None:
        """What the latest checkpoint committed from producer ``producer_id`` (None: nothing)."""
        latest = self.latest_checkpoint()
        if latest is None:
            return None
        state = read_json(latest / "trainer_state.json") or {}
        return state.get("committed", {}).get(str(producer_id))

    # -- the launcher's own files

    @property
    def launcher(self) -> Path:
        return self.root / "launcher.json"

    @property
    def producers(self) -> Path:
        return self.producer_status(0).parent  # the folder of p{I}.json

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

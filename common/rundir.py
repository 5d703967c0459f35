"""The run directory: where every file of a run lives, and atomic JSON files.

    DIR/config.toml            resolved config
    DIR/producers/p{I}.json    producer I's status (written about once a second)
    DIR/trainer.json           the trainer's status
    DIR/sockets/               ipc sockets (names carry their owner's identity)
    DIR/checkpoints/           step-XXXXXXXX/ folders and latest.json (pointer, written last)
    DIR/target/                the target's frozen head for the trainer when the target has no path
    DIR/ledger.jsonl, DIR/metrics.jsonl, DIR/logs/, DIR/wandb/
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def atomic_write_json(path: Path, data: dict) -> None:
    """Write ``data`` so that readers see the old file or the new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def sockets(self) -> Path:
        return self.root / "sockets"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def target_head(self) -> Path:
        return self.root / "target"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def trainer_status(self) -> Path:
        return self.root / "trainer.json"

    def producer_status(self, producer_id: int) -> Path:
        return self.root / "producers" / f"p{producer_id}.json"

    def producer_statuses(self) -> list[dict]:
        """Every producer's status file, by id."""
        found = []
        for path in sorted((self.root / "producers").glob("p*.json")):
            data = read_json(path)
            if data is not None:
                found.append(data)
        return sorted(found, key=lambda d: d.get("id", 0))

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint folder ``checkpoints/latest.json`` points to, if it is complete."""
        pointer = read_json(self.checkpoints / "latest.json")
        if pointer is None:
            return None
        path = self.checkpoints / pointer["name"]
        return path if (path / "trainer_state.json").is_file() else None

    def committed_for(self, producer_id: int) -> dict | None:
        """What the latest checkpoint committed from producer ``producer_id`` (None: nothing)."""
        latest = self.latest_checkpoint()
        if latest is None:
            return None
        state = read_json(latest / "trainer_state.json") or {}
        return state.get("committed", {}).get(str(producer_id))

"""The trainer's wandb run, started in the background.

``wandb.init`` takes a second or more (it starts wandb's service process, and online it talks to the
server). A trainer's start, and above all a restart-trainer takeover, should not wait for it: the run is
started in a thread, what is logged before it is up is kept and sent in order once it is, and an error of
its start is raised at the next ``log`` (a wrong key or project is the same on every try: it stops the run).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from common.config import RunConfig, to_dict
from common.rundir import RunDir


def run_id_of(run_dir: RunDir) -> str:
    """The run's wandb id (RUN/wandb/run_id): every trainer of the run logs into the same wandb run."""
    id_file = run_dir.wandb / "run_id"
    return id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)


def start_run(cfg: RunConfig, run_dir: RunDir, run_id: str) -> BackgroundRun:
    """The trainer's wandb run ``run_id`` (resumed if it exists), started in the background."""
    import wandb

    run_dir.wandb.mkdir(parents=True, exist_ok=True)
    (run_dir.wandb / "run_id").write_text(run_id)
    project, mode, config = cfg.logging.wandb_project, cfg.logging.wandb_mode, to_dict(cfg)

    def start() -> Any:
        run = wandb.init(
            project=project,
            id=run_id,
            resume="allow",
            dir=str(run_dir.root),
            mode=mode,
            name=run_dir.root.name,
            config=config,
            settings=wandb.Settings(silent=True),
        )  # with system metrics
        # An evaluation comes back a few steps after the step it belongs to: its charts use eval/step.
        run.define_metric("eval/step")
        run.define_metric("eval/*", step_metric="eval/step")
        return run

    return BackgroundRun(start)  # training does not wait for wandb's start


class BackgroundRun:
    """A wandb run whose ``init`` runs in a thread; ``log`` and ``finish`` as on the run itself."""

    def __init__(self, init: Callable[[], Any]) -> None:
        self._init = init
        self._run: Any = None
        self._error: BaseException | None = None
        self._pending: list[tuple[dict, int | None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._start, name="wandb-init", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            run = self._init()
        except BaseException as exc:  # noqa: BLE001 - raised in the trainer's thread at the next log
            with self._lock:
                self._error = exc
            return
        with self._lock:
            for data, step in self._pending:
                run.log(data, step=step)
            self._pending.clear()
            self._run = run

    def log(self, data: dict, step: int | None = None) -> None:
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"wandb could not start: {self._error}") from self._error
            if self._run is None:
                self._pending.append((data, step))
            else:
                self._run.log(data, step=step)

    def wait(self) -> Any:
        """The run, once started (None if its start failed)."""
        self._thread.join()
        return self._run

    def finish(self) -> None:
        run = self.wait()
        if run is not None:
            run.finish()

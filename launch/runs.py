"""A command's run directory and configuration: a new run or the one it resumes, and what restart-trainer may change
(the keys no producer read at its start)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from common.config import (
    ConfigError,
    RunConfig,
    dotted_values,
    fixed_while_producers_run,
    load_config,
    readers,
    to_dict,
)
from common.rundir import RunDir
from common.status import TrainerStatus

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "launch" / "tiny.toml"
# Producer socket names ("p{I}.<pid>-<start ticks>.ipc" or alike) need room after DIR/sockets/.
SOCKET_NAME_ROOM = 40
MAX_IPC_PATH = 100


# Keys restart-trainer may change: the producers never read them. Everything else (target, data,
# batching, drafter, ring, launch.num_producers/producer_devices) shapes what producers ship.


class UsageError(Exception):
    """The command cannot run as asked (e.g. a launcher already runs on this run dir); exit 2."""


# -- configuration -------------------------------------------------------------------------------


def _has_trained(run: RunDir) -> bool:
    """Whether the run dir holds training progress: a checkpoint, a ledger line, or a trainer that took a step."""
    if run.latest_checkpoint() is not None or (run.ledger.is_file() and run.ledger.stat().st_size > 0):
        return True
    return bool(TrainerStatus.read(run.trainer_status).step)


def resolve_run(run_dir: Path | None, config_file: Path | None, overrides: list[str]) -> tuple[RunDir, RunConfig, bool]:
    """The run directory, its resolved config and whether it resumes an existing run.

    An existing run dir (one with config.toml) keeps its config: the overrides apply on top of it.
    ``--config`` is then only accepted when it resolves to the same config, so that a stale command
    line cannot silently replace the settings of a run that has checkpoints. A run dir that never
    trained a step (its first start failed) takes the new ``--config`` and overrides instead.
    """
    if run_dir is None:
        run_dir = Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
        while run_dir.exists():
            run_dir = run_dir.with_name(run_dir.name + "-1")
    run = RunDir(run_dir.resolve())
    run.check_format()  # before reading anything of a folder another version made
    resumed = run.config.is_file()
    if resumed and config_file is not None and not _has_trained(run):
        resumed = False  # a first start that failed before any step: its config is no one's to keep
    if resumed:
        if config_file is not None and to_dict(load_config(config_file)) != to_dict(load_config(run.config)):
            raise ConfigError(
                f"--config {config_file} differs from the config of the existing run {run.config}; resume without "
                "--config and give key=value overrides to change settings, or use a new --run-dir"
            )
        cfg = load_config(run.config, overrides)
    else:
        if config_file is None and not DEFAULT_CONFIG.is_file():
            raise ConfigError(f"no --config given and the embedded default {DEFAULT_CONFIG} is missing")
        cfg = load_config(config_file or DEFAULT_CONFIG, overrides)
    if len(str(run.sockets)) + SOCKET_NAME_ROOM > MAX_IPC_PATH:
        raise ConfigError(
            f"--run-dir: {run.root} is too long for ipc socket paths (limit {MAX_IPC_PATH} characters with the "
            "socket name); use a shorter run directory"
        )
    return run, cfg, resumed


def changed_keys(old: RunConfig, new: RunConfig) -> list[str]:
    """Dotted ``section.key`` names whose values differ (a key of one side only, the other kind's, is left out: the
    kind itself differs then)."""
    old_data, new_data = dotted_values(old), dotted_values(new)
    return [key for key, value in new_data.items() if key in old_data and old_data[key] != value]


def refused_trainer_changes(
    changed: list[str], old: RunConfig | None = None, new: RunConfig | None = None
) -> list[str]:
    """Messages for the changed keys that restart-trainer must refuse: those a producer or the drafter's
    checkpoint holds (each field's readers, ``READ_BY`` in common/config/)."""
    refusals = []
    for key in changed:
        if (
            key == "training.max_steps"
            and new is not None
            and old is not None
            and new.training.max_steps == 0
            and old.training.max_steps != 0
        ):
            # A trainer sized by epochs reads each producer's epoch batch count, which producers write only
            # when they themselves started with max_steps 0: it would wait for counts that never come.
            refusals.append(
                "training.max_steps=0 (size the run by training.epochs) needs the producers started with "
                f"max_steps 0, and they run with {old.training.max_steps}"
            )
        elif fixed_while_producers_run(key):
            held_by = (
                "the producers read it at their start"
                if "producer" in readers(key)
                else "the drafter's checkpoint fixes it"
            )
            refusals.append(f"{key} cannot change while the producers run ({held_by})")
    return refusals


# -- devices and commands ------------------------------------------------------------------------

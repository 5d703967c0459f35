"""How a trainer that replaces another starts (restart-trainer): it builds ahead while its predecessor still
trains, then waits until that one is done before it touches the run.

Two ways in: the launcher starts it for the restart with ``DFLASH_TRAINER_AFTER=pid:start_ticks``
(``wait_for_predecessor``), or it was started ahead as the run's standby and waits for the launcher's word
(``wait_for_takeover``), which names the predecessor in turn. The predecessor's side is trainer/handover.py.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from common import faults
from common.config import ConfigError, load_config
from common.control import PREDECESSOR_ENV, HandoverMark, StandbyGo
from common.lifecycle import die_with_parent, end_now
from common.naming import process_start_ticks
from common.rundir import RunDir
from trainer.build import WarmStart
from trainer.ranks import resolve_device
from trainer.warm import prepare as prepare_warm_start

log = logging.getLogger(__name__)


def import_what_a_start_needs() -> None:
    """The slow imports of a trainer's start, done ahead (by a successor or a standby trainer)."""
    import safetensors.torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer's first construction imports it: a second or more)
    import transformers  # noqa: F401
    import wandb  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import common.acceptance.report  # noqa: F401
    import common.drafter.target_head  # noqa: F401


def warm_start_ahead(run_dir: RunDir) -> WarmStart | None:
    """The warm start (trainer/warm.py) of a single-process trainer that takes over a run, built from the
    run's configuration as it is now (the Trainer checks that it still fits the one it starts with)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 or not run_dir.config.is_file():
        return None
    try:
        cfg = load_config(run_dir.config)
    except ConfigError:
        return None  # the start reports it
    return prepare_warm_start(cfg, run_dir, resolve_device(cfg, 0))


def wait_for_predecessor(
    run_dir: RunDir, warm_start: WarmStart | None = None
) -> tuple[HandoverMark | None, WarmStart | None]:
    """With ``DFLASH_TRAINER_AFTER=pid:start_ticks`` the launcher started this trainer while the one it
    replaces (restart-trainer) still finishes its step and writes its final checkpoint: import what the
    start needs meanwhile, then wait until that process is gone, or has written its handover (everything
    of the run done, only the interpreter's teardown left), before touching the run (its status, its
    checkpoint, the producers). A killed predecessor is gone too: this trainer then resumes from whatever
    checkpoint is the latest, as after any crash. Returns (its mark, the warm start built meanwhile)."""
    spec = os.environ.get(PREDECESSOR_ENV)
    if not spec:
        return None, warm_start
    import_what_a_start_needs()  # while the predecessor still works
    if warm_start is None:
        warm_start = warm_start_ahead(run_dir)
    pid, start_ticks = (int(x) for x in spec.split(":"))
    began = time.monotonic()
    while True:
        # Alive first, then the mark: a predecessor already gone has written whatever mark it ever will.
        gone = process_start_ticks(pid) != start_ticks
        mark = HandoverMark.read(run_dir.trainer_handover)
        if mark is not None and (mark.pid, mark.start_ticks) == (pid, start_ticks):
            break
        if gone:  # killed before its mark: the disk checkpoint is the state
            mark = None
            break
        time.sleep(0.01)
    log.info(
        "the trainer this one replaces (pid %d) is done; waited %.1f s for it%s",
        pid,
        time.monotonic() - began,
        ", it handed its state over" if mark is not None and mark.state else "",
    )
    faults.point("trainer.resume")
    return mark, warm_start


def wait_for_takeover(run_dir: RunDir) -> WarmStart | None:
    """A trainer started ahead of need: import what a start needs and build its warm start (trainer/warm.py),
    then wait for the launcher's word (``control/standby-<pid>.json``, naming the trainer it replaces)
    before touching anything else of the run."""
    # Stopped before it was needed (the run ends, the launcher stops): it holds nothing of the run, so it
    # leaves at once and says so, instead of dying by the signal (which the launcher reports as a crash).
    signal.signal(signal.SIGTERM, _stop_standby)
    log.info("standby trainer: building ahead, then waiting to take over")
    import_what_a_start_needs()
    warm_start = warm_start_ahead(run_dir)
    go = run_dir.standby_go(os.getpid())
    while (order := StandbyGo.read(go)) is None:
        time.sleep(0.02)
    go.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run's trainer now: its own stop handling follows
    if order.predecessor:
        os.environ[PREDECESSOR_ENV] = order.predecessor
    log.info("taking over as the run's trainer")
    faults.point("trainer.takeover")
    return warm_start


def start_as_standby(run_dir: RunDir, role: str) -> WarmStart | None:
    """``trainer.train --standby``: build ahead and wait for the launcher's word (``wait_for_takeover``), dying
    with the launcher. It writes into trainer.log beside the running trainer until it takes over: its lines say so."""
    die_with_parent()
    _log_as(f"standby-{role}")
    warm_start = wait_for_takeover(run_dir)
    _log_as(role)
    return warm_start


def _log_as(role: str) -> None:
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(message)s"))


def _stop_standby(_signum: int, _frame: object) -> None:
    log.info("standby trainer stopped before it was needed")
    end_now(0)

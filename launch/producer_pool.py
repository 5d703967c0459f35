"""The producers' pool: one process per entry of launch.producer_devices, started once with the run, each watched
until it says ready and restarted when it crashes or hangs while loading; never because of the trainer."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from common.config import RunConfig
from common.lifecycle import EXIT_CONFIG_ERROR
from common.rundir import RunDir
from common.status import ChildRecord, ProducerStatus
from launch.placement import Placement
from launch.processes import (
    PRODUCER_STOP_TIMEOUT_S,
    ManagedProcess,
    log_tail,
    producer_command,
    producer_environment,
)

log = logging.getLogger("launch.supervisor")  # the launcher's log

GAVE_UP = 1
"""The run's exit code when a producer crashed too often in a row, or never became ready."""


class ProducerPool:
    """The run's producers (see the module's docstring)."""

    def __init__(self, run: RunDir, cfg: RunConfig, placement: Placement) -> None:
        self.run = run
        self.cfg = cfg
        """The run's config, whose launch.* settings the pool follows (restart-trainer may change them)."""
        self.started_with = cfg
        """The config the producers were started with (restart-trainer may change only the trainer's)."""
        self.processes = [
            ManagedProcess(
                f"producer-{i}",
                producer_command(run.root, i, device),
                {**producer_environment(device), **placement.for_producer(cfg, device)},
                run.log(f"producer-{i}"),
                device.split(","),
                placement.preloader_for(cfg, device.split(",")),
            )
            for i, device in enumerate(placement.producer_devices(cfg))
        ]

    @property
    def ready(self) -> bool:
        """Every producer has said ready (its status file, written by this incarnation)."""
        return all(p.ready for p in self.processes)

    def start(self) -> None:
        for producer in self.processes:
            producer.start()
            log.info("started %s pid %d on %s", producer.name, producer.pid, ",".join(producer.devices))

    def check(self, mid_run: bool) -> int | None:
        """Restart what is due, note what became ready, and act on what exited; the run's exit code where it must
        stop. ``mid_run``: the trainer has started, so a producer that never gets ready is treated as a crash."""
        for i, producer in enumerate(self.processes):
            if producer.proc is None:
                producer.restart_if_due()
                continue
            returncode = producer.poll()
            if returncode is None:
                if not producer.ready:
                    result = self._check_ready(i, producer, mid_run)
                    if result is not None:
                        return result
                continue
            producer.clear()
            self._mark_not_ready(i)
            if returncode == EXIT_CONFIG_ERROR:
                log.error(
                    "%s: configuration error (exit 2); stopping the run. See %s%s",
                    producer.name,
                    producer.log_path,
                    log_tail(producer.log_path),
                )
                return EXIT_CONFIG_ERROR
            # Exit 0 too: the launcher did not ask it to stop, and the run still needs it.
            result = self._after_crash(producer, returncode)
            if result is not None:
                return result
        return None

    def _mark_not_ready(self, producer_id: int) -> None:
        """Make a dead producer's status file say so. It still says ready, with the dead endpoint:
        a trainer would connect there and wait for a WELCOME that never comes (its other producers
        waiting too) until the replacement is ready and rewrites the file."""
        path = self.run.producer_status(producer_id)
        status = ProducerStatus.read(path)
        if status is not None and status.ready:
            status.ready = False
            status.write(path)

    def _check_ready(self, producer_id: int, producer: ManagedProcess, mid_run: bool) -> int | None:
        status = ProducerStatus.read(self.run.producer_status(producer_id))
        if status is not None and status.written_by(producer.pid) and status.ready:
            producer.ready = True
            log.info("%s ready in %.1f s (%s)", producer.name, producer.uptime_s, status.endpoint or "?")
            return None
        if producer.uptime_s <= self.cfg.launch.ready_timeout_s:
            return None
        if not mid_run:
            log.error(
                "%s not ready after %.0f s (launch.ready_timeout_s); stopping the run. See %s%s",
                producer.name,
                self.cfg.launch.ready_timeout_s,
                producer.log_path,
                log_tail(producer.log_path),
            )
            return GAVE_UP
        # Mid-run a producer that hangs while loading is treated like a crashed one.
        log.warning("%s not ready after %.0f s: killing it", producer.name, self.cfg.launch.ready_timeout_s)
        returncode = producer.kill()
        producer.clear()
        return self._after_crash(producer, returncode)

    def _after_crash(self, producer: ManagedProcess, returncode: int) -> int | None:
        """Schedule the restart of a crashed producer, or give up on the run."""
        launch = self.cfg.launch
        return None if producer.after_crash(returncode, launch.restart_backoff_s, launch.max_restarts) else GAVE_UP

    def stop(self, on_poll: Callable[[], None]) -> None:
        """SIGTERM to every running producer at once, then wait for them under one time limit."""
        running = [p for p in self.processes if p.proc is not None]
        for producer in running:
            producer.send(signal.SIGTERM)
        deadline = time.monotonic() + PRODUCER_STOP_TIMEOUT_S
        for producer in running:
            producer.await_exit(max(0.0, deadline - time.monotonic()), on_poll)

    def records(self) -> list[ChildRecord]:
        """The producers as launcher.json keeps them."""
        return [p.record(id=i, device=",".join(p.devices), ready=p.ready) for i, p in enumerate(self.processes)]

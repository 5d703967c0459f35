"""Where the trainer's batches come from and where its evaluations run: one interface, so the loop has one path;
and ``Batches``, the loop's view of them: the next batch, agreed between the ranks so that none is trained twice.

The run's source is the producers' rings (``RingSource``): the feeder thread takes their batches and producer 0
evaluates what the trainer asks for. The coupled baseline (launch/bench/coupled.py) is another source, which runs
the target in the trainer's own process and evaluates in its loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from common.batch import PackedBatch
from common.config import ConfigError, RunConfig
from common.rundir import RunDir
from common.status import ProducerStatus
from trainer.acceptance import AcceptanceClient
from trainer.feeder import Commits, Feeder, Received
from trainer.ranks import Ranks

log = logging.getLogger(__name__)


class BatchSource(Protocol):
    takes_warm_start: bool
    """Whether a warm start (trainer/warm.py, built from the run's configuration alone) fits a trainer on it."""

    def feeder(self, incarnation: int, expect: dict, commits: Commits, pad_to: int | None) -> Any:
        """What the loop takes batches from: ``start``, ``get(timeout)``, ``refusal``, ``error``,
        ``producer_stats``, ``close`` (as ``trainer.feeder.Feeder``)."""
        ...

    def evaluations(self, incarnation: int, block_size: int, metrics_file: IO[str] | None, wandb_run: Any) -> Any:
        """What the loop asks evaluations of and logs their results through: ``adopt``, ``ask``, ``collect``,
        ``in_flight``, ``status``, ``close`` (as ``trainer.acceptance.AcceptanceClient``)."""
        ...


SourceFactory = Callable[[RunConfig, RunDir, Ranks], BatchSource]
"""Builds a trainer's source; the trainer calls it before building its drafter (a source may export the head)."""


class RingSource:
    """The producers' rings and producer 0's evaluations."""

    takes_warm_start = True

    def __init__(self, cfg: RunConfig, run_dir: RunDir, ranks: Ranks) -> None:
        self.cfg, self.run_dir, self.ranks = cfg, run_dir, ranks

    def feeder(self, incarnation: int, expect: dict, commits: Commits, pad_to: int | None) -> Feeder:
        ring = self.cfg.ring
        return Feeder(
            self.run_dir,
            consumer_id=f"trainer/r{self.ranks.rank}",
            incarnation=incarnation,
            expect=expect,
            commits=commits,
            device=self.ranks.device,
            credits=ring.credits,
            heartbeat_interval_s=ring.heartbeat_interval_s,
            handshake_timeout_s=ring.handshake_timeout_s,
            pad_to=pad_to,
        )

    def evaluations(
        self, incarnation: int, block_size: int, metrics_file: IO[str] | None, wandb_run: Any
    ) -> AcceptanceClient:
        return AcceptanceClient(
            self.run_dir,
            incarnation,
            block_size,
            self.cfg.eval.gap_tolerance,
            background_export=self.cfg.training.async_checkpoint,
            metrics_file=metrics_file,
            wandb_run=wandb_run,
        )


def wait_until(ready: Callable[[], bool], what: str, timeout_s: float, stop: Callable[[], bool]) -> None:
    """Wait until ``ready()`` (what the producers write: the target's head, their epoch sizes); TimeoutError after
    ``timeout_s``, KeyboardInterrupt once ``stop()``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f}s")
        if stop():
            raise KeyboardInterrupt
        time.sleep(0.2)


def epoch_batches(run_dir: RunDir, producers: int, wait_for: Callable[[Callable[[], bool], str], None]) -> int:
    """The batches of one epoch over the shards of the run's ``producers``, once each has counted its shard into its
    status file."""
    wait_for(
        lambda: len([s for s in ProducerStatus.read_all(run_dir) if s.epoch_batches is not None]) >= producers,
        "the producers' epoch sizes",
    )
    return sum(s.epoch_batches or 0 for s in ProducerStatus.read_all(run_dir))


@dataclass(frozen=True, slots=True)
class Claim:
    """What a rank shows the others of the batch it would train (``Batches.claim``): where the batch stands in its
    producer's stream, which the committed state counts, and its documents, which the ledger records."""

    producer: int
    ordinal: int
    """The batch's position in its producer's stream."""
    cursor: list[int]
    """[epoch, window, index] of the batch in the data order."""
    epoch: int
    sample_ids: list[int]
    """The batch's documents, padding excluded."""

    @classmethod
    def of(cls, received: Received) -> Claim:
        return cls(received.producer, received.ordinal, received.cursor, received.batch.epoch, received.sample_ids)


class Batches:
    """The loop's batches: the feeder's, the next one prepared while this step's backward runs, each step's agreed
    between the ranks and recorded as trained (``Commits``, and rank 0's ledger line)."""

    def __init__(self, feeder: Any, ranks: Ranks, commits: Commits, ledger: Path, stop: Callable[[], bool]) -> None:
        """``feeder``: the source's (``start``, ``get``, ``refusal``, ``error``, ``producer_stats``, ``close``);
        ``ledger``: the run's, which rank 0 appends to; ``stop``: whether the trainer is asked to stop (it then takes
        no new batch)."""
        self.feeder, self.ranks, self.commits, self.stop = feeder, ranks, commits, stop
        self.ledger = open(ledger, "a") if ranks.rank == 0 else None
        self.upcoming: Received | None = None

    def next(self) -> tuple[Received | None, float]:
        """The next staged batch and the seconds waited for it (starved time); None once a stop is asked."""
        if self.upcoming is not None:
            received, self.upcoming = self.upcoming, None
            return received, 0.0
        started = time.perf_counter()
        while not self.stop():
            received = self.feeder.get(timeout=0.5)
            if received is not None:
                return received, time.perf_counter() - started
            if self.feeder.refusal:
                raise ConfigError(f"a producer refused this trainer: {self.feeder.refusal}")
            if self.feeder.error is not None:
                raise RuntimeError("the feeder thread failed") from self.feeder.error
        return None, time.perf_counter() - started

    def prepare_upcoming(self, prepare: Callable[[PackedBatch], object]) -> None:
        """Build the next batch's anchors and block masks (``prepare``) while the GPU still runs this step's
        backward, so mask building is off the critical path."""
        if self.upcoming is None:
            self.upcoming = self.feeder.get(timeout=0)
        if self.upcoming is not None and self.upcoming.prepared is None:
            self.upcoming.prepared = prepare(self.upcoming.batch)

    def claim(self) -> tuple[Received | None, float, list[Claim]]:
        """This step's batch, agreed with the other ranks; (None, ...) when any rank stops.

        Every rank shows the batch it would train (one object collective on the CPU group, no GPU
        sync); a batch already trained, or shown by a lower rank too, is dropped by its rank, which
        shows its next one. So no batch is trained twice whatever the producers send (a restarted
        producer only knows what the ranks that said HELLO to it had received), and all ranks stop
        together. Returns the batch, the seconds waited for data, and every rank's claim.
        """
        received, waited = None, 0.0
        while True:
            if received is None and not self.stop():
                received, starved = self.next()
                waited += starved
            mine = None if received is None else Claim.of(received)
            everyone = self.ranks.gather(mine)
            if any(claim is None for claim in everyone):
                return None, waited, everyone
            seen: set[tuple[int, int]] = set()
            losers = set()
            for rank, claim in enumerate(everyone):
                if (claim.producer, claim.ordinal) in seen or self.commits.is_trained(claim.producer, claim.ordinal):
                    losers.add(rank)
                seen.add((claim.producer, claim.ordinal))
            if not losers:
                return received, waited, everyone
            if self.ranks.rank in losers:
                log.error(
                    "batch %d of producer %d was trained or taken by another rank; dropped",
                    received.ordinal,
                    received.producer,
                )
                received = None

    def record(self, step: int, incarnation: int, everyone: list[Claim]) -> None:
        """Mark the step's batches trained (on every rank) and append the ledger line (rank 0)."""
        for claim in everyone:
            self.commits.mark_trained(claim.producer, claim.ordinal, claim.cursor)
            # Another rank's batch counts as received here too: a HELLO of ours must say so, or a
            # restarted producer would compute it again.
            self.commits.mark_received(claim.producer, claim.ordinal, claim.cursor)
        if self.ledger is None:
            return
        line = {
            "step": step,
            "incarnation": incarnation,
            "samples": [[c.producer, c.epoch, s] for c in everyone for s in c.sample_ids],
            "batches": [[c.producer, c.ordinal] for c in everyone],
            "time": time.time(),
        }
        self.ledger.write(json.dumps(line) + "\n")
        self.ledger.flush()

    def close(self) -> None:
        self.feeder.close()
        if self.ledger is not None:
            self.ledger.close()

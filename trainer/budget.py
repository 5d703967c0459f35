"""training.max_minutes: a wall-clock budget for the training loop, summed over the run's trainers.

A budget makes runs of different step costs comparable at equal GPU time (a slower step pays for itself), and
lets a user train for the hours of a reservation. The clock runs from the end of each trainer's first step (its
compilation is not training) to its last one; waits for data, checkpoints and evaluations count. A checkpoint
carries the seconds trained so far, so a restarted or replaced trainer spends only what is left (the seconds
between the last checkpoint and a crash are trained again, and counted again).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TimeBudget:
    """The seconds trained against ``minutes`` (0: no budget)."""

    def __init__(self, minutes: float, trained_s: float = 0.0) -> None:
        self.minutes = minutes
        self.carried_s = trained_s
        self.seconds = trained_s
        """Seconds trained as of the last ``tick`` (earlier trainers' included)."""
        self._started: float | None = None

    def tick(self, agree: Callable[[float], float] = lambda seconds: seconds) -> None:
        """Read the clock after a step; the first call starts it. ``agree`` makes every rank use rank 0's reading
        (the schedule follows the clock, and ranks must step with the same learning rate); only a budget reads the
        clock, so only then is it agreed (a collective)."""
        if self._started is None:
            self._started = time.monotonic()
        seconds = self.carried_s + time.monotonic() - self._started
        self.seconds = agree(seconds) if self.minutes else seconds

    @property
    def fraction(self) -> float:
        """Share of the budget spent (0 without one)."""
        return self.seconds / (60 * self.minutes) if self.minutes else 0.0

    @property
    def spent(self) -> bool:
        return self.minutes > 0 and self.fraction >= 1.0

    def line(self) -> str:
        """trainer.log's part: the minutes trained of the budget (nothing without one)."""
        return f"  {self.seconds / 60:.1f}/{self.minutes:g} min" if self.minutes else ""

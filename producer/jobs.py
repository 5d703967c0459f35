"""What a producer does beside filling its ring: jobs that share its target between two batches.

The serving loop (producer/server.py) fills the ring; a job gets the target when the loop asks it, and must
return soon enough that the trainer never runs dry (the ring's ready batches keep being leased meanwhile). The
evaluation of the trainer's drafters (producer/acceptance/job.py) is one. Synthesis is a process role of its own
(producer/synthesize.py), and regeneration a data source (producer/regenerate.py): both feed the data, not the
loop.
"""

from __future__ import annotations

from typing import Protocol


class ProducerJob(Protocol):
    """A piece of work a producer does on its target between two batches."""

    name: str
    """Its key in the producer's status file's ``jobs``."""

    def between_batches(self) -> None:
        """Called before every fill: do what is due (a bounded piece of work), or nothing."""

    def while_ring_full(self) -> None:
        """Called when the ring has no free slot: work that fits in the wait, ahead of when it is due."""

    def status(self) -> object:
        """What it is doing, for the producer's status file (JSON-serialisable)."""

"""The committed state: which batches of each producer's stream a trainer has trained, written by the trainer
(into checkpoints and every HELLO) and read by the producer, which skips or replays batches by it.

Batches of a shard's stream are numbered by their ordinal. A trainer commits, per producer, a prefix of
ordinals plus a few beyond it (several consumers finish out of order)::

    {"ordinal": n,                          # every ordinal below n is committed
     "last_cursor": [epoch, window, index], # the cursor of ordinal n - 1 (None when n is 0)
     "extra": [ordinals > n],               # committed beyond the prefix
     "extra_cursors": {"ordinal": cursor}}  # and their cursors

``OrdinalSet`` writes it (``state``) and ``read_committed`` reads and checks it: one format, both sides.
"""

from __future__ import annotations


class OrdinalSet:
    """A set of stream ordinals stored as a prefix plus exceptions, with the cursor of the prefix's end."""

    def __init__(self, state: dict | None = None) -> None:
        state = state or {}
        self.prefix = int(state.get("ordinal", 0))
        self.last_cursor = state.get("last_cursor")
        self.extra: dict[int, list] = {int(o): None for o in state.get("extra", [])}
        for ordinal, cursor in state.get("extra_cursors", {}).items():
            self.extra[int(ordinal)] = cursor

    def add(self, ordinal: int, cursor: list) -> None:
        if ordinal < self.prefix or ordinal in self.extra:
            raise ValueError(f"ordinal {ordinal} added twice")
        self.extra[ordinal] = cursor
        while self.prefix in self.extra:
            self.last_cursor = self.extra.pop(self.prefix)
            self.prefix += 1

    def __contains__(self, ordinal: int) -> bool:
        return ordinal < self.prefix or ordinal in self.extra

    def state(self) -> dict:
        return {
            "ordinal": self.prefix,
            "last_cursor": self.last_cursor,
            "extra": sorted(self.extra),
            "extra_cursors": {str(o): c for o, c in sorted(self.extra.items())},
        }


def read_committed(committed: dict | None) -> tuple[int, list[int] | None, set[int]]:
    """(next ordinal, cursor of the ordinal before it, committed ordinals beyond) of a committed state; a
    state that contradicts itself raises ValueError."""
    if not committed:
        return 0, None, set()
    ordinal = int(committed.get("ordinal", 0))
    last = committed.get("last_cursor")
    if ordinal < 0 or (ordinal > 0) != (last is not None):
        raise ValueError(f"committed state is inconsistent: {committed}")
    extra = {int(o) for o in committed.get("extra", []) if int(o) > ordinal}
    return ordinal, [int(x) for x in last] if last is not None else None, extra

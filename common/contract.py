"""The typed contract between a producer and a trainer, above the wire protocol (common/protocol.py).

- ``Features``: what a producer ships in its batches. It is the WELCOME's ``describe`` map, and the
  consumer checks every batch against it (common/batchcheck.py).
- ``Expectation``: what a trainer requires of them. It is the HELLO's ``expect`` map. Both sides refuse a
  handshake on the first difference, by the one rule of ``mismatch``.
- ``BatchMeta``: the metadata of one batch. The producer announces it with the batch. The coupled
  baseline builds it too. The consumer reads the ordinal, cursor and epoch from it.

On the wire each one is a plain msgpack map (``to_wire``). A map from a peer may be hostile: it is read
with ``from_wire``, which raises ``ContractError`` for a missing key or a wrong type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


class ContractError(ValueError):
    """A map from a peer that is not what the contract says."""


def _field(data: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(key)
    # bool is an int in Python: an integer field takes no bool, and a bool field takes only bools.
    if type(value) is bool and kind is not bool:
        raise ContractError(f"{where}[{key!r}] must be {getattr(kind, '__name__', kind)}, got a bool")
    if not isinstance(value, kind):
        raise ContractError(f"{where}[{key!r}] must be {getattr(kind, '__name__', kind)}, got {repr(value)[:40]}")
    return value


def _int(data: dict, key: str, where: str) -> int:
    value = _field(data, key, int, where)
    if value < 0:
        raise ContractError(f"{where}[{key!r}] must be a non-negative integer, got {value}")
    return value


@dataclass(frozen=True)
class Expectation:
    """What a trainer requires of a producer's batches (HELLO ``expect``)."""

    target_identity: str
    """``common.hf.target_identity`` of the target whose head the drafter shares."""
    layer_ids: list[int]
    """The target layers whose outputs are the drafter's features."""
    dtype: str
    """The features' dtype name (common/codec.py)."""
    last_hidden: bool
    """Whether batches carry the target's last hidden state (target-distribution labels)."""

    def to_wire(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Features:
    """What a producer ships (WELCOME ``describe``): the expectation's fields and the batches' limits."""

    producer_id: int
    target_identity: str
    layer_ids: list[int]
    dtype: str
    last_hidden: bool
    hidden_size: int
    vocab_size: int
    token_budget: int

    def to_wire(self) -> dict:
        return asdict(self)


def mismatch(expect: dict, describe: dict) -> str | None:
    """The first expected key that the description does not meet, said for a log; None when all are met."""
    for key, wanted in expect.items():
        if describe.get(key) != wanted:
            return f"{key} differs: the producer ships {describe.get(key)!r}, the trainer expects {wanted!r}"
    return None


@dataclass(frozen=True)
class BatchMeta:
    """One batch's metadata, sent with it."""

    producer: int
    ordinal: int
    """The batch's position in its producer's stream (what the committed state counts)."""
    cursor: list[int]
    """[epoch, window, index] of the batch in the data order."""
    epoch: int
    tokens: int
    docs: int
    max_doc_len: int
    replay: bool = False
    """Computed again after a trainer lost it (a new incarnation's HELLO)."""

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> BatchMeta:
        """The metadata of a batch from a peer's map; ContractError names the first bad key."""
        where = "meta"
        if not isinstance(data, dict):
            raise ContractError(f"{where} must be a map, got {type(data).__name__}")
        cursor = data.get("cursor")
        if type(cursor) is not list or len(cursor) != 3 or not all(type(c) is int and c >= 0 for c in cursor):
            raise ContractError(f"{where}['cursor'] must be [epoch, window, index], got {repr(cursor)[:60]}")
        return cls(
            producer=_int(data, "producer", where),
            ordinal=_int(data, "ordinal", where),
            cursor=list(cursor),
            epoch=_int(data, "epoch", where),
            tokens=_int(data, "tokens", where),
            docs=_int(data, "docs", where),
            max_doc_len=_int(data, "max_doc_len", where),
            replay=_field(data, "replay", bool, where) if "replay" in data else False,
        )

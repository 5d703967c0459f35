"""The committed state's one format (common/committed.py): what the trainer writes, the producer reads back."""

from __future__ import annotations

import json

import pytest

from common.committed import OrdinalSet, read_committed
from producer.stream import parse_committed


def test_what_the_trainer_commits_the_producer_reads_back_exactly():
    trained = OrdinalSet()
    for ordinal in [0, 1, 3, 2, 6, 7]:  # out of order, as several ranks finish
        trained.add(ordinal, [0, ordinal // 2, ordinal % 2])
    state = json.loads(json.dumps(trained.state()))  # as a checkpoint or a HELLO carries it
    assert read_committed(state) == (4, [0, 1, 1], {6, 7})
    ordinal, cursor, extra = parse_committed(state)
    assert (ordinal, tuple(cursor), extra) == (4, (0, 1, 1), {6, 7})
    again = OrdinalSet(state)
    assert again.state() == trained.state() and 5 not in again and 6 in again and 3 in again


def test_a_state_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="inconsistent"):
        read_committed({"ordinal": 3, "last_cursor": None})
    with pytest.raises(ValueError, match="inconsistent"):
        read_committed({"ordinal": 0, "last_cursor": [0, 0, 0]})
    assert read_committed(None) == (0, None, set())


def test_an_ordinal_is_committed_once():
    trained = OrdinalSet()
    trained.add(0, [0, 0, 0])
    with pytest.raises(ValueError, match="twice"):
        trained.add(0, [0, 0, 0])

"""Deterministic order: per (seed, epoch) permutations, disjoint complete shards, seekable cursors."""

from __future__ import annotations

from itertools import islice

import numpy as np
import pytest

from producer.data.order import OrderConfig, OrderCursor, ShardOrder, epoch_permutation


def test_same_seed_and_epoch_same_order_else_different():
    assert np.array_equal(epoch_permutation(1000, seed=3, epoch=0), epoch_permutation(1000, seed=3, epoch=0))
    assert not np.array_equal(epoch_permutation(1000, seed=3, epoch=0), epoch_permutation(1000, seed=3, epoch=1))
    assert not np.array_equal(epoch_permutation(1000, seed=3, epoch=0), epoch_permutation(1000, seed=4, epoch=0))
    assert sorted(epoch_permutation(1000, seed=3, epoch=5).tolist()) == list(range(1000))


@pytest.mark.parametrize("num_samples, num_shards", [(1000, 1), (1000, 4), (1003, 4), (10, 7)])
def test_shards_are_disjoint_and_complete(num_samples, num_shards):
    for epoch in (0, 1):
        configs = [OrderConfig(seed=1, num_shards=num_shards, shard_index=p) for p in range(num_shards)]
        shards = [ShardOrder(num_samples, config) for config in configs]
        ids = [shard.epoch_ids(epoch).tolist() for shard in shards]
        assert sorted(sum(ids, [])) == list(range(num_samples))
        assert [len(i) for i in ids] == [shard.epoch_length() for shard in shards]
        assert max(map(len, ids)) - min(map(len, ids)) <= 1


def test_seek_yields_the_tail_of_the_uninterrupted_stream():
    order = ShardOrder(103, OrderConfig(seed=7, num_shards=3, shard_index=2))
    epoch_length = order.epoch_length()
    full = list(islice(order.iter_from(), 3 * epoch_length))
    # The stream rolls over epochs and each cursor names its own position.
    assert full[epoch_length][0] == OrderCursor(1, 0)
    assert [c for c, _ in full[:epoch_length]] == [OrderCursor(0, i) for i in range(epoch_length)]
    for k in range(0, len(full), 5):
        cursor = full[k][0]
        fresh = ShardOrder(103, OrderConfig(seed=7, num_shards=3, shard_index=2))
        assert list(islice(fresh.iter_from(cursor), len(full) - k)) == full[k:]


def test_epochs_are_reshuffled_and_each_covers_the_shard():
    order = ShardOrder(50, OrderConfig(seed=0, num_shards=2, shard_index=0))
    stream = [sample for _, sample in islice(order.iter_from(), 2 * order.epoch_length())]
    first, second = stream[: order.epoch_length()], stream[order.epoch_length() :]
    assert first != second
    assert len(set(first)) == len(first) == order.epoch_length()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_shards": 0}, "num_shards"), ({"num_shards": 2, "shard_index": 2}, "shard_index"), ({"seed": -1}, "seed")],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        OrderConfig(**kwargs)

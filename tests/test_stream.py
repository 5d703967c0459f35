"""The producer's batch stream: replays, skips and the publish/reconcile atomicity."""

import threading
import time

from common.config import BatchingConfig, DataConfig
from producer.data.batching import BatchPlan
from producer.data.build import build_data_source
from producer.data.order import OrderConfig, ShardOrder
from producer.stream import BatchStream


def _stream(committed=None) -> BatchStream:
    source = build_data_source(DataConfig(num_samples=200, vocab_size=50, mean_len=40, min_len=8, max_seq_len=128))
    plan = BatchPlan(source, ShardOrder(len(source), OrderConfig()), BatchingConfig(token_budget=256, window_docs=32))
    return BatchStream(plan, committed)


def _produce(stream: BatchStream, ring: set[int], n: int) -> list:
    batches = [stream.take() for _ in range(n)]
    for b in batches:
        stream.publish(b.ordinal, publish=lambda o=b.ordinal: ring.add(o), drop=lambda: None)
    return batches


def test_consumed_after_checkpoint_are_replayed_committed_are_skipped():
    stream, ring = _stream(), set()
    batches = _produce(stream, ring, 8)
    ring -= {0, 1, 2, 3, 4, 5}  # a trainer consumed 0..5 and died; its checkpoint holds 0, 1 and 4
    committed = {"ordinal": 2, "last_cursor": list(batches[1].cursor), "extra": [4]}
    assert stream.reconcile(committed, lambda: set(ring)) == 3
    again = [stream.take() for _ in range(4)]
    assert [b.ordinal for b in again] == [2, 3, 5, 8]
    assert [b.replay for b in again] == [True, True, True, False]
    assert again[0].sample_ids == batches[2].sample_ids


def test_a_restarted_producer_starts_at_the_committed_prefix_and_skips_extras():
    first, ring = _stream(), set()
    batches = _produce(first, ring, 6)
    resumed = _stream({"ordinal": 3, "last_cursor": list(batches[2].cursor), "extra": [4]})
    assert [(b.ordinal, b.sample_ids) for b in (resumed.take(), resumed.take())] == [
        (3, batches[3].sample_ids),
        (5, batches[5].sample_ids),
    ]


def test_reconcile_waits_for_a_publish_in_progress():
    """A batch is in flight or in the ring, never neither: a reconciliation that starts while a
    batch is being published sees it in the ring, and one consumed right after is then replayed."""
    stream, ring = _stream(), set()
    planned = stream.take()
    result = {}

    def slow_publish():
        reconciler = threading.Thread(target=lambda: result.update(n=stream.reconcile(None, lambda: set(ring))))
        reconciler.start()
        time.sleep(0.1)  # the reconciliation must wait for us
        ring.add(planned.ordinal)
        result["thread"] = reconciler

    stream.publish(planned.ordinal, publish=slow_publish, drop=lambda: None)
    result["thread"].join(5)
    assert result["n"] == 0, "seen in the ring, not lost"
    ring.discard(planned.ordinal)  # consumed and acked; then a new trainer incarnation arrives
    assert stream.reconcile(None, lambda: set(ring)) == 1
    assert stream.take().ordinal == planned.ordinal


def test_a_checkpoint_prunes_the_record_of_handed_out_batches_and_replays_still_work():
    """The record grows by a batch per batch until a checkpoint commits a prefix: then it shrinks,
    and a trainer that dies after that checkpoint still gets everything after it replayed."""
    stream, ring = _stream(), set()
    batches = _produce(stream, ring, 8)
    assert stream.position()["history"] == 8
    ring -= {0, 1, 2, 3, 4, 5}  # consumed; the trainer's checkpoint holds 0..3
    committed = {"ordinal": 4, "last_cursor": list(batches[3].cursor)}
    assert stream.forget_committed(committed) == 4
    assert stream.position()["history"] == 4
    assert stream.reconcile(committed, lambda: set(ring)) == 2  # it died: 4 and 5 come again
    assert [(b.ordinal, b.replay) for b in (stream.take(), stream.take(), stream.take())] == [
        (4, True),
        (5, True),
        (8, False),
    ]

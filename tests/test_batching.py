"""Token-budget batching: limits, packing, exact coverage per epoch, deterministic resume."""

from __future__ import annotations

import json
from itertools import islice

import numpy as np
import pytest
import torch

from common.batch import slot_tensors
from common.config import BatchingConfig, DataConfig
from producer.data.batching import BatchCursor, BatchPlan, BatchStats, RunningBatchStats, batch_stats, split_by_length
from producer.data.build import build_data_source
from producer.data.files import DataError
from producer.data.order import OrderConfig, ShardOrder

DATA = DataConfig(format="synthetic", vocab_size=500, num_samples=600, mean_len=200, min_len=8, max_seq_len=700)

LOADED = [t for t in slot_tensors() if t.source == "documents" and t.derive is None]
"""The slot tensors the data loader makes."""


def make_plan(data: DataConfig = DATA, num_shards: int = 1, shard_index: int = 0, **batching) -> BatchPlan:
    source = build_data_source(data)
    order = ShardOrder(len(source), OrderConfig(seed=11, num_shards=num_shards, shard_index=shard_index))
    return BatchPlan(source, order, BatchingConfig(**{"token_budget": 2048, "window_docs": 64, **batching}))


def one_epoch(plan: BatchPlan, epoch: int = 0) -> list[tuple[BatchCursor, list[int]]]:
    batches = []
    for cursor, sample_ids in plan.iter_batches(BatchCursor(epoch, 0, 0)):
        if cursor.epoch != epoch:
            return batches
        batches.append((cursor, sample_ids))
    raise AssertionError("unreachable: the stream is infinite")


def test_batches_respect_budget_and_pack_without_padding():
    plan = make_plan(max_docs_per_batch=6)
    for cursor, sample_ids in one_epoch(plan):
        batch = plan.materialize(cursor, sample_ids)
        documents = [plan.source.get(i) for i in sample_ids]
        assert batch.num_tokens <= 2048 and batch.num_docs <= 6
        assert batch.sample_ids.tolist() == sample_ids
        assert batch.cu_seqlens.tolist() == [0, *np.cumsum([len(d) for d in documents]).tolist()]
        assert torch.equal(batch.input_ids, torch.from_numpy(np.concatenate([d.input_ids for d in documents])))
        assert torch.equal(batch.loss_mask, torch.from_numpy(np.concatenate([d.loss_mask for d in documents])))
        assert all(batch.tensors()[t.name].dtype == t.dtype for t in LOADED)
        assert batch.epoch == cursor.epoch and batch.meta["cursor"] == list(cursor)


def test_each_epoch_covers_every_good_sample_of_each_shard_once(tmp_path):
    # Tokenized file with bad lines: they are left out of the batches, everything else is in.
    lines = []
    for i in range(300):
        lines.append("oops" if i % 37 == 5 else json.dumps({"input_ids": [i % 50] * (1 + i % 90)}))
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    data = DataConfig(format="tokenized", paths=[str(path)], max_seq_len=128)
    good = {i for i in range(300) if i % 37 != 5}

    for epoch in (0, 1):
        union: list[int] = []
        for shard in range(3):
            plan = make_plan(data, num_shards=3, shard_index=shard, token_budget=256, window_docs=32)
            shard_samples = [i for _, ids in one_epoch(plan, epoch) for i in ids]
            assert sorted(shard_samples) == sorted(set(plan.order.epoch_ids(epoch).tolist()) & good)
            union += shard_samples
        assert sorted(union) == sorted(good)


def test_resume_from_any_cursor_recomputes_the_same_batches():
    reference = make_plan()
    epoch_batches = len(one_epoch(reference))
    stream = list(islice(reference.iter_batches(), epoch_batches + 10))  # crosses into epoch 1
    for k in range(0, len(stream), 7):
        committed = stream[k][0]
        resumed = make_plan()  # a restarted producer: fresh source, empty caches
        tail = list(islice(resumed.iter_batches(committed.next()), len(stream) - k - 1))
        assert tail == stream[k + 1 :]
        if tail:
            cursor, sample_ids = tail[0]
            assert resumed.batch_at(cursor) == sample_ids
            recomputed = resumed.materialize(cursor, sample_ids)
            original = reference.materialize(cursor, sample_ids)
            assert all(torch.equal(recomputed.tensors()[n], original.tensors()[n]) for n in (t.name for t in LOADED))


def test_cursor_past_the_end_rolls_over():
    plan = make_plan()
    epoch = one_epoch(plan)
    last_cursor = epoch[-1][0]
    assert next(plan.iter_batches(last_cursor.next()))[0] == BatchCursor(1, 0, 0)
    first_of_window_1 = next(c for c, _ in epoch if c.window == 1)
    assert next(plan.iter_batches(BatchCursor(0, 0, 10_000)))[0] == first_of_window_1


def test_grouping_by_length_keeps_padding_low():
    data = DataConfig(format="synthetic", vocab_size=500, num_samples=600, mean_len=300, max_seq_len=1024)
    efficiency = {}
    for window in (1, 256):
        plan = make_plan(data, token_budget=4096, window_docs=window)
        running = RunningBatchStats()
        for cursor, sample_ids in one_epoch(plan):
            running.update(batch_stats(plan.materialize(cursor, sample_ids)))
        efficiency[window] = running.as_dict()["padding_efficiency"]
    assert efficiency[256] > 0.9
    assert efficiency[1] == 1.0  # one document per batch: nothing to pad, but tiny batches
    assert running.as_dict()["mean_batch_tokens"] > 3000


def test_batch_statistics():
    stats = BatchStats(num_docs=3, num_tokens=60, max_doc_len=30)
    assert stats.padding_efficiency == pytest.approx(60 / 90) and stats.mean_seq_len == 20
    running = RunningBatchStats()
    running.update(stats)
    running.update(BatchStats(num_docs=1, num_tokens=10, max_doc_len=10))
    summary = running.as_dict()
    assert summary["padding_efficiency"] == pytest.approx(70 / 100)
    assert summary["mean_seq_len"] == pytest.approx(17.5) and summary["mean_batch_docs"] == 2


def test_split_is_sorted_by_length_within_limits():
    lengths = [5, 100, 7, 60, 60, 3, 90]
    batches = split_by_length(list(range(7)), lengths, token_budget=160, max_docs=2)
    assert batches == [[1], [6, 3], [4, 2], [0, 5]]
    with pytest.raises(ValueError, match="token_budget"):
        split_by_length([0], [200], token_budget=160, max_docs=None)


def test_budget_below_max_seq_len_is_refused():
    with pytest.raises(ValueError, match="token_budget"):
        make_plan(token_budget=100)
    with pytest.raises(ValueError, match="window_docs"):
        BatchingConfig(window_docs=0)


def test_a_shard_without_good_documents_fails_instead_of_spinning(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("oops\n{}\n")
    plan = make_plan(DataConfig(format="tokenized", paths=[str(path)], max_seq_len=16), token_budget=16)
    with pytest.raises(DataError, match="no good document"):
        next(plan.iter_batches())

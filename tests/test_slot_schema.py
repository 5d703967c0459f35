"""The slot schema (common/batch.py SLOT_TENSORS) is the one place a slot's tensors are described: a tensor
added there travels from a real producer process through its ring, and is validated, viewed and padded."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from common import batch
from common.batch import PackedBatch, SlotDims, pad_packed, position_ids, slot_shapes
from common.batchcheck import BatchContractError, check_batch, check_delivery
from common.codec import bytes_needed
from common.config import load_config, save_config
from common.rundir import RunDir, read_json
from common.transport import RingClient
from tests.extended_slot import TOKEN_POSITIONS, extend
from tests.test_producer import OVERRIDES, ROOT, start_producer


@pytest.fixture
def extended(monkeypatch):
    """This process's schema with the added tensor, as the producer's."""
    monkeypatch.setattr(batch, "SLOT_TENSORS", batch.SLOT_TENSORS)
    extend()


def test_a_tensor_added_to_the_schema_travels_through_a_real_ring(short_tmp, extended):
    cfg = load_config(ROOT / "launch" / "tiny.toml", OVERRIDES)
    run_dir = RunDir(short_tmp / "run")
    run_dir.root.mkdir()
    save_config(cfg, run_dir.config)
    proc = start_producer(run_dir, module=("tests.extended_slot", "producer.server"))
    try:
        status = read_json(run_dir.producer_status(0))
        client = RingClient(status["endpoint"], "trainer/r0", 1, credits=2, accept=check_delivery)
        welcome = client.connect(10)
        got = []
        deadline = time.monotonic() + 60
        while len(got) < 3 and time.monotonic() < deadline:
            for delivery in client.poll(timeout_s=0.1):  # each passed check_delivery with the added tensor
                got.append((dict(delivery.meta), {k: v.clone() for k, v in delivery.tensors.items()}))
                client.ack(delivery)
                client.grant(1)
        client.close()
        # one poll may bring two deliveries (two credits are granted), so the loop can end at 4
        assert len(got) >= 3, f"received {len(got)} batches"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0

    describe = welcome.describe
    dims = SlotDims(
        tokens=cfg.batching.token_budget,
        docs=cfg.batching.token_budget,
        aux_width=len(describe["layer_ids"]) * describe["hidden_size"],
        hidden_size=describe["hidden_size"],
    )
    shapes = slot_shapes(dims, torch.float32, {"last_hidden": True})
    assert status["ring"]["slot_bytes"] == bytes_needed(shapes)  # the slot was sized with the added tensor
    assert shapes["token_positions"] == ((cfg.batching.token_budget,), torch.int32)

    for meta, tensors in got:
        cu = tensors["cu_seqlens"]
        assert torch.equal(tensors["token_positions"], position_ids(cu).to(torch.int32))  # the producer wrote it
        padded = PackedBatch.from_tensors(pad_packed(tensors, cfg.batching.token_budget), meta=meta)
        kept = padded.tensors()["token_positions"]
        assert kept.shape == (cfg.batching.token_budget,) and not kept[cu[-1] :].any()  # padded with its pad value
        assert list(padded.tensors()) == [t.name for t in batch.SLOT_TENSORS]

    # A consumer whose schema lacks the tensor refuses these batches by name, and one whose producer
    # leaves it out is refused too: validation follows the schema.
    meta, tensors = got[0]
    with pytest.MonkeyPatch.context() as plain:
        plain.setattr(batch, "SLOT_TENSORS", tuple(t for t in batch.SLOT_TENSORS if t is not TOKEN_POSITIONS))
        with pytest.raises(BatchContractError, match="unexpected tensors \\['token_positions'\\]"):
            check_batch(meta, tensors, describe)
    with pytest.raises(BatchContractError, match="'token_positions' is missing"):
        check_batch(meta, {k: v for k, v in tensors.items() if k != "token_positions"}, describe)
    with pytest.raises(BatchContractError, match="'token_positions' is torch.int64, it must be torch.int32"):
        check_batch(meta, {**tensors, "token_positions": tensors["token_positions"].long()}, describe)


def test_the_warm_start_batch_follows_the_schema(extended):
    from tests.drafter_fixtures import tiny_config
    from trainer.warm import synthetic_batch

    cfg = load_config(ROOT / "launch" / "tiny.toml")
    made = synthetic_batch(cfg, tiny_config(), torch.device("cpu")).tensors()
    tokens = cfg.batching.token_budget
    assert torch.equal(made["token_positions"], torch.arange(tokens, dtype=torch.int32))
    assert list(made) == [
        t.name for t in batch.SLOT_TENSORS if t.present({"last_hidden": cfg.training.label_mode != "data"})
    ]

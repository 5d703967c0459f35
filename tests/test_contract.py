"""The typed contract between producer and trainer (common/contract.py): one rule for the handshake, one
shape for a batch's metadata, and what a hostile map gets."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from common.contract import BatchMeta, ContractError, Expectation, Features, mismatch

FEATURES = Features(
    producer_id=0,
    target_identity="qwen3-L6-H32-cfgabc-embdef",
    layer_ids=[1, 3],
    dtype="bfloat16",
    last_hidden=False,
    hidden_size=32,
    vocab_size=64,
    token_budget=128,
)


def expectation(**changes) -> dict:
    base = Expectation(target_identity=FEATURES.target_identity, layer_ids=[1, 3], dtype="bfloat16", last_hidden=False)
    return dataclasses.replace(base, **changes).to_wire()


def test_every_field_a_trainer_expects_is_one_a_producer_describes():
    assert {f.name for f in dataclasses.fields(Expectation)} <= {f.name for f in dataclasses.fields(Features)}


def test_a_producer_that_ships_what_the_trainer_expects_is_accepted_after_the_wire():
    describe = msgpack.unpackb(msgpack.packb(FEATURES.to_wire()))
    assert mismatch(msgpack.unpackb(msgpack.packb(expectation())), describe) is None


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"layer_ids": [1, 4]}, "layer_ids"),
        ({"dtype": "float32"}, "dtype"),
        ({"last_hidden": True}, "last_hidden"),
        ({"target_identity": "other"}, "target_identity"),
    ],
)
def test_the_first_difference_is_named(changes, key):
    said = mismatch(expectation(**changes), FEATURES.to_wire())
    assert said is not None and said.startswith(f"{key} differs")


def test_batch_metadata_round_trips_through_msgpack():
    meta = BatchMeta(producer=1, ordinal=7, cursor=[0, 2, 3], epoch=0, tokens=100, docs=3, max_doc_len=60, replay=True)
    assert BatchMeta.from_wire(msgpack.unpackb(msgpack.packb(meta.to_wire()))) == meta


@pytest.mark.parametrize(
    "key, value",
    [
        ("ordinal", -1),
        ("ordinal", "7"),
        ("ordinal", True),
        ("epoch", 1.5),
        ("cursor", [0, 1]),
        ("cursor", [0, -1, 2]),
        ("tokens", None),
        ("replay", 1),
    ],
)
def test_a_hostile_field_is_refused_by_name(key, value):
    wire = BatchMeta(producer=0, ordinal=7, cursor=[0, 2, 3], epoch=0, tokens=100, docs=3, max_doc_len=60).to_wire()
    wire[key] = value
    with pytest.raises(ContractError, match=repr(key)):
        BatchMeta.from_wire(wire)


def test_a_missing_field_is_refused():
    wire = BatchMeta(producer=0, ordinal=7, cursor=[0, 2, 3], epoch=0, tokens=100, docs=3, max_doc_len=60).to_wire()
    del wire["max_doc_len"]
    with pytest.raises(ContractError, match="max_doc_len"):
        BatchMeta.from_wire(wire)
    with pytest.raises(ContractError):
        BatchMeta.from_wire([1, 2, 3])


def test_a_batch_whose_metadata_lies_about_its_size_is_dropped():
    import torch

    from common.batchcheck import BatchContractError, check_batch

    tensors = {
        "input_ids": torch.tensor([1, 2, 3, 4], dtype=torch.int32),
        "loss_mask": torch.ones(4, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 4], dtype=torch.int32),
        "sample_ids": torch.tensor([9]),
        "aux_hidden": torch.zeros(4, 64, dtype=torch.bfloat16),
    }
    meta = BatchMeta(producer=0, ordinal=0, cursor=[0, 0, 0], epoch=0, tokens=4, docs=1, max_doc_len=4).to_wire()
    check_batch(meta, tensors, FEATURES.to_wire())  # as announced: kept
    with pytest.raises(BatchContractError, match="announces 5 tokens in 1 documents"):
        check_batch({**meta, "tokens": 5}, tensors, FEATURES.to_wire())
    with pytest.raises(BatchContractError, match="'cursor'"):
        check_batch({**meta, "cursor": [0, 0]}, tensors, FEATURES.to_wire())

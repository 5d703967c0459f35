"""Protocol fuzzing (launch/tools/fuzz.py): hostile messages against a live producer process, a live
consumer process running the trainer's intake, and a live trainer process; short forms run in CI,
100,000 messages per side under ``-m fuzz`` (or ``python -m launch.tools.fuzz``)."""

import random

import pytest

from common.protocol import Message, ProtocolError, decode
from launch.tools.fuzz import (
    INTAKE_DESCRIBE,
    Hostile,
    HostileProducer,
    fuzz_consumer,
    fuzz_producer,
    fuzz_trainer,
    to_consumer,
    to_producer,
)


def _assert_held(report: dict) -> None:
    failed = [name for name, held in report["checks"].items() if not held]
    assert not failed, f"broken guarantees {failed}: {report}"


def test_hostile_peers_never_break_a_live_producer():
    report = fuzz_producer(3000, seed=11)
    assert report["messages"] == 3000
    assert report["kinds"]["stale-generation"] and report["kinds"]["never-leased"] and report["kinds"]["replay"]
    _assert_held(report)


def test_a_hostile_producer_never_breaks_the_trainer_intake():
    report = fuzz_consumer(3000, seed=12)
    assert report["messages"] >= 3000
    assert report["kinds"]["layout-outside"] and report["kinds"]["contract"] and report["kinds"]["replay"]
    _assert_held(report)


def test_a_hostile_producer_never_breaks_a_live_trainer():
    report = fuzz_trainer(1000, seed=13)
    assert report["trained_batches"] > 0 and report["dropped"] > 0
    _assert_held(report)


def test_decode_raises_nothing_but_protocol_errors():
    """Every generated frame either decodes to a checked message or raises ProtocolError; any other
    exception would end the thread that received it."""
    rng = random.Random(5)
    hostile = Hostile(rng, num_slots=4)
    producer = HostileProducer(rng, "inproc://fuzz-decode", INTAKE_DESCRIBE)
    outcomes = {"decoded": 0, "refused": 0}
    try:
        for i in range(10_000):
            frames = to_producer(hostile, generation_hint=i)[1] if i % 2 else [to_consumer(producer, [])[1]]
            for frame in frames:
                if len(frame) > (1 << 20):
                    continue  # zmq refuses these before decode sees them
                try:
                    assert isinstance(decode(frame), Message)
                    outcomes["decoded"] += 1
                except ProtocolError:
                    outcomes["refused"] += 1
    finally:
        producer.close()
    assert outcomes["refused"] > 5000 and outcomes["decoded"] > 500


@pytest.mark.fuzz
def test_100k_hostile_messages_against_a_live_producer():
    report = fuzz_producer(100_000, seed=1)
    assert report["messages"] == 100_000
    _assert_held(report)


@pytest.mark.fuzz
def test_100k_hostile_messages_against_the_trainer_intake():
    report = fuzz_consumer(100_000, seed=2)
    assert report["messages"] >= 100_000
    _assert_held(report)


@pytest.mark.fuzz
def test_100k_hostile_messages_against_a_live_trainer():
    report = fuzz_trainer(100_000, seed=3)
    assert report["messages"] >= 100_000
    _assert_held(report)

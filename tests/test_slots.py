"""Slot state machine: generations, holders, reclaim order, backpressure."""

import threading
import time

from common.slots import SlotTable


def test_lifecycle_and_stale_acks():
    table = SlotTable(2)
    a = table.acquire(0)
    seq = table.publish(a, "payload-a")
    lease = table.lease_next("c1")
    assert (lease.slot, lease.seq, lease.payload) == (a, seq, "payload-a")
    assert not table.release("c2", a, lease.generation)  # not the holder
    assert not table.release("c1", a, lease.generation + 1)  # stale generation
    assert not table.release("c1", 99, lease.generation)  # no such slot
    assert table.release("c1", a, lease.generation)
    assert not table.release("c1", a, lease.generation)  # twice
    assert table.counters.stale_acks == 4
    b = table.acquire(0)
    assert table._slots[b].generation != lease.generation or b != a


def test_reclaimed_leases_are_served_first_in_order():
    table = SlotTable(4)
    for name in "abcd":
        table.publish(table.acquire(0), name)
    first = [table.lease_next("dead").payload for _ in range(2)]
    assert first == ["a", "b"]
    assert sorted(table.reclaim("dead")) == [0, 1]
    assert [table.lease_next("new").payload for _ in range(4)] == ["a", "b", "c", "d"]


def test_acquire_blocks_on_full_ring_and_counts_blocked_time():
    table = SlotTable(1)
    slot = table.acquire(0)
    table.publish(slot, "x")
    assert table.acquire(0.05) is None
    lease = table.lease_next("c")
    threading.Timer(0.1, lambda: table.release("c", lease.slot, lease.generation)).start()
    started = time.monotonic()
    assert table.acquire(2.0) == slot
    assert time.monotonic() - started >= 0.09
    assert table.counters.blocked_s >= 0.14


def test_discard_ready():
    table = SlotTable(3)
    for n in range(3):
        table.publish(table.acquire(0), n)
    assert table.discard_ready(lambda p: p < 2) == [0, 1]
    assert table.counts() == {"free": 2, "filling": 0, "ready": 1, "leased": 0}

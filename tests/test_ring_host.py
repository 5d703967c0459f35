"""Host ring: shared bytes between processes, reserved up front, named by owner, swept when stale."""

import os
import subprocess
import sys

import pytest
import torch

from common import naming
from common.ring import HostRing, RingMemoryError, attach_ring


def test_create_attach_share_bytes_and_cleanup():
    ring = HostRing.create("t", "p0", num_slots=3, slot_bytes=4096)
    try:
        assert ring.path.exists() and oct(ring.path.stat().st_mode & 0o777) == "0o600"
        assert naming.parse_owner(ring.path.name) == tuple(int(x) for x in naming.owner_identity().split("-"))
        ring.slot(2).copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
        reader = attach_ring(ring.spec())
        assert torch.equal(reader.slot(2), ring.slot(2))
        assert not reader.owner
        reader.close()
        with pytest.raises(IndexError):
            ring.slot(3)
    finally:
        ring.close()
    assert not ring.path.exists()


def test_space_is_reserved_up_front():
    ring = HostRing.create("t", "p0", num_slots=2, slot_bytes=1 << 20)
    try:
        # st_blocks counts 512-byte blocks actually allocated: all of them, before any write.
        assert ring.path.stat().st_blocks * 512 >= 2 << 20
    finally:
        ring.close()


def test_undersized_dev_shm_names_the_bytes_needed():
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    slot_bytes = free + (1 << 30)
    with pytest.raises(RingMemoryError, match=f"needs {slot_bytes} bytes"):
        HostRing.create("t", "huge", num_slots=1, slot_bytes=slot_bytes)
    assert not [p for p in naming.SHM_DIR.iterdir() if ".huge." in p.name]


def test_attach_refuses_paths_outside_the_ring_directory(tmp_path):
    for path in ["/etc/passwd", str(tmp_path / "dflash.x.1-2"), "/dev/shm/../../etc/passwd", "/dev/shm/other"]:
        with pytest.raises(RingMemoryError):
            attach_ring({"backend": "host", "path": path, "num_slots": 1, "slot_bytes": 1})
    with pytest.raises(RingMemoryError):
        attach_ring({"backend": "gpu-of-doom"})


def test_attach_checks_size_against_spec():
    ring = HostRing.create("t", "p0", num_slots=2, slot_bytes=4096)
    try:
        with pytest.raises(RingMemoryError, match="has 8192 bytes"):
            attach_ring({**ring.spec(), "slot_bytes": 1 << 20})
    finally:
        ring.close()


def test_stale_sweep_removes_dead_owners_only():
    dead = subprocess.run(
        [sys.executable, "-c", "from common.naming import owner_identity; print(owner_identity())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_identity = dead.stdout.strip()
    dead_path = naming.SHM_DIR / f"dflash.sweeptest.p0.{dead_identity}"
    live_path = naming.SHM_DIR / f"dflash.sweeptest.p1.{naming.owner_identity()}"
    recycled = naming.SHM_DIR / f"dflash.sweeptest.p2.{os.getpid()}-1"  # our pid, another start time
    for path in (dead_path, live_path, recycled):
        path.write_bytes(b"x")
    try:
        removed = naming.sweep_stale_segments()
        assert dead_path in removed and recycled in removed
        assert not dead_path.exists() and not recycled.exists()
        assert live_path.exists()
    finally:
        for path in (dead_path, live_path, recycled):
            path.unlink(missing_ok=True)

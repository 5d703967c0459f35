"""Too little of a resource is a clear error and loses nothing: /dev/shm, disk for checkpoints,
a run directory of another format. (Too little GPU memory for a CUDA ring: tests/test_ring_cuda.py.)

/dev/shm and the disk are made small for real: a tmpfs mounted in a private mount namespace
(``unshare -rm``: root, or unprivileged user namespaces). Where that is not possible the disk-full
case falls back to RLIMIT_FSIZE and the /dev/shm cases are skipped.
"""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config, save_config
from common.naming import run_tag
from common.rundir import RUN_DIR_FORMAT, RunDir, read_json
from common.rundir import RunDir as LaunchRunDir

ROOT = Path(__file__).resolve().parents[1]
PRODUCER_OVERRIDES = [
    "data.num_samples=60",
    "data.mean_len=48",
    "data.min_len=8",
    "data.max_seq_len=128",
    "batching.window_docs=16",
    "launch.num_producers=1",
    "ring.num_slots=64",
]


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


NAMESPACES = _namespaces_work()


def _with_small_tmpfs(
    mountpoint: Path, size: str, argv: list[str], timeout_s: float = 300
) -> subprocess.CompletedProcess:
    """Run ``argv`` with a ``size`` tmpfs mounted on ``mountpoint``, seen by it alone."""
    script = 'mount -t tmpfs -o "size=$1" tmpfs "$2" && shift 2 && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", size, str(mountpoint), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.skipif(not NAMESPACES, reason="needs a private mount namespace (unshare -rm)")
def test_a_producer_refuses_to_start_on_a_small_dev_shm_naming_the_bytes(short_tmp):
    run = RunDir(short_tmp / "run")
    run.root.mkdir()
    cfg = load_config(ROOT / "launch" / "tiny.toml", PRODUCER_OVERRIDES)
    save_config(cfg, run.config)
    out = _with_small_tmpfs(
        Path("/dev/shm"),
        "1m",
        [sys.executable, "-m", "producer.server", "--run-dir", str(run.root), "--producer-id", "0"],
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "cannot start producer 0: /dev/shm has 1.0 MiB free but the ring needs" in out.stderr
    assert "64 slots x" in out.stderr and "Enlarge /dev/shm" in out.stderr
    assert "batching.token_budget" in out.stderr, "the key that sizes the slots is named as the config names it"


@pytest.mark.skipif(not NAMESPACES, reason="needs a private mount namespace (unshare -rm)")
def test_dev_shm_filling_up_after_the_check_is_still_a_clear_error_not_a_sigbus():
    # Another process may take the space between the free-space check and the reservation.
    program = (
        "import common.ring as ring\n"
        "ring._shm_free_bytes = lambda: 1 << 40\n"
        "try:\n"
        "    ring.HostRing.create('t', 'p0', num_slots=4, slot_bytes=1 << 20)\n"
        "except ring.RingMemoryError as exc:\n"
        "    print(exc)\n"
        "import os\n"
        "print(sorted(os.listdir('/dev/shm')))\n"
    )
    out = _with_small_tmpfs(Path("/dev/shm"), "1m", [sys.executable, "-c", program])
    assert out.returncode == 0, out.stderr
    message, leftovers = out.stdout.strip().splitlines()
    assert "could not reserve 4194304 bytes" in message and "No space left on device" in message
    assert leftovers == "[]", "the half-made segment is removed"


def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(short_tmp):
    limit = "tmpfs" if NAMESPACES else "rlimit"  # a real full disk, else files capped by RLIMIT_FSIZE
    run = RunDir(short_tmp / "run")
    run.checkpoints.mkdir(parents=True)
    argv = [sys.executable, "-m", "tests.resource_roles", "checkpoint", "--run-dir", str(run.root), "--limit", limit]
    out = (
        _with_small_tmpfs(run.checkpoints, "24m", argv)
        if limit == "tmpfs"
        else subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    first, failed, later = report["first"], report["after_failure"], report["after_room"]
    assert first["latest"] == "step-00000000" and first["loads"]
    assert report["error"] and "cannot write checkpoint step-00000007" in report["error"]
    assert "Nothing was lost: step-00000000 stays the latest" in report["error"]
    assert failed == first, "latest.json and the previous checkpoint are untouched, no partial folder is left"
    assert later["latest"] == "step-00000007" and later["step"] == 7 and later["loads"] and not later["partial"]
    assert later["drafter_files"] == first["drafter_files"]
    assert not list(Path("/dev/shm").glob(f"dflash.{run_tag(run.root)}.*")), "the trainer left its staging behind"


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_run_directory_of_another_format_is_refused_untouched(short_tmp):
    run = LaunchRunDir(short_tmp / "run")
    run.create()
    assert read_json(run.format_file) == {"format": RUN_DIR_FORMAT, "software": "dflash-stream"}
    save_config(load_config(ROOT / "launch" / "tiny.toml"), run.config)
    (run.checkpoints / "latest.json").write_text('{"name": "step-00000100", "step": 100}')
    run.format_file.write_text(json.dumps({"format": RUN_DIR_FORMAT + 1, "software": "dflash-stream 9.0"}))
    before = _tree_digest(run.root)
    out = subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(run.root), "training.lr=1e-4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert f"run directory of format {RUN_DIR_FORMAT + 1} (written by dflash-stream 9.0)" in out.stderr
    assert f"this version reads format {RUN_DIR_FORMAT}" in out.stderr
    assert _tree_digest(run.root) == before, "nothing in the refused run directory changed"
    # Started by hand (e.g. a producer on another host), each process checks the folder itself.
    for role in (
        ["producer.server", "--producer-id", "0", "--device", "cpu"],
        ["trainer.train"],
        ["producer.synthesize", "--producer-id", "0", "--device", "cpu"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", role[0], "--run-dir", str(run.root), *role[1:]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and f"run directory of format {RUN_DIR_FORMAT + 1}" in out.stderr, (
            role,
            out.stderr[-2000:],
        )
    assert _tree_digest(run.root) == before, "nothing in the refused run directory changed"

    run.format_file.write_text("not json")
    with pytest.raises(Exception, match="not a run directory format marker"):
        run.create()


def test_a_run_directory_from_before_the_format_marker_is_refused_and_a_new_one_is_marked(short_tmp):
    """A run directory that trained and has no marker was made before the marker: format 1, refused untouched."""
    run = LaunchRunDir(short_tmp / "run")
    run.root.mkdir()
    save_config(load_config(ROOT / "launch" / "tiny.toml"), run.config)
    run.ledger.write_text('{"step": 1, "incarnation": 1, "samples": [], "batches": [], "time": 0}\n')
    with pytest.raises(Exception, match="run directory of format 1"):
        run.create()
    assert not run.format_file.exists()
    fresh = LaunchRunDir(short_tmp / "fresh")
    fresh.create()
    assert read_json(fresh.format_file)["format"] == RUN_DIR_FORMAT == 2

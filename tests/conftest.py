"""Shared test setup: the repo root on sys.path for subprocesses, offline wandb, GPU markers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One intra-op thread in every process of a test, pytest's own and the producers, trainers and ranks it
# starts (set before torch is imported). The models here are tiny, so OpenMP threads cost more than they
# give, and with two producers and a trainer on the 2 cores of CI each process's threads wait for one
# another that another process holds: the in-process tests ran 3x slower, a pipeline used 30% more CPU.
# What a test asserts does not depend on it. OMP_NUM_THREADS=N in the environment overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("DFLASH_PYTHON", sys.executable)  # launch/run_all.sh runs the tests' interpreter
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if (ROOT / ".speculators").is_dir():  # launch/setup_speculators.sh: the reference DSpark, after the venv's packages
    sys.path.append(str(ROOT / ".speculators"))


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    count = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and count < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and count < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` schedules by work stealing instead of xdist's "load": a worker that runs out takes half of what the
    busiest still holds. Under "load" a worker's refill (up to a sixth of the tests left) stays its own, and the files
    of real runs sit together in name order (test_synthesize, test_tensor_parallel, test_time_budget...): one worker
    ended the suite alone on a run of minutes-long tests while the others waited."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


_SESSION_PROCESSES: set[int] = set()
"""Children of this test process that serve every test (the preloader server), spared by ``no_orphan_processes``."""


@pytest.fixture(scope="session", autouse=True)
def preload_server():
    """One preloader server per test process (``python -m launch.preload --serve``, DFLASH_PRELOAD_SERVER): the
    launchers the tests start have it fork their preloaders instead of importing torch and transformers each
    (about 4 s of CPU per launcher, over 50 launchers). A launcher whose environment would import differently
    starts its own (launch/preload_client.py)."""
    import shutil
    import subprocess
    import tempfile

    from launch.preload_client import PRELOAD_SERVER_ENV, preload_server_command
    from launch.processes import child_environment, terminate_with_parent

    folder = Path(tempfile.mkdtemp(prefix="df-preload-", dir="/tmp"))
    server = subprocess.Popen(
        preload_server_command(folder / "socket"),
        env=child_environment(),
        cwd=ROOT,
        preexec_fn=terminate_with_parent(os.getpid()),
    )
    _SESSION_PROCESSES.add(server.pid)
    os.environ[PRELOAD_SERVER_ENV] = str(folder / "socket")
    yield
    os.environ.pop(PRELOAD_SERVER_ENV, None)
    server.terminate()
    server.wait()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Whatever a test started and did not stop (say, after a failed assertion) is killed here,
    so no producer outlives its test holding shared memory."""
    yield
    import signal

    from peers import child_pids

    for pid in set(child_pids(os.getpid())) - _SESSION_PROCESSES:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (``item.report_call``), for fixtures that act on a failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"report_{report.when}", report)


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (``pytest.mark.usefixtures("one_thread")``): forwards of a few tokens run
    faster so, and far faster on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def exact_fp32_matmul():
    """CUDA's fp32 products without TF32 for the test (a benchmark run in-process may have turned it on). Set and
    restored by hand: pytest's monkeypatch cannot restore this attribute (torch serves it through __getattr__, so
    monkeypatch records it as missing and its teardown fails deleting it)."""
    import torch

    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32
    matmul.allow_tf32 = False
    yield
    matmul.allow_tf32 = allowed


@pytest.fixture
def short_tmp(request):
    """A short directory for ipc sockets (their paths are limited to ~100 characters). Removed after the
    test, but kept when it failed: the run's logs there are what explains a failure that does not repeat."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="df-", dir="/tmp"))
    yield path
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        print(f"\n{request.node.nodeid} failed: its run directory is kept in {path}", file=sys.stderr)
        return
    import shutil

    shutil.rmtree(path, ignore_errors=True)

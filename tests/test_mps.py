"""launch.mps: the launcher runs a CUDA MPS control daemon of the run's own around its processes.

No GPU here: a stand-in nvidia-cuda-mps-control on PATH records how it is called (the real one needs
the NVIDIA driver). What is checked is the launcher's side: the daemon is started before the
producers with the run's pipe directory, every child gets that directory, a daemon left behind is told
to quit first, and the run's own is told to quit at the end; without the program the run stops with
exit 2 naming the key.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from peers import wait_for
from test_pipeline import ONE_PRODUCER, ROOT, SMALL, producer_pids, start, stop_and_finish, trainer_step

from common.config import load_config
from common.rundir import RunDir, read_json
from common.rundir import RunDir as LaunchRunDir
from launch.mps import MPS_CONTROL, MpsDaemon
from launch.supervisor import Supervisor

STAND_IN = """#!/bin/bash
if [ "$1" = "-d" ]; then
  echo "start pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_LOG"
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"
else
  read -r command
  echo "$command pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$FAKE_MPS_LOG"
  rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
fi
"""


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_without_the_mps_program_the_run_stops_naming_the_key(short_tmp):
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / MPS_CONTROL).exists())
    out = subprocess.run(
        [str(ROOT / "launch" / "run_all.sh"), "--run-dir", str(short_tmp / "run"), *SMALL, "launch.mps=true"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"launch.mps: {MPS_CONTROL} is not on PATH" in out.stderr


def test_the_run_has_its_own_mps_daemon_around_its_processes(short_tmp, monkeypatch):
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / MPS_CONTROL).write_text(STAND_IN)
    (bin_dir / MPS_CONTROL).chmod(0o755)
    calls = short_tmp / "mps-calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_LOG", str(calls))
    run_dir = short_tmp / "run"
    daemon = MpsDaemon(run_dir, run_dir / "logs")
    daemon.pipe.mkdir(parents=True, exist_ok=True)
    (daemon.pipe / "control").touch()  # the daemon of an earlier launcher of this run, killed with -9
    try:
        launcher = start(
            run_dir,
            "training.max_steps=0",
            "training.epochs=1000",
            "launch.mps=true",
            "logging.wandb_mode=disabled",
            *ONE_PRODUCER,  # a producer and the trainer: each child of the launcher is the daemon's client
        )
        run = RunDir(run_dir)
        wait_for(lambda: trainer_step(run) >= 2, "step 2", 180)
        children = [read_json(run.trainer_status)["pid"], *producer_pids(run).values()]
        for pid in children:
            assert _environ(pid).get("CUDA_MPS_PIPE_DIRECTORY") == str(daemon.pipe), (
                f"pid {pid} is a client of the run's daemon"
            )
        assert calls.read_text().splitlines() == [
            f"quit pipe={daemon.pipe}",
            f"start pipe={daemon.pipe} log={run_dir / 'logs' / 'mps'}",
        ]
        stop_and_finish(launcher, run_dir)
        assert calls.read_text().splitlines()[2:] == [f"quit pipe={daemon.pipe}"], "the run's daemon quits with the run"
    finally:
        shutil.rmtree(daemon.pipe, ignore_errors=True)


def test_only_producers_that_share_a_gpu_with_a_trainer_rank_get_the_sm_share(short_tmp, monkeypatch):
    """launch.mps_producer_sm_percent reaches the environment of a producer beside a trainer rank (a
    tensor-parallel one too), not a producer with GPUs of its own, and never the trainer."""
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / MPS_CONTROL).write_text(STAND_IN)
    (bin_dir / MPS_CONTROL).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = load_config(
        None,
        [
            "launch.mps=true",
            "launch.mps_producer_sm_percent=45",
            'launch.producer_devices=["cuda:0", "cuda:1", "cuda:2,cuda:3"]',
            'launch.trainer_devices=["cuda:1", "cuda:3"]',
        ],
    )
    supervisor = Supervisor(LaunchRunDir(short_tmp / "run"), cfg, has_cuda=lambda: True)
    shares = [p.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") for p in supervisor.producers.processes]
    assert shares == [None, "45", "45"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in supervisor.trainer.process.env
    assert all(
        p.env["CUDA_MPS_PIPE_DIRECTORY"] == str(supervisor.placement.mps.pipe) for p in supervisor.producers.processes
    )


def test_a_trainer_that_shares_a_gpu_with_a_producer_gets_the_sm_cap(short_tmp, monkeypatch):
    """launch.mps_trainer_sm_percent reaches the trainer's environment where one of its ranks shares a GPU with a
    producer (a tensor-parallel one's GPUs count), not a trainer on GPUs of its own, and never a producer."""
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / MPS_CONTROL).write_text(STAND_IN)
    (bin_dir / MPS_CONTROL).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    caps = []
    for trainer in ('["cuda:3"]', '["cuda:1"]', '["cuda:4", "cuda:5"]'):
        cfg = load_config(
            None,
            [
                "launch.mps=true",
                "launch.mps_trainer_sm_percent=80",
                'launch.producer_devices=["cuda:0", "cuda:2,cuda:3"]',
                f"launch.trainer_devices={trainer}",
            ],
        )
        supervisor = Supervisor(LaunchRunDir(short_tmp / "run"), cfg, has_cuda=lambda: True)
        caps.append(supervisor.trainer.process.env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))
        assert all("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in p.env for p in supervisor.producers.processes)
    assert caps == ["80", None, None]

"""launch.preload: a CPU run's producers and trainers are forked from one preloaded interpreter, and what the
launcher knows of them (pids, exit codes, kill -9, its own death) is what it knows of children it started itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from peers import wait_for
from test_pipeline import (
    assert_exactly_once,
    epochs_trained,
    every_producer_reached,
    finish,
    producer_pids,
    start,
    stop_and_finish,
    trainer_step,
)

from common.naming import process_alive
from common.rundir import RunDir, read_json
from launch import processes
from launch.preload_client import PRELOAD_SERVER_ENV, Preloader, imports_alike
from launch.processes import child_environment


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def command_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def run_dir(short_tmp) -> Path:
    return short_tmp / "run"


def test_a_kill_9_of_a_preloaded_trainer_and_of_the_preloader_itself_loses_nothing(run_dir):
    """The roles are forked from the preloader and named for ps. A kill -9 of the trainer reaches the launcher as
    SIGKILL (the preloader reports its children's exits) and it is restarted; a kill -9 of the preloader takes its
    children down with it (SIGTERM), and the launcher starts a new preloader and all of them again. Every sample
    of epoch 0 is trained exactly once."""
    launcher = start(run_dir, "training.max_steps=0", "training.epochs=1000", "training.checkpoint_every=10")
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 6, "step 6", 120)
    trainer = read_json(run.trainer_status)["pid"]
    producers = producer_pids(run)
    preloader = parent_of(trainer)
    assert command_of(preloader)[1:3] == ["-m", "launch.preload"], command_of(preloader)
    assert {parent_of(pid) for pid in producers.values()} == {preloader}
    assert Path(f"/proc/{producers[0]}/comm").read_text().strip() == "producer.server"

    os.kill(trainer, signal.SIGKILL)
    launcher_out = run_dir.parent / "launcher.out"
    wait_for(lambda: "trainer crashed (killed by SIGKILL)" in launcher_out.read_text(), "the trainer's crash", 60)
    step = trainer_step(run)
    wait_for(lambda: read_json(run.trainer_status)["pid"] != trainer and trainer_step(run) > step + 2, "training", 120)

    killed_at_us = time.time() * 1e6
    os.kill(preloader, signal.SIGKILL)
    wait_for(
        lambda: all(
            pid not in producers.values() and (read_json(run.producer_status(i)) or {}).get("ready")
            for i, pid in producer_pids(run).items()
        ),
        "both producers started again",
        120,
    )
    now = producer_pids(run)[0]
    assert command_of(parent_of(now))[1:3] == ["-m", "launch.preload"] and parent_of(now) != preloader
    wait_for(
        lambda: every_producer_reached(run, 2, since_incarnation=killed_at_us),
        "epoch 2 of both producers after the preloader's death",
        180,
    )
    stop_and_finish(launcher, run_dir)
    assert_exactly_once(run, must_reach={0, 1})


def test_a_group_of_ranks_is_forked_and_a_kill_9_of_its_leader_takes_its_ranks_down(run_dir):
    """A two-rank trainer and a tensor-parallel producer on the CPU: the preloader forks each group's leader
    (launch.torchrun's command line), which holds the group's store and forks the ranks, as torchrun starts
    them. kill -9 of the trainer's leader: its ranks get SIGTERM and leave, and the launcher starts the trainer
    again. The stop reaches the producer's ranks through their leader and they stop cleanly. Every sample
    trained exactly once."""
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=1000",
        "training.checkpoint_every=10",
        'launch.trainer_devices=["cpu", "cpu"]',
        'launch.producer_devices=["cpu,cpu"]',
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 6, "step 6", 180)
    rank_zero = read_json(run.trainer_status)["pid"]
    leader = parent_of(rank_zero)
    preloader = parent_of(leader)
    assert command_of(preloader)[1:3] == ["-m", "launch.preload"], command_of(preloader)
    assert command_of(leader)[1:8] == [
        "-m",
        "launch.torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer.train",
    ]
    assert command_of(rank_zero)[1:4] == ["-u", "-m", "trainer.train"], command_of(rank_zero)
    ranks = children_of(leader)
    assert len(ranks) == 2 and rank_zero in ranks
    producer = read_json(run.producer_status(0))
    producer_leader = producer["torchrun_pid"]
    assert parent_of(producer_leader) == preloader
    assert {parent_of(pid) for pid in producer["tensor_parallel"]["pids"]} == {producer_leader}

    killed_at_us = time.time() * 1e6
    os.kill(leader, signal.SIGKILL)
    wait_for(lambda: not any(process_alive(pid) for pid in ranks), "the killed leader's ranks to leave", 60)
    wait_for(
        lambda: max(epochs_trained(run, since_incarnation=killed_at_us).values(), default=-1) >= 2,
        "epoch 2 trained by the trainer started again",
        240,
    )
    stop_and_finish(launcher, run_dir)
    assert read_json(run.producer_status(0))["torchrun_pid"] == producer_leader, "the producer was never restarted"
    log = (run.logs / "producer-0.log").read_text()
    assert "producer 0 stopped cleanly" in log and "rank 1: STOP from rank 0" in log, "a clean stop of both ranks"
    assert_exactly_once(run, must_reach={0})


def test_a_forked_group_exits_as_torchrun_does(short_tmp):
    """A rank's exit 2 (a configuration error) ends the group with exit 2 under torchrun (launch.torchrun, whose
    ranks here are argparse's usage error) and forked by the preloader alike (a trainer's missing config);
    SIGTERM to a forked group's leader stops its ranks and it exits 128 + 15, as torchrun does."""
    group = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node", "2", "-m"]
    torchrun = subprocess.run(
        [*group, "json.tool", "--no-such-option"], env=child_environment(), capture_output=True, text=True, timeout=120
    )
    assert torchrun.returncode == 2, torchrun.stdout + torchrun.stderr
    command = [*group, "trainer.train", "--run-dir", str(short_tmp / "none")]
    preloader = Preloader(child_environment())
    log_path = short_tmp / "group.log"
    try:
        with log_path.open("ab") as log:
            assert preloader.spawn(command, child_environment(), log).wait(timeout=120) == 2
            assert "does not exist" in log_path.read_text(), log_path.read_text()
            (short_tmp / "waits").mkdir()
            waiting = [*group, "trainer.train", "--run-dir", str(short_tmp / "waits"), "--standby"]  # waits its turn
            leader = preloader.spawn(waiting, child_environment(), log)
            wait_for(lambda: len(children_of(leader.pid)) == 2, "the two ranks", 60)
            ranks = children_of(leader.pid)
            leader.send_signal(signal.SIGTERM)
            assert leader.wait(timeout=60) == 128 + signal.SIGTERM
            assert not any(process_alive(pid) for pid in ranks)
    finally:
        preloader.close()


def test_without_preload_the_roles_are_fresh_interpreters(run_dir):
    """launch.preload=false (and every GPU run): python -m producer.server and -m trainer.train, as before."""
    launcher = start(
        run_dir,
        "training.max_steps=30",
        "launch.preload=false",
        "launch.num_producers=1",
        'launch.producer_devices=["cpu"]',
    )
    run = RunDir(run_dir)
    wait_for(lambda: producer_pids(run), "the producer", 60)
    assert command_of(producer_pids(run)[0])[1:3] == ["-m", "producer.server"]
    finish(launcher, run_dir)


def test_a_preloaded_role_reports_its_exit_code_and_its_signal(short_tmp):
    """The preloader reports a role's exit 2 (a configuration error, as it logs it) and a kill -9 as
    ``Popen.returncode`` has them; a command that is not a role is left to a fresh interpreter."""
    preloader = Preloader(child_environment())
    log_path = short_tmp / "role.log"
    command = [sys.executable, "-m", "trainer.train", "--run-dir", str(short_tmp / "none")]
    try:
        with log_path.open("ab") as log:
            assert preloader.spawn(command, child_environment(), log).wait(timeout=120) == 2
            assert "config file" in log_path.read_text() and "does not exist" in log_path.read_text()
            killed = preloader.spawn(command, child_environment(), log)
            os.kill(killed.pid, signal.SIGKILL)  # long before it could read its run directory
            assert killed.wait(timeout=60) == -signal.SIGKILL
            assert preloader.spawn([sys.executable, "-m", "launch.check"], child_environment(), log) is None
    finally:
        preloader.close()
    assert preloader.current is None


def test_the_preload_server_forks_a_launchers_preloader_only_where_it_imported_alike(short_tmp):
    """With DFLASH_PRELOAD_SERVER (the suite's server), the launcher's preloader is the server's fork, also where
    only thread counts and the project's own variables differ; where a variable a library may read at import time
    differs, the launcher starts its own preloader."""
    command = [sys.executable, "-m", "trainer.train", "--run-dir", str(short_tmp / "none")]
    server_socket = Path(os.environ[PRELOAD_SERVER_ENV])
    wait_for(server_socket.exists, "the server's imports (it binds its socket after them)", 120)

    def preloader_of(env: dict[str, str]) -> tuple[int, int]:
        """The preloader's pid and its parent's."""
        preloader = Preloader(env)
        try:
            with (short_tmp / "role.log").open("ab") as log:
                assert preloader.spawn(command, child_environment(), log).wait(timeout=120) == 2
            return preloader.current.pid, parent_of(preloader.current.pid)
        finally:
            preloader.close()

    served, server = preloader_of(child_environment({"OMP_NUM_THREADS": "3", "DFLASH_FAULT": "none"}))
    assert command_of(server)[1:5] == ["-m", "launch.preload", "--serve", str(server_socket)]
    assert not process_alive(served), "a served preloader ends with its launcher's connection"
    assert "TRANSFORMERS_VERBOSITY" not in os.environ
    own, parent = preloader_of(child_environment({"TRANSFORMERS_VERBOSITY": "error"}))
    assert parent == os.getpid() and not process_alive(own)

    base = {"PATH": "/bin", "PYTHONPATH": "/a:/b", "_": "/bin/bash"}
    assert imports_alike(base, {**base, "PYTHONPATH": "/b:/a:/a", "SHLVL": "2", "_": "/usr/bin/env", "DFLASH_X": "1"})
    assert not imports_alike(base, {**base, "PYTHONPATH": "/a:/b:/c"})
    assert not imports_alike(base, {**base, "HF_HOME": "/elsewhere"})


def test_without_a_gpu_driver_the_launcher_does_not_import_torch_to_learn_it(monkeypatch):
    """No device file of a GPU driver: no CUDA, answered without the subprocess that imports torch (seconds)."""
    monkeypatch.setattr(processes, "GPU_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    monkeypatch.setattr(processes.subprocess, "run", lambda *a, **k: pytest.fail("torch was asked"))
    assert processes.detect_cuda() is False

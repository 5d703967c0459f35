"""The launcher with real processes: launch/run_all.sh -> launch/supervisor.py -> stand-in roles.

The producer and trainer are the cheap stand-ins of tests/launcher_roles.py (the launcher's
DFLASH_PRODUCER_CMD / DFLASH_TRAINER_CMD testing hook); everything else is real: process groups,
signals, pid files, restarts, the restart-trainer and stop commands.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from peers import wait_for

from common.config import RunConfig, load_config
from common.naming import owner_identity, process_alive
from common.rundir import RunDir, read_json
from launch import processes, runs

ROOT = Path(__file__).resolve().parents[1]
RUN_ALL = str(ROOT / "launch" / "run_all.sh")
STANDIN = f"{sys.executable} -m tests.launcher_roles"
BASE_CONFIG = """
[training]
max_steps = 0
[launch]
producer_devices = ["cpu", "cpu"]
trainer_devices = ["cpu"]
restart_backoff_s = 0.2
"""


def launcher_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # run_all.sh falls back to python3 on PATH when the repo has no .venv: make it this interpreter.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env[processes.PRODUCER_CMD_ENV] = f"{STANDIN} producer"
    env[processes.TRAINER_CMD_ENV] = f"{STANDIN} trainer"
    env.update(extra)
    return env


class Pipeline:
    """One launcher started through run_all.sh on a run dir in a short tmp folder."""

    def __init__(self, tmp: Path, name: str = "run") -> None:
        self.tmp = tmp
        self.run = RunDir(tmp / name)
        self.config_file = tmp / "base.toml"
        if not self.config_file.exists():
            self.config_file.write_text(BASE_CONFIG)
        self.proc: subprocess.Popen | None = None
        self.seen_pids: set[int] = set()

    def start(self, *overrides: str, config: bool = True, **env: str) -> Pipeline:
        args = [RUN_ALL, "--run-dir", str(self.run.root)] + (["--config", str(self.config_file)] if config else [])
        self.proc = subprocess.Popen(
            [*args, *overrides], env=launcher_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        return self

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RUN_ALL, *args, "--run-dir", str(self.run.root)],
            env=launcher_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def finish(self, timeout_s: float = 30.0) -> tuple[int, str]:
        output, _ = self.proc.communicate(timeout=timeout_s)
        return self.proc.returncode, output

    def launcher(self) -> dict:
        record = read_json(self.run.launcher) or {}
        self.seen_pids.update(
            c["pid"] for c in record.get("producers", []) + [record.get("trainer") or {}] if c.get("pid")
        )
        return record

    def producer_pids(self) -> list[int | None]:
        return [p["pid"] for p in self.launcher()["producers"]]

    def trainer_pid(self) -> int | None:
        return self.launcher()["trainer"]["pid"]

    def wait_training(self, other_than: int | None = None) -> int:
        """Wait until a trainer (not ``other_than``) has made steps; its pid."""

        def training() -> int | None:
            pid = self.launcher().get("trainer", {}).get("pid")
            status = read_json(self.run.trainer_status) or {}
            if pid and pid != other_than and status.get("pid") == pid and status.get("step", 0) > 0:
                return pid
            return None

        return wait_for(training, "a training trainer")

    def stop_and_check_clean(self) -> None:
        """Stop if still running, then assert that no process of the run is left."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.finish()
        self.launcher()
        leftovers = [pid for pid in self.seen_pids if process_alive(pid)]
        for pid in leftovers:
            os.killpg(pid, signal.SIGKILL)
        assert not leftovers, f"processes left behind: {leftovers}"


@pytest.fixture
def pipeline(short_tmp):
    pipe = Pipeline(short_tmp)
    yield pipe
    pipe.stop_and_check_clean()


def test_run_starts_waits_for_ready_and_finish_stops_producers(pipeline):
    sockets = pipeline.run.sockets
    sockets.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = sockets / f"p7.{dead.pid}-1.ipc"
    live = sockets / f"p8.{owner_identity()}.ipc"
    stale.touch()
    live.touch()

    rc, output = pipeline.start("training.max_steps=15").finish()

    assert rc == 0, output
    assert "producer-0 ready in" in output and "producer-1 ready in" in output
    assert "training finished at step 15" in output
    trainer = read_json(pipeline.run.trainer_status)
    assert trainer["state"] == "finished" and trainer["step"] == 15
    assert trainer["producers_ready_at_start"] is True
    assert trainer["devices"] == "cpu"  # DFLASH_TRAINER_DEVICES
    producer_pids = [read_json(pipeline.run.producer_status(i))["pid"] for i in range(2)]
    assert not any(process_alive(pid) for pid in producer_pids)
    record = pipeline.launcher()
    assert record["state"] == "finished" and record["exit_code"] == 0
    assert not stale.exists() and live.exists()  # only dead owners' sockets are swept
    assert pipeline.run.log("producer-1").read_text().startswith("==== producer-1 start 1 at ")
    assert "started trainer pid" in pipeline.run.log("launcher").read_text()
    config = tomllib.loads(pipeline.run.config.read_text())
    assert config["training"]["max_steps"] == 15


def test_crashed_trainer_restarts_with_doubling_backoff_producers_untouched(pipeline):
    pipeline.start()
    first = pipeline.wait_training()
    producers = pipeline.producer_pids()

    os.kill(first, signal.SIGKILL)
    second = pipeline.wait_training(other_than=first)
    os.kill(second, signal.SIGKILL)
    third = pipeline.wait_training(other_than=second)

    assert pipeline.producer_pids() == producers
    assert pipeline.launcher()["trainer"]["restarts"] == 2
    assert read_json(pipeline.run.trainer_status)["incarnation"] == 3
    log_text = pipeline.run.log("launcher").read_text()
    assert "trainer crashed (killed by SIGKILL), restarting in 0.2 s" in log_text
    assert "trainer crashed (killed by SIGKILL), restarting in 0.4 s" in log_text
    assert third not in (first, second)


def test_trainer_stopped_from_outside_is_replaced_at_once(pipeline):
    pipeline.start("launch.restart_backoff_s=30")  # a crash would wait 30 s; this must not
    first = pipeline.wait_training()
    os.kill(first, signal.SIGTERM)
    pipeline.wait_training(other_than=first)
    assert "without being asked: starting a new one" in pipeline.run.log("launcher").read_text()


def test_crashed_producer_restarts_trainer_untouched(pipeline):
    pipeline.start()
    trainer = pipeline.wait_training()
    first, other = pipeline.producer_pids()

    os.kill(first, signal.SIGKILL)

    def new_producer_ready() -> bool:
        status = read_json(pipeline.run.producer_status(0)) or {}
        record = pipeline.launcher()["producers"][0]
        return record["pid"] not in (None, first) and record["ready"] and status.get("pid") == record["pid"]

    wait_for(new_producer_ready, "a restarted, ready producer 0")
    assert pipeline.trainer_pid() == trainer
    assert pipeline.producer_pids()[1] == other
    assert pipeline.launcher()["producers"][0]["restarts"] == 1
    assert pipeline.run.log("producer-0").read_text().count("==== producer-0 start") == 2


def test_restart_trainer_applies_training_change_and_keeps_producers(pipeline):
    pipeline.start()
    old_trainer = pipeline.wait_training()
    producers = pipeline.producer_pids()

    result = pipeline.cli("restart-trainer", "training.lr=1e-4")

    assert result.returncode == 0, result.stderr
    new_trainer = pipeline.wait_training(other_than=old_trainer)
    assert f"pid {new_trainer}" in result.stdout and "training.lr" in result.stdout
    assert load_config(pipeline.run.config).training.lr == 1e-4
    status = read_json(pipeline.run.trainer_status)
    assert status["lr"] == 1e-4 and status["incarnation"] == 2
    assert pipeline.producer_pids() == producers
    assert f"trainer pid {old_trainer} exited (exit 0)" in pipeline.run.log("launcher").read_text()
    # The stand-in never reads the handover request it was sent: the launcher removes it once that trainer exited.
    assert not pipeline.run.handover_request(old_trainer).exists()
    assert not list(pipeline.run.control.glob("handover-*"))


@pytest.mark.parametrize(
    "override,key",
    [
        ("target.dtype=float32", "target.dtype"),
        ("data.num_samples=5", "data.num_samples"),
        ("training.label_mode=target_soft", "training.label_mode"),
        ("launch.num_producers=3", "launch.num_producers"),
    ],
)
def test_restart_trainer_refuses_keys_the_producers_depend_on(short_tmp, override, key):
    # One pipeline for all cases would be faster, but then a failure in one would hide the others.
    pipe = Pipeline(short_tmp).start()
    try:
        trainer = pipe.wait_training()
        config_before = pipe.run.config.read_text()

        result = pipe.cli("restart-trainer", "training.lr=1e-4", override)

        assert result.returncode == 2
        assert key in result.stderr and "cannot change while the producers run" in result.stderr
        assert pipe.run.config.read_text() == config_before
        assert pipe.trainer_pid() == trainer
    finally:
        pipe.stop_and_check_clean()


def test_restart_trainer_refuses_max_steps_0_unless_the_producers_count_epochs(short_tmp):
    """Producers write their epoch batch counts only when they started with training.max_steps 0; a trainer
    sized by epochs would wait for counts that never come (and crash-loop). Refused, naming the key; a run
    whose producers started with max_steps 0 may come back to it."""
    pipe = Pipeline(short_tmp).start("training.max_steps=100000")
    try:
        trainer = pipe.wait_training()
        result = pipe.cli("restart-trainer", "training.max_steps=0")
        assert result.returncode == 2 and "training.max_steps=0" in result.stderr, result.stderr
        assert pipe.trainer_pid() == trainer
    finally:
        pipe.stop_and_check_clean()
    counted = Pipeline(short_tmp, "run2").start("training.max_steps=0")
    try:
        counted.wait_training()
        assert counted.cli("restart-trainer", "training.max_steps=100000").returncode == 0
        counted.wait_training()
        assert counted.cli("restart-trainer", "training.max_steps=0").returncode == 0
    finally:
        counted.stop_and_check_clean()


def test_restart_trainer_refuses_invalid_value_naming_the_key(pipeline):
    pipeline.start()
    trainer = pipeline.wait_training()
    result = pipeline.cli("restart-trainer", "training.lr=-1")
    assert result.returncode == 2 and "training.lr" in result.stderr
    assert pipeline.trainer_pid() == trainer


def test_status_json_second_launcher_refused_and_stop_leaves_nothing(pipeline):
    pipeline.start()
    pipeline.wait_training()

    result = pipeline.cli("status", "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["launcher"]["alive"] is True
    assert [p["id"] for p in status["producers"]] == [0, 1]
    for producer in status["producers"]:
        assert producer["alive"] is True and isinstance(producer["pid"], int)
        assert set(producer["ring"]) == {"slots", "free", "filling", "ready", "leased"}
        assert producer["ring"]["slots"] == 4 and producer["tokens_per_s"] == 1000.0
    assert status["trainer"]["alive"] is True and status["trainer"]["step"] > 0
    assert status["metrics"]["step"] > 0
    human = pipeline.cli("status")
    assert human.returncode == 0 and "producer" in human.stdout and "trainer" in human.stdout

    second = subprocess.run(
        [RUN_ALL, "--run-dir", str(pipeline.run.root)], env=launcher_env(), capture_output=True, text=True, timeout=30
    )
    assert second.returncode == 2 and "already runs" in second.stderr

    pids = pipeline.producer_pids() + [pipeline.trainer_pid()]
    stopped = pipeline.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert pipeline.finish()[0] == 0
    assert not any(process_alive(pid) for pid in pids)
    assert read_json(pipeline.run.trainer_status)["state"] == "stopped"  # it checkpointed
    after = pipeline.cli("status", "--json")
    assert after.returncode == 1
    assert not json.loads(after.stdout)["trainer"]["alive"]


def test_commands_without_a_running_launcher_exit_1(pipeline):
    pipeline.run.root.mkdir()
    assert pipeline.cli("restart-trainer", "training.lr=1e-4").returncode == 1
    assert pipeline.cli("stop").returncode == 1
    assert pipeline.cli("status").returncode == 1


def test_ctrl_c_exits_130_and_stops_everything(pipeline):
    pipeline.start()
    pipeline.wait_training()
    pipeline.proc.send_signal(signal.SIGINT)
    rc, output = pipeline.finish()
    assert rc == 130, output
    assert "received SIGINT" in output
    assert pipeline.launcher()["state"] == "stopped"


def test_children_stop_when_the_launcher_is_killed(pipeline):
    pipeline.start()
    pipeline.wait_training()
    pids = pipeline.producer_pids() + [pipeline.trainer_pid()]
    pipeline.proc.kill()
    pipeline.finish()
    wait_for(lambda: not any(process_alive(pid) for pid in pids), "children to notice the launcher's death", 10)


def test_config_errors_exit_2_naming_the_key_and_start_nothing(short_tmp):
    pipe = Pipeline(short_tmp)
    rc, output = pipe.start("training.lr=-1").finish()
    assert rc == 2 and "training.lr" in output
    rc, output = pipe.start("training.nope=1").finish()
    assert rc == 2 and "training.nope" in output
    assert not pipe.run.launcher.exists() and not pipe.run.config.exists()


def test_a_key_typo_in_the_config_file_names_the_file_and_the_closest_key(short_tmp):
    """Issue 45: a typo inside a TOML file names the file and suggests the key meant; a target.path that is not
    there says so (not "no config.json"), naming the key. Both exit 2 and start nothing."""
    config = short_tmp / "typo.toml"
    config.write_text(BASE_CONFIG.replace("[training]\n", "[training]\nlrr = 3e-4\n"))
    pipe = Pipeline(short_tmp)
    pipe.config_file = config
    rc, output = pipe.start().finish()
    assert rc == 2 and f"{config}: unknown key training.lrr (did you mean training.lr?" in output, output
    config.write_text(BASE_CONFIG.replace("[launch]", "[lanuch]"))
    rc, output = pipe.start().finish()
    assert rc == 2 and f"{config}: unknown key lanuch (did you mean launch?" in output, output
    rc, output = Pipeline(short_tmp, "run2").start("target.path=/nonexistent/Qwen3-8B").finish()
    assert rc == 2 and "target.path: /nonexistent/Qwen3-8B does not exist" in output, output
    assert not pipe.run.launcher.exists() and not pipe.run.config.exists()


def test_child_configuration_error_stops_the_run_with_exit_2(pipeline):
    rc, output = pipeline.start(STANDIN_TRAINER_EXIT="2").finish()
    assert rc == 2, output
    assert "trainer: configuration error (exit 2)" in output and "exiting with 2 as told" in output
    rc, output = Pipeline(pipeline.tmp, "run2").start(STANDIN_PRODUCER_EXIT="2").finish()
    assert rc == 2 and "configuration error (exit 2)" in output


def test_a_configuration_error_of_a_two_rank_trainer_stops_the_run_with_exit_2(short_tmp):
    """Under torchrun too: plain torchrun says exit 1 for a rank's exit 2, which the launcher would
    retry as a crash. A real trainer error (no step count with a remote producer) on 2 gloo ranks."""
    out = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "--run-dir",
            str(short_tmp / "run"),
            "launch.max_restarts=1",
            'launch.remote_producers=["tcp://127.0.0.1:5999"]',
            'launch.trainer_devices=["cpu", "cpu"]',
            "training.max_steps=0",
            "logging.wandb_mode=disabled",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = out.stdout + out.stderr
    assert out.returncode == 2, output[-3000:]
    assert "trainer: configuration error (exit 2)" in output and "training.max_steps" in output
    assert "restarting" not in output


def test_crash_loop_gives_up_after_max_restarts(pipeline):
    rc, output = pipeline.start(
        "launch.max_restarts=2", "launch.restart_backoff_s=0.05", STANDIN_TRAINER_EXIT="1"
    ).finish()
    assert rc == 1, output
    assert "restarting in 0.1 s (crash 2 in a row)" in output
    assert "crashed (exit 1) 3 times in a row, more than launch.max_restarts=2: giving up" in output
    assert pipeline.launcher()["state"] == "failed"


def test_crashes_with_checkpoints_in_between_are_no_crash_loop(pipeline):
    """Five trainer crashes in a row against max_restarts=2, each after a new checkpoint: restarted
    every time (the crash count starts again after progress), and the run finishes."""
    rc, output = pipeline.start(
        "launch.max_restarts=2",
        "launch.restart_backoff_s=0.05",
        "training.max_steps=5",
        STANDIN_TRAINER_CHECKPOINT_THEN_CRASH="5",
    ).finish()
    assert rc == 0, output
    assert output.count("trainer crashed (exit 1), restarting") == 5 and "giving up" not in output
    assert "(crash 1 in a row)" in output and "(crash 2 in a row)" not in output


def test_resume_keeps_the_run_config(pipeline):
    pipeline.config_file.write_text(BASE_CONFIG + "\n[data]\nseed = 7\n")
    rc, output = pipeline.start("training.max_steps=5", "training.lr=1e-3").finish()
    assert rc == 0, output

    rc, output = pipeline.start("training.max_steps=10", config=False).finish()

    assert rc == 0, output
    assert "resuming run" in output
    cfg = load_config(pipeline.run.config)
    assert (cfg.training.lr, cfg.training.max_steps, cfg.data.seed) == (1e-3, 10, 7)
    status = read_json(pipeline.run.trainer_status)
    assert (status["step"], status["incarnation"]) == (10, 2)

    other = pipeline.tmp / "other.toml"
    other.write_text(BASE_CONFIG)
    result = subprocess.run(
        [RUN_ALL, "--run-dir", str(pipeline.run.root), "--config", str(other)],
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "differs from the config of the existing run" in result.stderr


def test_devices_and_commands(monkeypatch):
    monkeypatch.delenv(processes.TRAINER_CMD_ENV, raising=False)
    monkeypatch.delenv(processes.PRODUCER_CMD_ENV, raising=False)
    cfg = load_config(None, ["launch.num_producers=3"])
    assert processes.producer_devices(cfg, lambda: False) == ["cpu"] * 3
    assert processes.producer_devices(cfg, lambda: True) == ["cuda:0"] * 3
    assert processes.trainer_devices(cfg, lambda: True) == ["cuda:0"]
    cfg = load_config(
        None, ['launch.producer_devices=["cuda:0", "cuda:1"]', 'launch.trainer_devices=["cuda:2", "cuda:3"]']
    )
    never = lambda: pytest.fail("CUDA detection is not needed when devices are listed")  # noqa: E731
    assert processes.producer_devices(cfg, never) == ["cuda:0", "cuda:1"]
    run_dir = Path("/tmp/r")
    assert processes.producer_command(run_dir, 1, "cuda:1")[1:] == [
        "-m",
        "producer.server",
        "--run-dir",
        "/tmp/r",
        "--producer-id",
        "1",
        "--device",
        "cuda:1",
    ]
    assert processes.trainer_command(run_dir, ["cpu"])[1:] == ["-m", "trainer.train", "--run-dir", "/tmp/r"]
    assert processes.trainer_command(run_dir, processes.trainer_devices(cfg, never))[1:] == [
        "-m",
        "launch.torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer.train",
        "--run-dir",
        "/tmp/r",
    ]


def test_only_trainer_keys_may_change_on_restart():
    """Derived from who reads each field (READ_BY in common/config/): a key a producer or the checkpoint holds is
    refused, one only the trainer or the launcher reads is not. eval.num_prompts used to be accepted although
    producer 0 evaluates with the value it started with."""
    old = load_config(None)
    new = load_config(
        None,
        [
            "training.lr=1e-5",
            "logging.log_every=1",
            'launch.trainer_devices=["cpu"]',
            "ring.credits=3",
            "drafter.num_layers=2",
            "drafter.block_size=8",
            "ring.num_slots=9",
            "eval.num_prompts=3",
            "eval.every_steps=20",
        ],
    )
    changed = runs.changed_keys(old, new)
    refused = " ".join(runs.refused_trainer_changes(changed))
    for key in ("drafter.num_layers", "drafter.block_size", "ring.num_slots", "eval.num_prompts"):
        assert f"{key} cannot change" in refused, key
    assert "drafter.block_size cannot change while the producers run (the drafter's checkpoint fixes it)" in refused
    for key in ("training.lr", "logging.log_every", "launch.trainer_devices", "ring.credits", "eval.every_steps"):
        assert key in changed and key not in refused, key


def test_every_config_field_says_who_reads_it():
    import dataclasses

    from common.config import READERS, readers

    for section in dataclasses.fields(RunConfig):
        section_type = type(getattr(RunConfig(), section.name))
        names = {f.name for f in dataclasses.fields(section_type)}
        declared = section_type.READ_BY
        assert set(declared) == names, f"{section.name}: READ_BY lists {sorted(set(declared) ^ names)} wrongly"
        for name in names:
            assert readers(f"{section.name}.{name}") and readers(f"{section.name}.{name}") <= set(READERS), (
                f"{section.name}.{name}"
            )


@pytest.mark.skipif(not runs.DEFAULT_CONFIG.is_file(), reason="launch/tiny.toml not written yet")
def test_no_arguments_runs_the_tiny_default_in_a_fresh_run_dir(short_tmp):
    proc = subprocess.Popen(
        [RUN_ALL], cwd=short_tmp, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        run_dir = wait_for(
            lambda: next((short_tmp / "runs").glob("*/trainer.json"), None), "the trainer of runs/<timestamp>", 60
        ).parent
        assert RunDir(run_dir).config.is_file()
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, output


def test_children_on_the_cpu_get_threads_that_fit_the_cores_unless_the_user_set_them(short_tmp, monkeypatch):
    """Issue 45: three processes with a thread per core each on two cores made the tiny quickstart 7x slower. Two
    producers and a trainer on the CPU share os.cpu_count() (at least one thread each), and the log says so once;
    a user's own OMP_NUM_THREADS is passed on as it is."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    threads = str(max(1, (os.cpu_count() or 1) // 3))
    pipe = Pipeline(short_tmp)
    try:
        pipe.start()
        pipe.wait_training()
        limits = [(read_json(pipe.run.producer_status(i)) or {}).get("threads") for i in range(2)]
        limits.append(read_json(pipe.run.trainer_status)["threads"])
    finally:
        pipe.stop_and_check_clean()
    assert limits == [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}] * 3, limits
    log = pipe.run.log("launcher").read_text()
    assert log.count(f"3 CPU processes on {os.cpu_count()} cores: {threads} threads each") == 1, log

    mine = Pipeline(short_tmp, "run2")
    try:
        mine.start(OMP_NUM_THREADS="5")
        mine.wait_training()
        limits = [(read_json(mine.run.producer_status(i)) or {}).get("threads") for i in range(2)]
        limits.append(read_json(mine.run.trainer_status)["threads"])
    finally:
        mine.stop_and_check_clean()
    assert limits == [{"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": None}] * 3, limits
    assert "threads each" not in mine.run.log("launcher").read_text()


def test_the_stop_command_a_refused_launcher_prints_works_when_pasted(short_tmp):
    """Issue 45: commands printed for the user to paste are quoted for the shell. A run directory with a space,
    left with a process of a dead launcher: the printed stop command, pasted into bash, stops that process."""
    import shlex
    import threading

    from common.naming import process_start_ticks
    from common.rundir import atomic_write_json

    run = RunDir(short_tmp / "my run")
    run.create()
    gone = subprocess.Popen(["true"])
    gone.wait()
    leftover = subprocess.Popen(["sleep", "120"], start_new_session=True)
    threading.Thread(target=leftover.wait, daemon=True).start()  # reaped at once: a zombie would still look alive
    try:
        atomic_write_json(
            run.launcher,
            {
                "pid": gone.pid,
                "start_ticks": 1,
                "producers": [],
                "trainer": {"pid": leftover.pid, "start_ticks": process_start_ticks(leftover.pid)},
            },
        )
        refused = subprocess.run(
            [RUN_ALL, "--run-dir", str(run.root)], env=launcher_env(), capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and "processes of the previous launcher still run" in refused.stderr, (
            refused.stderr
        )
        command = refused.stderr.split("run: ", 1)[1].strip()
        assert shlex.split(command) == ["launch/run_all.sh", "stop", "--run-dir", str(run.root)], command
        pasted = subprocess.run(
            ["bash", "-c", command], cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=90
        )
        assert pasted.returncode == 0 and "stopped" in pasted.stdout, pasted.stdout + pasted.stderr
        wait_for(lambda: leftover.poll() is not None, "the leftover process to stop", 10)
    finally:
        if leftover.poll() is None:
            leftover.kill()

"""Tensor-parallel producers: one target sharded over several devices, served as one producer.

Real processes throughout: torchrun with gloo ranks on the CPU (or NCCL on GPUs), the launcher
through launch/run_all.sh. This file is also the rank program of the capture comparison:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_tensor_parallel.py --out F ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from peers import wait_for
from test_pipeline import (
    assert_exactly_once,
    epochs_trained,
    every_producer_reached,
    finish,
    producer_pids,
    run_all,
    start,
    stop_and_finish,
    trainer_step,
)
from test_target import make_batch, tiny_qwen3_config

from common.batch import Document
from common.config import ConfigError, TargetConfig, load_config
from common.naming import process_alive
from common.rundir import RunDir, read_json
from common.status import ProducerStatus
from launch import processes
from producer.target_model.capture import Target
from producer.target_model.follower import follow
from producer.target_model.greedy import GreedyTarget
from producer.target_model.load import check_tensor_parallel
from producer.target_model.tensor_parallel import TensorParallelGroup, split_devices

ROOT = Path(__file__).resolve().parents[1]
LAYER_IDS = [1, 3]
# Document lengths of the packed batches compared (one batch of a single document).
BATCHES = [[7, 19, 1, 33], [64], [5, 40, 2, 17, 9]]
# Nothing a test here checks needs wandb, and each trainer start would start its service.
NO_WANDB = "logging.wandb_mode=disabled"


# -- the rank program ---------------------------------------------------------------------------------


def capture_ranks(
    out: Path, devices: str, target_path: str | None, seed: int, dtype: str, attention: str, evaluate: bool = False
) -> None:
    """One rank of a tensor-parallel target: rank 0 captures BATCHES (its followers run each forward
    with it, and get IDLE keepalives between them), saves identity and features to ``out``, says STOP.
    With ``evaluate`` rank 0 then evaluates a seeded drafter as producer 0 does (``eval_reports``)."""
    group = TensorParallelGroup.join(split_devices(devices), "--devices", keepalive_interval_s=0.05)
    cfg = TargetConfig(path=target_path, dtype=dtype, device=group.device, seed=seed, attention=attention)
    target = Target.load(cfg, LAYER_IDS, capture_last_hidden=True, group=group)
    head = target.head_tensors()  # gathered: every rank takes part, before they follow
    group.following = True
    if group.rank > 0:
        code = follow(group, target)
        group.close()
        sys.exit(code)
    features = []
    for index, lengths in enumerate(BATCHES):
        time.sleep(0.1)
        group.keepalive()  # an IDLE between batches: the followers must take it in their stride
        captured = target.capture(make_batch(lengths, seed=index))
        features.append((captured.aux_hidden.float().cpu(), captured.last_hidden.float().cpu()))
    reports = eval_reports(target.model, head, partial(GreedyTarget, followers=group)) if evaluate else None
    group.stop_followers()
    group.close()
    torch.save({"identity": target.identity, "features": features, "pids": group.pids, "reports": reports}, out)


def eval_reports(model, head: dict[str, torch.Tensor], make_target=GreedyTarget) -> list[dict]:
    """Real and simulated acceptance of a seeded drafter on seeded documents, with prompts decoded together and
    one at a time (every call a greedy target makes: prefills, greedy steps, document forwards)."""
    from common.config import EvalConfig
    from common.drafter.draft_config import DraftConfig
    from common.drafter.model import DFlashDrafter
    from common.drafter.target_head import TargetHead
    from producer.acceptance.evaluator import AcceptanceEvaluator

    vocab = int(model.config.vocab_size)
    config = DraftConfig.from_target(
        model.config, num_draft_layers=2, mask_token_id=vocab - 1, block_size=4, target_layer_ids=LAYER_IDS
    )
    torch.manual_seed(11)
    drafter = DFlashDrafter(
        config,
        TargetHead(
            head["model.embed_tokens.weight"],
            head["lm_head.weight"],
            head["model.norm.weight"],
            float(model.config.rms_norm_eps),
        ),
    )
    generator = torch.Generator().manual_seed(5)
    documents = [
        Document(
            i,
            torch.randint(0, vocab - 1, (40,), generator=generator).int().numpy(),
            np.r_[np.zeros(6 + i, np.uint8), np.ones(34 - i, np.uint8)],
        )
        for i in range(3)
    ]
    reports = []
    for together in (3, 1):
        eval_config = EvalConfig(num_prompts=3, max_new_tokens=12, batch_prompts=together)
        evaluator = AcceptanceEvaluator(
            model, documents, eval_config, LAYER_IDS, num_anchors=8, capture_last=True, make_target=make_target
        )
        reports.append(evaluator.evaluate(drafter).metrics())
    return reports


def start_capture(
    out: Path,
    devices: str,
    target_path: Path | None,
    seed: int = 0,
    dtype: str = "float32",
    attention: str = "auto",
    evaluate: bool = False,
) -> subprocess.Popen:
    ranks = len(devices.split(","))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(Path(__file__).resolve()),
        "--out",
        str(out),
        "--devices",
        devices,
        "--seed",
        str(seed),
        "--dtype",
        dtype,
        "--attention",
        attention,
        *(["--evaluate"] if evaluate else []),
    ]
    if target_path is not None:
        command += ["--target-path", str(target_path)]
    env = processes.producer_environment(devices)  # a producer's: a CPU group sees no GPU
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_capture(proc: subprocess.Popen, out: Path, timeout_s: float = 180.0) -> dict:
    output, _ = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, output[-4000:]
    return torch.load(out)


def one_device_features(cfg: TargetConfig) -> tuple[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    target = Target.load(cfg, LAYER_IDS, capture_last_hidden=True)
    captured = [target.capture(make_batch(lengths, seed=index)) for index, lengths in enumerate(BATCHES)]
    return target.identity, [(c.aux_hidden.float().cpu(), c.last_hidden.float().cpu()) for c in captured]


@pytest.fixture(scope="module")
def saved_target_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3 (4 heads, 2 key/value heads: TP=2 shards both) saved with save_pretrained, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny_qwen3_tp")
    model.save_pretrained(path)
    return path


# -- configuration and commands -------------------------------------------------------------------


@pytest.mark.parametrize(
    "devices, message",
    [
        ('["cpu,cuda:0"]', "launch.producer_devices[0]: mixes cpu and GPUs"),
        ('["cuda:0,cuda:0"]', "launch.producer_devices[0]: names a GPU twice"),
        ('["cuda:0,cuda:1", "cuda:1"]', "launch.producer_devices[1]: cuda:1 is also in launch.producer_devices[0]"),
        ('["cuda", "cuda:0,cuda:2"]', "launch.producer_devices[0]: cuda:0 is also in launch.producer_devices[1]"),
        ('["cuda,cuda:1"]', "launch.producer_devices[0]: names 'cuda'"),
        ('["cpu", "tpu:0"]', "launch.producer_devices[1]: must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_device_entries_are_checked_naming_the_entry(devices, message):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [f"launch.producer_devices={devices}"])
    assert message in str(raised.value)


def test_a_target_must_have_a_plan_and_heads_the_degree_divides():
    config = tiny_qwen3_config()  # 4 attention heads, 2 key/value heads
    check_tensor_parallel(config, 2)
    with pytest.raises(
        ValueError,
        match=r"must divide the target's attention heads \(4\) and key/value heads \(2\), "
        r"and does not divide the key/value heads$",
    ):
        check_tensor_parallel(config, 4)
    config.base_model_tp_plan = {}
    with pytest.raises(ValueError, match="target model type 'qwen3' has no tensor-parallel plan"):
        check_tensor_parallel(config, 2)


def test_entries_with_several_devices_are_one_producer_each():
    cfg = load_config(None, ['launch.producer_devices=["cuda:0,cuda:1", "cuda:2,cuda:3"]'])
    assert cfg.launch.local_producers == 2 and cfg.launch.total_producers == 2
    # Single-device producers may still share a GPU, as before.
    assert load_config(None, ['launch.producer_devices=["cuda:0", "cuda:0"]']).launch.local_producers == 2


def test_a_multi_device_entry_runs_under_torchrun(monkeypatch):
    monkeypatch.delenv(processes.PRODUCER_CMD_ENV, raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    command = processes.producer_command(Path("/tmp/r"), 0, "cuda:2,cuda:3")
    assert command[1:] == [
        "-m",
        "launch.torchrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "producer.server",
        "--run-dir",
        "/tmp/r",
        "--producer-id",
        "0",
        "--device",
        "cuda:2,cuda:3",
    ]
    # torchrun must stop its ranks within the launcher's own wait for a producer.
    shutdown = int(processes.producer_environment("cuda:2,cuda:3")["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 0 < shutdown < processes.PRODUCER_STOP_TIMEOUT_S
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in processes.producer_environment("cuda:1")
    # A group on the CPU sees no GPU from its start (this module's import asks CUDA before its capture joins).
    assert processes.producer_environment("cpu,cpu")["CUDA_VISIBLE_DEVICES"] == ""
    gpus = processes.producer_environment("cuda:2,cuda:3")
    assert gpus.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


# -- the sharded capture ------------------------------------------------------------------------------


def test_tp2_capture_equals_one_device_for_stored_and_random_targets(saved_target_dir, tmp_path):
    """Two torchrun groups at once (each its own rendezvous, no port clash): a target loaded from disk and
    a random one, each over 2 gloo ranks. Their features equal those of the same target on one device,
    and a random target's shards make the very model (same identity) a one-device producer builds."""
    stored, random = tmp_path / "stored.pt", tmp_path / "random.pt"
    procs = [start_capture(stored, "cpu,cpu", saved_target_dir), start_capture(random, "cpu,cpu", None, seed=7)]
    results = [wait_capture(proc, out) for proc, out in zip(procs, (stored, random))]
    configs = [
        TargetConfig(path=str(saved_target_dir), dtype="float32", device="cpu"),
        TargetConfig(dtype="float32", device="cpu", seed=7),
    ]
    for result, cfg in zip(results, configs):
        identity, expected = one_device_features(cfg)
        assert result["identity"] == identity
        assert len(set(result["pids"])) == 2
        for (aux, last), (want_aux, want_last) in zip(result["features"], expected):
            torch.testing.assert_close(aux, want_aux, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(last, want_last, atol=1e-5, rtol=1e-5)


def test_tp2_producer_zero_evaluates_as_one_device_does(tmp_path):
    """Rank 0 evaluates with its followers mirroring every call of the greedy target on their shards: the
    real and simulated acceptance equal those of the same target and drafter on one device."""
    out = tmp_path / "eval.pt"
    result = wait_capture(start_capture(out, "cpu,cpu", None, seed=7, evaluate=True), out)
    target = Target.load(TargetConfig(dtype="float32", device="cpu", seed=7), LAYER_IDS, capture_last_hidden=True)
    expected = eval_reports(target.model, target.head_tensors())
    for got, want in zip(result["reports"], expected, strict=True):
        for key in ("eval/tau", "eval/generated_tokens", "eval/target_forwards", "eval/num_prompts"):
            assert got[key] == want[key], key
        assert got["eval/sim_tau"] == pytest.approx(want["eval/sim_tau"], abs=1e-4)


# -- the pipeline -------------------------------------------------------------------------------------


def producer_ranks(run: RunDir, producer_id: int) -> list[int]:
    """Pids of a tensor-parallel producer's ranks (rank 0 first), from its status file."""
    return ((read_json(run.producer_status(producer_id)) or {}).get("tensor_parallel") or {}).get("pids") or []


@pytest.mark.thorough  # a tensor-parallel pipeline and its kill -9 are the tests beside it; this adds the trainer's kill
def test_pipeline_with_a_tensor_parallel_producer_exactly_once_and_kill9_of_the_trainer(short_tmp):
    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=1000",
        "training.checkpoint_every=10",
        NO_WANDB,
        'launch.producer_devices=["cpu,cpu", "cpu"]',
        "eval.every_steps=10",
        "logging.log_every=10",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 10, "step 10", 180)
    # The tensor-parallel producer 0 serves the trainer's evaluations, with its follower.
    wait_for(
        lambda: any("eval/tau" in json.loads(line) for line in run.metrics.read_text().splitlines()),
        "an evaluation result from producer 0",
        120,
    )
    producers, ranks = producer_pids(run), producer_ranks(run, 0)
    assert len(ranks) == 2 and ranks[0] == producers[0]
    status = json.loads(run_all("status", "--run-dir", str(run_dir), "--json").stdout)
    tensor_parallel = status["producers"][0]
    assert tensor_parallel["alive"] and tensor_parallel["ready"] and tensor_parallel["device"] == "cpu,cpu"
    assert tensor_parallel["ring"]["slots"] == 4, "the launcher's record (torchrun) and rank 0's status file agree"

    victim = read_json(run.trainer_status)["pid"]
    killed_at_us = time.time() * 1e6
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: every_producer_reached(run, 2, since_incarnation=killed_at_us),
        "the new trainer to train epoch 2 of both producers",
        240,
    )
    assert producer_pids(run) == producers and producer_ranks(run, 0) == ranks, "no producer was restarted"
    stop_and_finish(launcher, run_dir)
    assert len(assert_exactly_once(run, must_reach={0, 1})) == 2
    log = (run.logs / "producer-0.log").read_text()
    assert "producer 0 stopped cleanly" in log and "rank 1: STOP from rank 0" in log, "a clean stop of both ranks"


def test_kill9_of_either_rank_restarts_the_whole_producer_exactly_once(short_tmp):
    """kill -9 of rank 1: torchrun ends rank 0, the launcher restarts the producer, which resumes its shard
    from what the trainer committed. Then kill -9 of the new rank 0 (the server): its follower leaves at
    once, and the producer is restarted again. The trainer trains on throughout. The producer was never
    more than its ring, the trainer's credits and staging ahead (less than an epoch), so epoch 2 of its
    shard in the ledger is the restarted producers' work."""
    run_dir = short_tmp / "run"
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=1000",
        "training.checkpoint_every=10",
        NO_WANDB,
        'launch.producer_devices=["cpu,cpu", "cpu"]',
    )
    run = RunDir(run_dir)
    wait_for(lambda: trainer_step(run) >= 8, "step 8", 180)
    other, trainer = producer_pids(run)[1], read_json(run.trainer_status)["pid"]

    def restarted(old_ranks: list[int]) -> list[int]:
        """Wait until producer 0 is back, with ranks all new; their pids."""
        wait_for(
            lambda: (
                producer_pids(run).get(0) not in (None, old_ranks[0])
                and (read_json(run.producer_status(0)) or {}).get("ready")
            ),
            "producer 0 restarted",
            180,
        )
        ranks = producer_ranks(run, 0)
        assert len(ranks) == 2 and not set(ranks) & set(old_ranks), "both ranks are new"
        return ranks

    first = producer_ranks(run, 0)
    os.kill(first[1], signal.SIGKILL)
    second = restarted(first)
    os.kill(second[0], signal.SIGKILL)
    wait_for(lambda: not process_alive(second[1]), "the follower to leave with its rank 0", 30)
    restarted(second)
    wait_for(lambda: epochs_trained(run).get(0, -1) >= 2, "epoch 2 of producer 0's shard", 240)
    stop_and_finish(launcher, run_dir)
    assert read_json(run.trainer_status)["pid"] == trainer, "the trainer kept training through the restarts"
    assert producer_pids(run)[1] == other
    assert_exactly_once(run, must_reach={0})
    metrics = [json.loads(line) for line in run.metrics.read_text().splitlines()]
    assert any(m.get("producer/0/up") == 0 for m in metrics), "the trainer reported producer 0 down and kept training"


def test_a_degree_that_does_not_divide_the_heads_stops_the_run(short_tmp):
    """3 ranks for 4 heads: each rank exits 2 naming the entry and the numbers, torchrun passes it on
    (launch.torchrun), and the launcher stops the run instead of restarting the producer."""
    run_dir = short_tmp / "run"
    result = subprocess.run(
        [
            str(ROOT / "launch" / "run_all.sh"),
            "--run-dir",
            str(run_dir),
            NO_WANDB,
            'launch.producer_devices=["cpu,cpu,cpu"]',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    log = (run_dir / "logs" / "producer-0.log").read_text()
    assert "launch.producer_devices[0]: tensor parallelism over 3 devices" in log
    assert "attention heads (4) and key/value heads (2)" in log
    assert "restarting" not in (run_dir / "logs" / "launcher.log").read_text()


# -- on GPUs ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_tp2_capture_matches_one_gpu(saved_target_dir, tmp_path):
    out = tmp_path / "stored.pt"
    result = wait_capture(
        start_capture(out, "cuda:0,cuda:1", saved_target_dir, dtype="bfloat16", attention="varlen"), out
    )
    identity, expected = one_device_features(
        TargetConfig(path=str(saved_target_dir), dtype="bfloat16", device="cuda:0", attention="varlen")
    )
    assert result["identity"] == identity
    for (aux, last), (want_aux, want_last) in zip(result["features"], expected):
        # bf16, and the all-reduce sums the heads' partial products in another order than one matmul.
        torch.testing.assert_close(aux, want_aux, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(last, want_last, atol=3e-2, rtol=3e-2)


def run_stored_target_pipeline(
    run_dir: Path, target_dir: Path, producer_devices: str, trainer_device: str, *overrides: str
) -> RunDir:
    """3 epochs from a stored fp32 target run in bf16 by a tensor-parallel producer and a one-device one
    (same weights); exactly once, and the trainer agrees with both on the bf16 embedding."""
    launcher = start(
        run_dir,
        "training.max_steps=0",
        "training.epochs=3",
        f'target.path="{target_dir}"',
        "target.config_overrides={}",
        'target.dtype="bfloat16"',
        NO_WANDB,
        f"launch.producer_devices={producer_devices}",
        f'launch.trainer_devices=["{trainer_device}"]',
        *overrides,
    )
    finish(launcher, run_dir, timeout=300)
    run = RunDir(run_dir)
    assert read_json(run.trainer_status)["state"] == "finished"
    assert_exactly_once(run)
    return run


def test_pipeline_with_a_stored_bf16_target_on_a_tensor_parallel_producer(saved_target_dir, short_tmp):
    """Two faults a stored target met only in this pipeline: launch/tiny.toml's vocab_size override (now a
    configuration error, dropped here), and a trainer that hashed the checkpoint's fp32 embedding while
    the producers ship the bf16 one (refused at the handshake)."""
    run = run_stored_target_pipeline(short_tmp / "run", saved_target_dir, '["cpu,cpu", "cpu"]', "cpu")
    assert [s.device for s in ProducerStatus.read_all(run)] == ["cpu,cpu", "cpu"]


@pytest.mark.gpu
@pytest.mark.multigpu
def test_gpu_pipeline_with_a_tensor_parallel_producer(saved_target_dir, short_tmp):
    """A producer over both GPUs (NCCL, its ring on GPU 0 by CUDA IPC) beside one on the CPU (its GPUs are
    taken), the trainer on GPU 0. ``auto`` rings (tiny.toml's are host): each producer picks by its device."""
    run = run_stored_target_pipeline(
        short_tmp / "run", saved_target_dir, '["cuda:0,cuda:1", "cpu"]', "cuda:0", 'ring.backend="auto"'
    )
    statuses = ProducerStatus.read_all(run)
    assert [s.device for s in statuses] == ["cuda:0,cuda:1", "cpu"]
    assert [s.ring["backend"] for s in statuses] == ["cuda", "host"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="One rank of a tensor-parallel capture (see capture_ranks).")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", required=True)
    parser.add_argument("--target-path", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--evaluate", action="store_true")
    args = parser.parse_args()
    capture_ranks(args.out, args.devices, args.target_path, args.seed, args.dtype, args.attention, args.evaluate)

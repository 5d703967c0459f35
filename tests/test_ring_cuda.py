"""CUDA rings: IPC between unrelated processes on one GPU and across two GPUs, contents checked."""

import os
import subprocess
import sys

import pytest
import torch
from peers import ROOT, read_event

from common.ring import CudaRing, HostRing, RingMemoryError
from common.sockets import ipc_endpoint


def _start(role, env, *args):
    return subprocess.Popen(
        [sys.executable, "-m", "launch.tools.demo", role, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _pair(short_tmp, producer_env, consumer_env, copy_to, count=300):
    endpoint = ipc_endpoint(short_tmp / "p.ipc")
    common = ["--endpoint", endpoint, "--count", str(count), "--slots", "4", "--slot-bytes", str(1 << 20)]
    producer = _start("producer", producer_env, *common, "--backend", "cuda")
    read_event(producer, "ready")
    consumer = _start("consumer", consumer_env, *common, "--copy-to", copy_to)
    connected = read_event(consumer, "connected")
    summary = read_event(consumer, "done")
    consumer.wait(timeout=60)
    read_event(producer, "done")
    producer.wait(timeout=60)
    return connected, summary, consumer


@pytest.mark.gpu
def test_cuda_ipc_same_gpu_between_unrelated_processes(short_tmp):
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    connected, summary, consumer = _pair(short_tmp, env, env, "cuda:0")
    assert consumer.returncode == 0
    assert connected["slot_device"] == "cuda:0"
    assert summary["bad"] == 0 and sorted(summary["indices"]) == list(range(300))


@pytest.mark.multigpu
def test_cuda_ipc_across_gpus_with_different_visible_devices(short_tmp):
    # The producer's GPU 0 is the consumer's cuda:1; the consumer finds it by UUID and copies
    # every batch to its own cuda:0 (physical GPU 1) over the peer link before checking it.
    connected, summary, consumer = _pair(
        short_tmp, {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1,0"}, "cuda:0"
    )
    assert consumer.returncode == 0
    assert connected["slot_device"] == "cuda:1"
    assert summary["bad"] == 0 and sorted(summary["indices"]) == list(range(300))


@pytest.mark.multigpu
def test_cuda_ring_on_an_invisible_gpu_is_a_clear_error(short_tmp):
    endpoint = ipc_endpoint(short_tmp / "p.ipc")
    producer = _start(
        "producer", {"CUDA_VISIBLE_DEVICES": "0"}, "--endpoint", endpoint, "--count", "0", "--backend", "cuda"
    )
    read_event(producer, "ready")
    consumer = _start(
        "consumer", {"CUDA_VISIBLE_DEVICES": "1"}, "--endpoint", endpoint, "--count", "1", "--timeout", "20"
    )
    _, err = consumer.communicate(timeout=60)
    producer.terminate()
    producer.wait(timeout=30)
    assert consumer.returncode != 0
    assert "cannot see" in err and "ring.backend=host" in err


@pytest.mark.gpu
def test_cuda_ring_too_large_names_the_bytes_needed():
    free, _ = torch.cuda.mem_get_info(0)
    size = free + (1 << 30)
    with pytest.raises(RingMemoryError, match=f"needs {size} bytes"):
        CudaRing.create(0, 1, size)


@pytest.mark.gpu
def test_host_ring_is_page_locked_when_cuda_is_present():
    ring = HostRing.create("t", "pin", 2, 1 << 20)
    try:
        assert ring.pinned
        src = ring.slot(1)
        src.copy_(torch.arange(src.numel(), dtype=torch.int32).to(torch.uint8))
        assert torch.equal(src.to("cuda:0", non_blocking=True).cpu(), src)
    finally:
        ring.close()

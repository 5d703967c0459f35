"""The ``[launch]`` section: the processes the launcher starts and where they run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from .base import require


@dataclass
class LaunchConfig:
    """Which processes run where."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "num_producers": "launcher producer",
        "producer_devices": "launcher producer",
        "trainer_devices": "launcher trainer",
        "restart_backoff_s": "launcher",
        "max_restarts": "launcher",
        "standby_trainer_after_s": "launcher",
        "preload": "launcher",
        "ready_timeout_s": "launcher trainer",
        "mps": "launcher producer",
        "mps_producer_sm_percent": "launcher producer",
        "mps_trainer_sm_percent": "launcher trainer",
        "remote_producers": "launcher producer trainer",
    }

    num_producers: int = 2
    """Producers (one target each) the launcher starts on this host. With producer_devices set, one
    per listed device. 0 only with remote_producers (all targets on other hosts)."""
    producer_devices: list[str] = field(default_factory=list)
    """Devices of the producers, one entry each, e.g. ["cuda:0"]; empty: num_producers on cpu (or cuda:0
    when present). An entry naming several devices, comma-separated, is one producer whose target is
    sharded over them (tensor parallel, under torchrun): ["cuda:0,cuda:1", "cuda:2,cuda:3"] is two
    producers on two GPUs each, ["cpu,cpu"] one on two CPU processes. The number of devices must divide
    the target's attention and key/value heads, and a GPU of such an entry is in no other entry."""
    trainer_devices: list[str] = field(default_factory=list)
    """Devices of the trainer ranks; several: torchrun with one rank each."""
    restart_backoff_s: float = 2.0
    """First wait before restarting a crashed process; doubles per crash, reset after a minute up."""
    max_restarts: int = 10
    """Restarts of one process before the launcher gives up on the run."""
    standby_trainer_after_s: float = 30.0
    """Seconds a single-process trainer trains before the launcher starts a standby trainer beside it (imported
    and waiting, it makes restart-trainer take seconds); negative: never."""
    preload: bool = True
    """Start the producers and trainers that run on the CPU (without MPS) by forking one interpreter that has torch
    and transformers imported (launch/preload.py), not a fresh Python each: a start then costs a fraction of a
    second of CPU instead of about 3.5 s of imports. A group of ranks on the CPU is forked too, its leader doing
    what torchrun --standalone does. Processes on a GPU always start as fresh interpreters (under torchrun where
    they are several ranks)."""
    ready_timeout_s: float = 600.0
    """How long the launcher waits for a producer to load its target and report ready."""
    mps: bool = False
    """Run the run's processes as clients of a CUDA MPS daemon of the run's own (started and stopped by
    the launcher; needs nvidia-cuda-mps-control on PATH). Where a producer and trainer ranks share a
    GPU their kernels then run side by side; without MPS the GPU time-slices between the processes.
    See docs/operations.md "Placement: who shares which GPU"."""
    mps_producer_sm_percent: int | None = None
    """Under launch.mps: the share of a GPU's SMs (1-100) that a producer may use where it shares a GPU
    with a trainer rank (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of its processes). It reserves the rest for
    the trainer's step, so that a DDP rank is not slowed by the forward beside it. Size it from the
    stages alone: both run at the same rate when the producer has trainer / (producer + trainer)
    samples/s of the GPU (6.3 / (13.2 + 6.3): 32% for the Qwen3-8B shapes on an H200), if their
    speed scales with SMs. The cap is fixed when the producer starts and holds during the trainer's
    pauses too, so a capped producer refills ring.headroom_slots more slowly. None: no limit."""
    mps_trainer_sm_percent: int | None = None
    """Under launch.mps: the share of a GPU's SMs (1-100) that trainer ranks may use where they share a GPU
    with a producer (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the trainer's processes). The rest is never taken
    by the step's long matmuls, so the producer's kernels start at once: its forwards and, on producer 0,
    the evaluation's short drafting kernels, which beside an uncapped step wait for SMs at every launch
    (an evaluation of 0.8 s alone took 14 s beside the Qwen3-8B draft's step). The cap holds while the
    producer is idle too. None: no limit."""
    remote_producers: list[str] = field(default_factory=list)
    """Producers on other hosts, as ``tcp://host:port`` endpoints the trainer connects to (CURVE with
    the run's secrets/curve.json). Their producer ids follow the local ones: the k-th is
    ``local_producers + k``, started on its host with ``python -m producer.server --run-dir DIR
    --producer-id ID --listen tcp://0.0.0.0:PORT`` (DIR there holds copies of config.toml and
    secrets/curve.json). The data is sharded over local and remote producers; they ship the payload
    as ZeroMQ frames from a host ring (ring.backend auto means host for them)."""

    def __post_init__(self) -> None:
        require(self.num_producers >= 0, "num_producers", "must be >= 0")
        require(
            self.local_producers + len(self.remote_producers) >= 1,
            "num_producers",
            "must be >= 1 unless launch.remote_producers lists producers on other hosts",
        )
        for key in ("mps_producer_sm_percent", "mps_trainer_sm_percent"):
            percent = getattr(self, key)
            if percent is not None:
                require(self.mps, key, "needs launch.mps = true (it is an MPS client setting)")
                require(1 <= percent <= 100, key, f"must be in 1..100, got {percent}")
        for index, endpoint in enumerate(self.remote_producers):
            require(
                _is_tcp_connect_endpoint(endpoint),
                f"remote_producers[{index}]",
                f"must look like tcp://host:port with a host to connect to and a port in 1..65535, got {endpoint!r}",
            )
        require(
            len(set(self.remote_producers)) == len(self.remote_producers), "remote_producers", "lists an endpoint twice"
        )
        _check_producer_devices(self.producer_devices)
        require(self.restart_backoff_s >= 0, "restart_backoff_s", "must be >= 0")
        require(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        require(self.ready_timeout_s > 0, "ready_timeout_s", "must be > 0")

    @property
    def local_producers(self) -> int:
        """Producers the launcher starts on this host (ids 0 .. local_producers - 1)."""
        return len(self.producer_devices) or self.num_producers

    @property
    def total_producers(self) -> int:
        """Every producer of the run, local and remote: the number of data shards."""
        return self.local_producers + len(self.remote_producers)

    def remote_producer_ids(self) -> dict[int, str]:
        """Producer id -> endpoint of each remote producer."""
        return {self.local_producers + k: endpoint for k, endpoint in enumerate(self.remote_producers)}


def _is_tcp_connect_endpoint(endpoint: str) -> bool:
    """``tcp://host:port`` with a host one can connect to (not a wildcard) and a valid port."""
    match = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", endpoint)
    return match is not None and match.group(1) not in ("*", "0.0.0.0", "[::]") and 1 <= int(match.group(2)) <= 65535


def _check_producer_devices(entries: list[str]) -> None:
    """launch.producer_devices: each entry one device (auto, cpu, cuda, cuda:N) or a tensor-parallel group
    (cpu only, or distinct cuda:N), and no GPU of a group in another entry: the ranks of a group wait for
    each other at every layer, so a GPU shared with another producer slows all of them."""
    group_of_gpu: dict[str, int] = {}
    for index, entry in enumerate(entries):
        key, devices = f"producer_devices[{index}]", [part.strip() for part in entry.split(",")]
        if len(devices) == 1:
            require(
                re.fullmatch(r"auto|cpu|cuda(:\d+)?", devices[0]) is not None,
                key,
                f"must be auto, cpu, cuda or cuda:N (several, comma-separated, for tensor parallel), got {entry!r}",
            )
            continue
        if all(device == "cpu" for device in devices):
            continue
        require(
            "cpu" not in devices,
            key,
            f"mixes cpu and GPUs in {entry!r}: a tensor-parallel producer runs on one kind of device",
        )
        for device in devices:
            require(
                re.fullmatch(r"cuda:\d+", device) is not None,
                key,
                f"names {device!r}: each device of a tensor-parallel producer is cpu or cuda:N",
            )
        require(
            len(set(devices)) == len(devices),
            key,
            f"names a GPU twice in {entry!r}: each rank of a tensor-parallel producer needs its own",
        )
        group_of_gpu.update(dict.fromkeys(devices, index))
    for index, entry in enumerate(entries):
        for device in entry.split(","):
            gpu = "cuda:0" if device.strip() == "cuda" else device.strip()
            group = group_of_gpu.get(gpu, index)
            require(
                group == index,
                f"producer_devices[{index}]",
                f"{gpu} is also in launch.producer_devices[{group}], a tensor-parallel producer: its ranks wait for each other "
                "at every layer, so a GPU it shares slows all of them",
            )

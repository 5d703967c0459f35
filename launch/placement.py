"""Where a run's children compute, and what that adds to their environment: the devices its config gives the
producers and the trainer, the torch threads of those on the CPU, the run's MPS daemon (``launch.mps``) and its
limits on a shared GPU, and the preloader that forks the CPU's children (``launch.preload``). The producers' pool
and the trainer's slot (launch/producer_pool.py, launch/trainer_slot.py) build their processes on it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from common.config import RunConfig
from launch.mps import MpsDaemon
from launch.preload_client import Preloader
from launch.processes import (
    child_environment,
    cpu_processes,
    cpu_threads,
    producer_devices,
    terminate_with_parent,
    thread_environment,
    trainer_devices,
)


def sm_cap(percent: int | None, shared_devices: set[str]) -> dict[str, str]:
    """The MPS client setting that caps a process at ``percent`` of a GPU's SMs, where it shares a GPU."""
    if percent is None or not any(d.startswith("cuda") for d in shared_devices):
        return {}
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}


class Placement:
    """The devices, CPU threads, MPS daemon and preloader of one run's children (see the module's docstring)."""

    def __init__(self, run_root: Path, logs: Path, cfg: RunConfig, has_cuda: Callable[[], bool]) -> None:
        self.has_cuda = functools.cache(has_cuda)  # asked at most once: detection imports torch (seconds)
        self.mps = MpsDaemon(run_root, logs) if cfg.launch.mps else None
        self.cpu_processes = cpu_processes(
            [*producer_devices(cfg, self.has_cuda), ",".join(trainer_devices(cfg, self.has_cuda))]
        )
        self.cpu_threads = cpu_threads(self.cpu_processes)
        """Torch threads of each child that computes on the CPU (None: the user's OMP_NUM_THREADS, or no such child)."""
        self.preloader: Preloader | None = None
        """Where children on the CPU are forked from (launch.preload), made at the first such start."""

    def producer_devices(self, cfg: RunConfig) -> list[str]:
        return producer_devices(cfg, self.has_cuda)

    def trainer_devices(self, cfg: RunConfig) -> list[str]:
        return trainer_devices(cfg, self.has_cuda)

    def for_producer(self, cfg: RunConfig, device: str) -> dict[str, str]:
        """What the producer on ``device`` (an entry of launch.producer_devices) adds to its environment: MPS, with
        launch.mps_producer_sm_percent where it shares a GPU with a trainer rank, and its CPU threads."""
        shared = set(device.split(",")) & set(self.trainer_devices(cfg))
        return {
            **self.mps_environment(),
            **sm_cap(cfg.launch.mps_producer_sm_percent, shared),
            **self.thread_environment(device.split(",")),
        }

    def for_trainer(self, cfg: RunConfig, devices: list[str]) -> dict[str, str]:
        """What a trainer on ``devices`` adds to its environment: MPS, with launch.mps_trainer_sm_percent where a rank
        shares a GPU with a producer, and its CPU threads."""
        producing = {d for entry in self.producer_devices(cfg) for d in entry.split(",")}
        return {
            **self.mps_environment(),
            **sm_cap(cfg.launch.mps_trainer_sm_percent, set(devices) & producing),
            **self.thread_environment(devices),
        }

    def mps_environment(self) -> dict[str, str]:
        """What makes a child a client of the run's MPS daemon (nothing without launch.mps)."""
        return self.mps.env if self.mps else {}

    def thread_environment(self, devices: list[str]) -> dict[str, str]:
        """The torch thread limit of a child on ``devices``, when it computes on the CPU."""
        return thread_environment(self.cpu_threads) if "cpu" in devices else {}

    def preloader_for(self, cfg: RunConfig, devices: list[str]) -> Preloader | None:
        """The preloader that starts a child on ``devices`` under launch.preload: children on the CPU alone, without
        MPS (launch/preload.py); None otherwise."""
        if not cfg.launch.preload or self.mps or any(d != "cpu" for d in devices):
            return None
        if self.preloader is None:
            self.preloader = Preloader(
                child_environment(self.thread_environment(["cpu"])), terminate_with_parent(os.getpid())
            )
        return self.preloader

    def start(self) -> None:
        """Start the MPS daemon, before any child (a client that starts first would not use it)."""
        if self.mps:
            self.mps.start()

    def close(self) -> None:
        """End the preloader and the MPS daemon, once every child has stopped."""
        if self.preloader:
            self.preloader.close()
        if self.mps:
            self.mps.quit()

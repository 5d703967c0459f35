"""A CUDA MPS control daemon of the run's own (``launch.mps``).

Processes that share a GPU without MPS take turns on it: the GPU time-slices between their contexts,
so a producer's forward and a trainer rank's step never overlap, and a rank that waits in an
all-reduce holds its turn (BENCHMARKS.md: 94% of the ideal on one shared GPU, 67% with two shared
DDP ranks). Under MPS their kernels share the GPU's SMs.

The daemon's pipe directory is named after the run, so runs and other users' daemons stay apart, and
it is short, because the daemon's unix socket lives in it. Every child of the launcher gets the
directory in its environment and so connects to this daemon. A daemon left behind by a launcher
killed with -9 is told to quit before a new one starts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.config import ConfigError

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"


class MpsDaemon:
    """Starts and stops ``nvidia-cuda-mps-control -d`` with the run's pipe and log directories."""

    def __init__(self, run_root: Path, logs: Path) -> None:
        binary = shutil.which(MPS_CONTROL)
        if binary is None:
            raise ConfigError(
                f"launch.mps: {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities); "
                "install it or set launch.mps = false"
            )
        self.binary = binary
        key = hashlib.sha1(str(run_root.resolve()).encode()).hexdigest()[:12]
        self.pipe = Path(tempfile.gettempdir()) / f"dflash-mps-{key}"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs / "mps")}

    def start(self) -> None:
        self.quit()  # one left by a launcher killed with -9 would serve this pipe
        for directory in self.env.values():
            Path(directory).mkdir(parents=True, exist_ok=True)
        subprocess.run([self.binary, "-d"], env={**os.environ, **self.env}, check=True, timeout=30)
        log.info("started the MPS control daemon (pipe %s)", self.pipe)

    def quit(self) -> None:
        """Tell this run's daemon to quit, if one is listening; it ends its server after the last client."""
        if not (self.pipe / "control").exists():
            return
        subprocess.run(
            [self.binary],
            input="quit\n",
            text=True,
            env={**os.environ, **self.env},
            timeout=30,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        log.info("asked the MPS control daemon (pipe %s) to quit", self.pipe)

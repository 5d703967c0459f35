"""What the peers benchmark's orchestrator and each peer share: the rows they train on, the features they read, the
drafter shape they train, the budget they train to, and what a peer's run returns.

A peer (``specforge.py``, ``speculators.py``) is given the same ``TrainingRow``s as every other row of the table (our
chat renderer's tokens and loss masks), a ``FeatureCapture`` that runs the target over them as fast as our producer
does, and a ``DraftShape`` (draft configs written by our exporter); it dumps the features in its own on-disk format,
runs its own trainer unmodified as a subprocess, and returns a ``PeerRun`` whose ``export`` our evaluator loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from common.drafter.draft_config import DraftConfig

REPO = Path(__file__).resolve().parents[3]
PEERS_DIR = REPO / ".peers"
"""The ignored folder at the repository's root that ``launch/setup_peers.sh`` installs the peers' wheels into (never
.venv): a peer's trainer runs with it first on PYTHONPATH."""


def peer_env(**extra: str) -> dict[str, str]:
    """The environment of a peer's trainer: ours, with .peers/ first on PYTHONPATH, and ``extra``."""
    path = os.pathsep.join(p for p in (str(PEERS_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


@dataclass(frozen=True)
class TrainingRow:
    """One training record, rendered by our chat renderer exactly as our trainer sees it (truncated to
    data.max_seq_len, as our producer does)."""

    input_ids: list[int]
    loss_mask: list[int]
    """1 where the drafter is supervised (the assistant's tokens)."""

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask) or not self.input_ids:
            raise ValueError(
                f"a row needs as many loss-mask entries as tokens (>0): {len(self.input_ids)} tokens, "
                f"{len(self.loss_mask)} mask entries"
            )


class FeatureCapture(Protocol):
    """Runs the target over ``rows`` (packed in batches as our producer packs them, its kernels and precision) and
    yields ``(row_index, features)`` for every row, in an order of its own: ``features`` is ``[len(row), len(layers),
    H]`` bf16 on the CPU, entry j the output of decoder layer ``layers[j]`` (HF ``hidden_states[k + 1]``); layer
    ``L - 1`` is the last layer's output BEFORE the final norm (speculators' extra last entry)."""

    def __call__(self, rows: Sequence[TrainingRow], layers: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]: ...


@dataclass(frozen=True)
class DraftShape:
    """The preset's drafter, for a peer to train the same shape."""

    config: DraftConfig
    """The preset's drafter on this target (trainer/build.py ``draft_config_for``): layers, block size, target layers,
    mask token."""
    zlab_dir: Path
    """A folder with config.json (+ model.safetensors) of an untrained drafter of that shape in the z-lab format, as
    our exporter writes it (SpecForge's ``--draft-config``)."""
    speculators_dir: Path
    """The same drafter in the speculators format (speculators' ``--from-pretrained`` / draft config)."""
    target_dir: Path
    """The target as a Hugging Face folder (config.json, weights, tokenizer): the dequantized GGUF."""
    num_target_layers: int
    """L: the target's decoder layers (layer L - 1's output before the norm is speculators' last entry)."""

    @property
    def target_layer_ids(self) -> list[int]:
        """The decoder layers k whose outputs the drafter reads (z-lab numbering; speculators' is k + 1)."""
        return list(self.config.target_layer_ids)


@dataclass(frozen=True)
class Budget:
    """How long a peer trains: ``seconds`` of wall clock covering its dump and its training (equal GPU minutes),
    or ``samples``, the first that many rows for one epoch (equal data). Exactly one is set."""

    seconds: float | None = None
    samples: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.samples is None):
            raise ValueError(f"a budget is seconds or samples, exactly one: {self}")
        if (self.seconds is not None and self.seconds <= 0) or (self.samples is not None and self.samples <= 0):
            raise ValueError(f"a budget must be > 0: {self}")

    @property
    def equal_data(self) -> bool:
        return self.samples is not None

    def train_seconds_left(self, dump_s: float) -> float | None:
        """Seconds left to train once the dump took ``dump_s`` (None at equal data: one epoch, however long)."""
        return None if self.seconds is None else max(0.0, self.seconds - dump_s)


@dataclass(frozen=True)
class PeerJob:
    """What the orchestrator asks of a peer for one view."""

    work: Path
    """The peer's folder: its features, checkpoints and export."""
    rows: Sequence[TrainingRow]
    """The rows it trains on, in order."""
    capture: FeatureCapture
    """The target's features of a row, as the peer's format wants them."""
    draft: DraftShape
    """The draft's shape, the same as ours."""
    budget: Budget
    """Seconds or samples: how long it trains."""
    log: Path
    """Where its output goes."""


@dataclass(frozen=True)
class PeerRun:
    """What a peer's ``run`` returns to the orchestrator."""

    export: Path
    """A folder ``launch/run_all.sh evaluate --checkpoint`` (launch.evaluate) loads as it is."""
    dump_s: float
    """Seconds of the feature dump (the target's forwards and the writes), part of the peer's GPU minutes."""
    train_s: float
    """Seconds of the peer's trainer, from its start to its last save inside the budget."""
    tokens_trained: int
    """Tokens of the rows its saved model trained on (every epoch counted)."""
    samples_trained: int
    """Rows its saved model trained on (every epoch counted)."""
    peak_gpu_bytes: int | None
    """The card's peak memory in use during the dump and the training, over what was in use before (None on CPU)."""
    disk_bytes: int
    """Bytes of the dumped features on disk."""
    steps: int
    """Optimizer steps of the saved model."""


class Peer(Protocol):
    """A peer trainer, run unmodified from ``.peers/``."""

    name: str

    def missing(self) -> str | None:
        """None when the peer imports from .peers/, else ONE line saying how to set it up."""
        ...

    def run(self, job: PeerJob) -> PeerRun:
        """Do ``job``: dump its rows' features, train on them to its budget, export."""
        ...


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


class PeakGpuMemory:
    """The card's peak memory in use while the ``with`` block runs, over what was in use when it began: polled from
    ``nvidia-smi`` (it sees a peer's trainer, a process of its own, as well as this one) every ``every_s``.
    ``peak_bytes`` is None where there is no nvidia-smi (the CPU)."""

    def __init__(self, device_index: int = 0, every_s: float = 0.2) -> None:
        self.device_index, self.every_s = device_index, every_s
        self.peak_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int | None:
        query = ["nvidia-smi", f"--id={self.device_index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return int(done.stdout.split()[0]) * 2**20 if done.returncode == 0 and done.stdout.strip() else None

    def __enter__(self) -> PeakGpuMemory:
        if shutil.which("nvidia-smi") is None or (base := self._used()) is None:
            return self
        self.peak_bytes = 0

        def poll() -> None:
            while not self._stop.wait(self.every_s):
                used = self._used()
                if used is not None:
                    self.peak_bytes = max(self.peak_bytes or 0, used - base)

        self._thread = threading.Thread(target=poll, name="peak-gpu-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def run_to_deadline(
    command: list[str], log: Path, env: dict[str, str], deadline: float | None
) -> tuple[int | None, float]:
    """Run ``command`` (output appended to ``log``) until it ends or ``time.monotonic()`` passes ``deadline``, when it
    is terminated (then killed after 30 s). (its exit code, or None when stopped at the deadline; its seconds)."""
    started = time.monotonic()
    with open(log, "a") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            code = child.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            code = None
    return code, time.monotonic() - started

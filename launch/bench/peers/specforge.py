"""SpecForge 0.2.0's own trainer (``specforge train``, offline mode) on features our code dumps, run unmodified.

The dump: one ``NNNNNNNN.ckpt`` per row (``torch.save`` of ``input_ids`` [seq], ``loss_mask`` [seq] and
``hidden_states`` [seq, n * H] bf16, the n target layers' outputs side by side: SpecForge's DFlash offline contract,
what its SGLang writer writes), written by a pool of threads while the target runs on. On the CPU (--smoke) the
features and ``model.torch_dtype`` are float32 instead: SpecForge's bf16 lm_head there took minutes a step.

Its recipe, the preset's where SpecForge has the option: the preset's drafter (8 layers, block 16, the same target
layers and mask token) through our exporter's z-lab config (``model.draft_model_config``); loss ``dpace``
(alpha 0.5, as ours); lr 1.2e-3, cosine, warmup 0.04; gradient clip 1.0; its own AdamW (it has no Muon);
``fsdp_sharding: NO_SHARD`` (one GPU). Its step is ``batch_size`` rows padded to the longest (ours packs
65,536 tokens): ``batch_size`` = the rows that hold 65,536 tokens at their mean length, and ``num_anchors`` (per row)
= 2,048 over those rows, so a step sees the preset's tokens and anchors on average.

The budget: SpecForge has no wall-clock limit and its cosine schedule needs a step horizon. So a probe run first
times its step on these features (``max_steps`` 30, a save every 10 steps; its time is not counted, as a user who
knows the step time from an earlier run); the run then gets ``max_steps`` = ``total_steps`` = the steps that fit the
time left after the dump, saves every ~15 s (``save_interval``, ``max_checkpoints`` 3), and is stopped at the
deadline if still running: its export is its last checkpoint saved inside the budget (by the file's time). At equal
data: one epoch (``num_epochs`` 1), the schedule over it, the checkpoint it saves at the end.

``specforge export --to hf`` then writes the z-lab folder our evaluator loads.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

from launch.bench.peers.common import (
    PEERS_DIR,
    DraftShape,
    FeatureCapture,
    PeakGpuMemory,
    PeerJob,
    PeerRun,
    TrainingRow,
    peer_env,
    run_to_deadline,
)

CLI = PEERS_DIR / "bin" / "specforge"
STATE_FILE = "training_state.pt"
"""What SpecForge writes last into a checkpoint folder (specforge/training/checkpoint.py)."""
RUN_ID = "specforge"
PROBE_STEPS, PROBE_SAVE = 30, 10
SAVE_EVERY_S = 15.0
STEP_MARGIN = 0.97
SMOKE_STEPS = 2
WRITERS = 8


def write_ckpt(path: Path, row: TrainingRow, features: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> int:
    """One row's offline features in SpecForge's format, in ``dtype``; its bytes. ``features`` is [seq, n, H]."""
    seq = len(row.input_ids)
    if features.shape[0] != seq:
        raise ValueError(f"{seq} tokens but features for {features.shape[0]}")
    torch.save(
        {
            "input_ids": torch.tensor(row.input_ids, dtype=torch.long),
            "loss_mask": torch.tensor(row.loss_mask, dtype=torch.long),
            # A copy of its own: torch.save writes a view's whole storage (here the batch's, hundreds of MB).
            "hidden_states": features.reshape(seq, -1).to(dtype, copy=True),
        },
        path,
    )
    return path.stat().st_size


def dump(
    folder: Path, rows: Sequence[TrainingRow], capture: FeatureCapture, layers: list[int], dtype: torch.dtype
) -> int:
    """Every row's features into ``folder`` in ``dtype`` (files named in row order); their bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    total, pending = 0, deque()
    with ThreadPoolExecutor(WRITERS) as writers:
        for index, features in capture(rows, layers):
            pending.append(writers.submit(write_ckpt, folder / f"{index:08d}.ckpt", rows[index], features, dtype))
            while len(pending) > 8 * WRITERS:  # a disk slower than the target holds back the capture, not the memory
                total += pending.popleft().result()
        return total + sum(f.result() for f in pending)


def step_shape(rows: Sequence[TrainingRow], token_budget: int, anchors: int) -> tuple[int, int]:
    """(batch_size, num_anchors per row): the rows that hold ``token_budget`` tokens at their mean length (at most
    all of them), and ``anchors`` spread over those rows."""
    mean = sum(len(r.input_ids) for r in rows) / len(rows)
    batch = max(1, min(len(rows), round(token_budget / mean)))
    return batch, max(1, round(anchors / batch))


def config(work: Path, draft: DraftShape, shape: tuple[int, int], max_len: int, cuda: bool) -> dict:
    """The run's YAML, less its length (``training_plan``)."""
    batch, anchors = shape
    return {
        "run_id": RUN_ID,
        "output_dir": str(work / "output"),
        "model": {
            "target_model_path": str(draft.target_dir),
            "draft_model_config": str(draft.zlab_dir),
            "mask_token_id": draft.config.mask_token_id,
            "torch_dtype": "bfloat16" if cuda else "float32",  # the features' dtype
        },
        "data": {
            "hidden_states_path": str(work / "features"),
            "max_length": max_len,
            **({} if cuda else {"dataloader_num_workers": 0}),
        },
        "training": {
            "strategy": "dflash",
            "batch_size": batch,
            "num_anchors": anchors,
            "fsdp_sharding": "NO_SHARD",
            "learning_rate": 1.2e-3,
            "lr_scheduler": "cosine",
            "warmup_ratio": 0.04,
            "max_grad_norm": 1.0,
            "loss_type": "dpace",
            "dpace_alpha": 0.5,
            "attention_backend": "flex_attention" if cuda else "sdpa",
            "log_interval": 10,
            "seed": 0,
        },
    }


def checkpoints(output: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint SpecForge saved, in step order."""
    found = []
    for folder in output.glob(f"{RUN_ID}-step*"):
        step = folder.name.removeprefix(f"{RUN_ID}-step")
        if step.isdigit() and (folder / STATE_FILE).is_file():
            found.append((int(step), folder))
    return sorted(found)


def saved_at(folder: Path) -> float:
    """When a checkpoint was complete, on the wall clock."""
    return (folder / STATE_FILE).stat().st_mtime


def training_plan(step_s: float, startup_s: float, seconds: float, rows: int, batch: int, save_every_s: float) -> dict:
    """The training section's length for ``seconds`` of wall clock: the steps that fit after ``startup_s`` at
    ``step_s`` a step (at least one; ``STEP_MARGIN`` of them, so that the last save lands inside the budget), as the
    schedule's horizon and the cap, enough epochs to reach them, and a save every ``save_every_s`` (at least four
    saves, so that a slower run than timed still has one inside the budget)."""
    steps = max(1, int(STEP_MARGIN * (seconds - startup_s) / step_s))
    per_epoch = max(1, rows // batch)
    return {
        "max_steps": steps,
        "total_steps": steps,
        "num_epochs": math.ceil(steps / per_epoch),
        "save_interval": max(1, min(round(save_every_s / step_s), steps // 4)),  # 4 saves at least
        "max_checkpoints": 3,
    }


class SpecForge:
    """The SpecForge peer (``launch.bench.peers.common.Peer``)."""

    name = "specforge"

    def __init__(self, token_budget: int = 65536, anchors: int = 2048, max_len: int = 1024, smoke: bool = False):
        self.token_budget, self.anchors, self.max_len, self.smoke = token_budget, anchors, max_len, smoke

    def missing(self) -> str | None:
        check = [sys.executable, str(CLI), "--help"]
        if CLI.is_file() and subprocess.run(check, env=peer_env(), capture_output=True).returncode == 0:
            return None
        return f"specforge: SpecForge 0.2.0 is not importable from {PEERS_DIR}: run launch/setup_peers.sh"

    def _train(self, work: Path, settings: dict, training: dict, log: Path, deadline: float | None) -> None:
        """One ``specforge train`` with ``training`` over ``settings``' training section."""
        run = {**settings, "training": {**settings["training"], **training}}
        path = work / f"specforge-{len(list(work.glob('specforge-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(run, sort_keys=False))
        with open(log, "a") as out:
            out.write(f"\n== specforge train --config {path}\n{path.read_text()}\n")
        code, _ = run_to_deadline([sys.executable, str(CLI), "train", "--config", str(path)], log, peer_env(), deadline)
        if code not in (0, None):
            sys.exit(f"specforge train failed with exit {code}; see {log}")

    def _probe(self, work: Path, settings: dict, log: Path) -> tuple[float, float]:
        """(seconds a step, seconds before the first step) of SpecForge on these features: a short run, timed by
        its checkpoints, then removed."""
        started = time.time()
        probe = {"max_steps": PROBE_STEPS, "num_epochs": 1000, "save_interval": PROBE_SAVE, "max_checkpoints": 0}
        self._train(work, {**settings, "output_dir": str(work / "probe")}, probe, log, None)
        saved = {step: saved_at(folder) for step, folder in checkpoints(work / "probe")}
        shutil.rmtree(work / "probe")
        step_s = (saved[PROBE_STEPS] - saved[PROBE_SAVE]) / (PROBE_STEPS - PROBE_SAVE)
        return step_s, max(0.0, saved[PROBE_SAVE] - started - PROBE_SAVE * step_s)

    def run(self, job: PeerJob) -> PeerRun:
        work, rows, capture, draft, budget, log = job.work, job.rows, job.capture, job.draft, job.budget, job.log
        cuda = torch.cuda.is_available() and not self.smoke
        work.mkdir(parents=True, exist_ok=True)
        shape = step_shape(rows, self.token_budget, self.anchors)
        settings = config(work, draft, shape, self.max_len, cuda)
        with PeakGpuMemory() as peak:
            started = time.monotonic()
            dtype = torch.bfloat16 if cuda else torch.float32  # bf16 matmuls crawl on a CPU
            disk = dump(work / "features", rows, capture, draft.target_layer_ids, dtype)
            dump_s = time.monotonic() - started
            if hasattr(capture, "close"):
                capture.close()  # the card to SpecForge alone
            deadline = deadline_wall = None
            training = {"num_epochs": 1}
            if self.smoke:
                training = {"max_steps": SMOKE_STEPS, "num_epochs": 1000}
            elif not budget.equal_data:
                step_s, startup_s = self._probe(work, settings, log)
                left = budget.train_seconds_left(dump_s)
                training = training_plan(step_s, startup_s, left, len(rows), shape[0], SAVE_EVERY_S)
                deadline_wall = time.time() + left
                deadline = time.monotonic() + left
            train_started = time.time()
            self._train(work, settings, training, log, deadline)
        saved = checkpoints(work / "output")
        if deadline is not None:
            saved = [(step, folder) for step, folder in saved if saved_at(folder) <= deadline_wall]
        if not saved:
            sys.exit(f"specforge saved no checkpoint inside its budget; see {log}")
        steps, checkpoint = saved[-1]
        train_s = saved_at(checkpoint) - train_started
        export = self.export(checkpoint, draft, work / "export", log)
        samples = steps * shape[0]
        mean = sum(len(r.input_ids) for r in rows) / len(rows)
        return PeerRun(export, dump_s, train_s, round(samples * mean), samples, peak.peak_bytes, disk, steps)

    def export(self, checkpoint: Path, draft: DraftShape, out: Path, log: Path) -> Path:
        """``specforge export --to hf`` of ``checkpoint`` into ``out`` (the z-lab format)."""
        command = [sys.executable, str(CLI), "export", "--to", "hf", "--checkpoint", str(checkpoint)]
        command += ["--draft-config", str(draft.zlab_dir / "config.json"), "--output-dir", str(out)]
        code, _ = run_to_deadline(command, log, peer_env(), None)
        if code != 0:
            sys.exit(f"specforge export failed with exit {code}; see {log}")
        return out

"""The ``[training]`` section: the trainer's loop, optimizer, schedule and checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import require

LabelMode = Literal["data", "target_hard", "target_soft"]


@dataclass
class TrainingConfig:
    """The optimisation: schedule, loss, checkpoints."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "lr": "trainer",
        "min_lr_ratio": "trainer",
        "warmup_ratio": "trainer",
        "weight_decay": "trainer",
        "grad_clip": "trainer",
        "max_steps": "trainer",
        "epochs": "trainer",
        "max_minutes": "trainer",
        "gamma": "trainer",
        "weighting": "trainer",
        "objective": "trainer",
        "optimizer": "trainer",
        "schedule": "trainer",
        "decay_ratio": "trainer",
        "feature_noise": "trainer",
        "checkpoint_every": "trainer",
        "keep_last": "trainer",
        "async_checkpoint": "trainer",
        "seed": "trainer",
        "device": "trainer",
        "compile": "trainer",
        "warm_start": "trainer",
        "parallelism": "trainer",
        "label_mode": "producer trainer launcher",
    }

    lr: float = 6e-4
    """Peak learning rate (of AdamW, and of Muon's matrices, whose updates are scaled to AdamW's size)."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """muon: Muon (momentum orthogonalised by Newton-Schulz) for the drafter's weight matrices, AdamW for norms
    and the rest (trainer/optim.py); not with parallelism fsdp, whose shards cannot be orthogonalised one by one.
    adamw: AdamW for every trained weight. auto: muon, or adamw with fsdp (launch/run_all.sh check prints which a
    config runs and why; the trainer logs the one it built and warns where auto falls back to adamw)."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the linear warmup: cosine, a cosine decay to ``min_lr_ratio`` over the remaining steps; wsd
    (warmup-stable-decay), the peak held until the last ``decay_ratio`` of the steps, then a linear decay."""
    decay_ratio: float = 0.2
    """wsd: fraction of the steps spent in the final decay."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end of the decay, as a fraction of lr."""
    warmup_ratio: float = 0.04
    """Fraction of the steps spent in linear warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW's, and Muon's on its matrices)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    max_steps: int = 0
    """Optimizer steps of the run; 0: as many as ``epochs`` of data take (estimated from the data size)."""
    epochs: int = 6
    """Epochs of data when max_steps is 0."""
    max_minutes: float = 0.0
    """Training time budget in minutes (0: none): the run ends when it is spent or at the last step, whichever comes
    first, and the learning-rate schedule is as far along as the larger of the steps and the clock, so a run the
    clock ends still warms up and decays. The clock runs from the end of each trainer's first step (compilation is
    not training) and checkpoints carry it over restarts; waits for data, checkpoints and evaluations count. Runs
    of different step costs trained to one budget compare at equal GPU time; since the schedule reads the clock,
    two such runs are not equal step for step."""
    label_mode: LabelMode = "data"
    """data: the data tokens; target_hard (argmax CE) / target_soft (KL): the target's distribution (needs its last hidden state)."""
    objective: Literal["ce", "lk", "lk_hybrid"] = "ce"
    """Per-position loss: ce, cross-entropy against the label; lk, the LK loss (arXiv 2602.23881: one minus
    the drafter's probability of being accepted at that position); lk_hybrid, the two mixed."""
    weighting: Literal["decay", "streak", "dpace"] = "dpace"
    """Weight of block position k: decay, exp(-(k-1)/gamma); streak, the drafter's detached probability of
    reaching k; dpace, D-PACE (arXiv 2605.18810)."""
    gamma: float | None = None
    """Decay of the per-position loss weight exp(-(k-1)/gamma); None: 7 for B=16, 5 for B=10, 4 for B=8
    (docs/dflash.md)."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target features at step 0, cosine-annealed to 0 (0: off)."""
    checkpoint_every: int = 500
    """Save a checkpoint every this many steps (and always at the last step and on SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: training stands still only while the state is copied to
    host memory (page-locked buffers as large as the weights and optimizer state, kept between
    checkpoints). The last checkpoint, and the one on a stop, are always waited for. The drafter
    exported for an evaluation is written the same way. Off: every checkpoint and export is written
    before the next step."""
    seed: int = 0
    """Seed of the drafter's initialisation and of anchor sampling."""
    device: str = "auto"
    """Trainer device; auto: cuda when available, else cpu (torchrun: cuda:LOCAL_RANK)."""
    compile: bool | None = None
    """torch.compile the draft layers; None: on CUDA only."""
    warm_start: bool = True
    """A single-process trainer that will take over on restart-trainer (the launcher's standby, or the
    trainer started for the restart) builds the head, the drafter and a step's compiled kernels while the
    old one still trains, so the takeover is a copy of the state and the next step (trainer/warm.py).
    It holds the head and the drafter's weights on the trainer's device meanwhile (6.6 GB for a
    Qwen3-8B draft); false: it only imports ahead."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """How several trainer ranks share the drafter. ddp: every rank holds all of it (weights,
    gradients, optimizer state) and gradients are all-reduced. fsdp (FSDP2): every rank holds
    1/ranks of each, and a layer's weights are gathered only for its forward and backward; for
    drafts whose training state does not fit one device. One rank: the same. Checkpoints are the
    same either way, so a restart may switch it or change the number of ranks."""

    @property
    def resolved_optimizer(self) -> Literal["adamw", "muon"]:
        """The optimizer ``optimizer`` names, auto resolved."""
        if self.optimizer != "auto":
            return self.optimizer
        return "adamw" if self.parallelism == "fsdp" else "muon"

    @property
    def optimizer_reason(self) -> str:
        """The optimizer the trainer runs and why, in words for ``check`` (every run; the trainer logs which it built)."""
        rules = {
            "muon": "Muon for the drafter's weight matrices, AdamW for norms and the rest",
            "adamw": "AdamW for every trained weight",
        }
        used = self.resolved_optimizer
        if self.optimizer != "auto":
            why = f"training.optimizer = \"{self.optimizer}\""
        elif used == "adamw":
            why = "training.optimizer = \"auto\" under training.parallelism = \"fsdp\": Muon is not sharded here"
        else:
            why = (
                f"training.optimizer = \"auto\" with training.parallelism = \"{self.parallelism}\", the default recipe"
            )
        return f"{used} ({rules[used]}): {why}"

    @property
    def labels_from_target(self) -> bool:
        """The labels are the target's (target_hard, target_soft): the producers ship its last hidden state."""
        return self.label_mode != "data"

    @property
    def optimizer_fallback(self) -> str | None:
        """Where ``auto`` trains another recipe than the default's, in words for the log and ``check`` (None: it
        does not)."""
        if self.optimizer != "auto" or self.parallelism != "fsdp":
            return None
        return (
            "training.optimizer auto trains with AdamW under training.parallelism = fsdp (Muon is not sharded here), "
            "not the default recipe's Muon: set training.optimizer = \"adamw\" to say so, or parallelism = \"ddp\" "
            "to keep Muon"
        )

    def __post_init__(self) -> None:
        require(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be > 0, got {self.lr}")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.grad_clip >= 0, "grad_clip", "must be >= 0")
        require(self.max_steps >= 0, "max_steps", "must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.max_minutes >= 0 and math.isfinite(self.max_minutes), "max_minutes", "must be >= 0")
        require(
            self.label_mode in ("data", "target_hard", "target_soft"),
            "label_mode",
            f"must be data, target_hard or target_soft, got {self.label_mode!r}",
        )
        require(self.gamma is None or self.gamma > 0, "gamma", "must be > 0")
        require(
            self.optimizer in ("auto", "adamw", "muon"),
            "optimizer",
            f"must be auto, adamw or muon, got {self.optimizer!r}",
        )
        require(self.schedule in ("cosine", "wsd"), "schedule", f"must be cosine or wsd, got {self.schedule!r}")
        require(0 < self.decay_ratio <= 1, "decay_ratio", "must be in (0, 1]")
        require(
            self.objective in ("ce", "lk", "lk_hybrid"),
            "objective",
            f"must be ce, lk or lk_hybrid, got {self.objective!r}",
        )
        require(
            self.weighting in ("decay", "streak", "dpace"),
            "weighting",
            f"must be decay, streak or dpace, got {self.weighting!r}",
        )
        require(
            not (self.optimizer == "muon" and self.parallelism == "fsdp"),
            "optimizer",
            "muon needs whole weight matrices; use parallelism = \"ddp\" with it",
        )
        require(self.feature_noise >= 0, "feature_noise", "must be >= 0")
        require(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        require(self.keep_last >= 1, "keep_last", "must be >= 1")
        require(self.parallelism in ("ddp", "fsdp"), "parallelism", f"must be ddp or fsdp, got {self.parallelism!r}")

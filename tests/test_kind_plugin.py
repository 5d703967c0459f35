"""A fifth drafter kind, defined in this file alone, trains, evaluates and exports through the normal commands.

The kind ("toy": the DFlash drafter with a learned scale on its hidden states before the head, and one option of its
own) is what any kind is: its options, its head on the DFlash backbone (common/drafter/head.py) and its line of the
kinds table. It is named in DFLASH_DRAFTER_KINDS, the way a kind from outside the repository is loaded by every
process of a run. Nothing else in the repository knows it: the config reads its ``[drafter.toy]`` table, the trainer logs its
metric, producer 0 evaluates its proposals, and export writes its architecture and option.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from common.drafter.head import KindHead, ObjectiveInput, ProposalInput, walk_slots
from common.drafter.kind import DrafterKind, KindOptions
from common.drafter.loss import draft_loss
from common.drafter.sampling import Proposal

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ToyOptions(KindOptions):
    """The toy kind's one option (``[drafter.toy]``)."""

    READ_BY: ClassVar[dict[str, str]] = {"initial_scale": "checkpoint"}

    initial_scale: float = 1.0
    """The scale on the draft hidden states at initialisation."""


class Scale(nn.Module):
    """One learned number."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))


class ToyHead(KindHead):
    """DFlash, with its hidden states scaled by one learned number before the target's head."""

    title = "toy"
    logged_metrics = ("toy/scale",)
    state_names = ("scale",)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.scale = Scale()

    def parts(self):
        return {"scale": self.scale}

    def reset(self, drafter, std=0.02):
        with torch.no_grad():
            self.scale.weight.fill_(self.config.options.initial_scale)

    def objective(self, slots: ObjectiveInput):
        scaled = slots.hidden * self.scale.weight
        head_weight = slots.target_head.lm_head_weight
        loss, metrics = draft_loss(scaled, slots.blocks, head_weight, slots.loss_config, slots.target_hidden)
        metrics["toy/scale"] = self.scale.weight.detach()
        return loss, metrics

    def propose(self, walk: ProposalInput):
        scores = walk.logits * self.scale.weight  # the logits of the scaled hidden states
        tokens, probs = walk_slots(lambda slot, _: scores[:, slot], scores.shape[1], walk, over_vocabulary=True)
        return Proposal(tokens=tokens, probs=probs)


KIND = DrafterKind(
    name="toy",
    options=ToyOptions,
    head="tests.test_kind_plugin:ToyHead",
    zlab_architecture="ToyDraftModel",
    speculators_architecture="ToySpeculator",
    step_memory_factor=1.0,
    summary="a test's kind",
    warm_starts_from=("dflash",),
)


def test_a_kind_from_one_file_trains_evaluates_and_exports(short_tmp):
    from tests.test_pipeline import ONE_PRODUCER, finish, start

    env = {**os.environ, "DFLASH_DRAFTER_KINDS": "tests.test_kind_plugin"}
    run_dir = short_tmp / "run"
    overrides = ('drafter.kind="toy"', "drafter.toy.initial_scale=0.5", "training.max_steps=8", "eval.every_steps=8")
    finish(start(run_dir, *ONE_PRODUCER, *overrides, "eval.num_prompts=2", "eval.max_new_tokens=8", env=env), run_dir)

    assert "[drafter.toy]\ninitial_scale = 0.5" in (run_dir / "config.toml").read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scales = [m["toy/scale"] for m in metrics if "toy/scale" in m]
    assert scales and scales[-1] != 0.5  # logged by the trainer, and trained
    assert any("eval/tau" in m for m in metrics)  # producer 0 decoded with the toy's proposals
    status = json.loads((run_dir / "trainer.json").read_text())
    assert status["kind"] == "toy" and set(status["kind_metrics"]) == {"toy/scale"}

    checkpoint = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    export = short_tmp / "export"
    done = subprocess.run(
        [sys.executable, "-m", "trainer.export", "--checkpoint", str(checkpoint), "--out", str(export)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["ToyDraftModel"] and config["dflash_config"]["initial_scale"] == 0.5
    evaluated = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            "--checkpoint",
            str(checkpoint),
            "eval.num_prompts=2",
            "eval.max_new_tokens=8",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluated.returncode == 0 and "tau" in evaluated.stdout, evaluated.stdout + evaluated.stderr

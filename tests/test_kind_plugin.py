"""A fourth drafter kind, defined in this file alone, trains, evaluates and exports through the normal commands.

The kind ("toy": the DFlash drafter with a learned scale on its hidden states before the head, and one option of its
own) is named in DFLASH_DRAFTER_KINDS, the way a kind from outside the repository is loaded by every process of a
run. Nothing else in the repository knows it: the config reads its ``[drafter.toy]`` table, the trainer logs its
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

from common.drafter.kind import DrafterKind, KindOptions
from common.drafter.model import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ToyOptions(KindOptions):
    """The toy kind's one option (``[drafter.toy]``)."""

    READ_BY: ClassVar[dict[str, str]] = {"initial_scale": "checkpoint"}

    initial_scale: float = 1.0
    """The scale on the draft hidden states at initialisation."""


class ToyDrafter(DFlashDrafter):
    """DFlash, with its hidden states scaled by one learned number before the target's head."""

    kind = "toy"
    logged_metrics = ("toy/scale",)

    def __init__(self, config, target_head, loss_config=None, attention_backend=None) -> None:
        super().__init__(config, target_head, loss_config, attention_backend)
        self.scale = nn.Parameter(torch.tensor(float(config.options.initial_scale)))

    def objective(self, hidden, blocks, target_hidden=None, loss_config=None, context=None):
        loss, metrics = super().objective(hidden * self.scale, blocks, target_hidden, loss_config, context)
        metrics["toy/scale"] = self.scale.detach()
        return loss, metrics

    def propose(self, hidden, anchor_ids, sampling=None, generator=None, context=None):
        return super().propose(hidden * self.scale, anchor_ids, sampling, generator, context)

    def warm_start(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict({**state, "scale": state.get("scale", torch.tensor(1.0))}, strict=True)


KIND = DrafterKind(
    name="toy",
    options=ToyOptions,
    model="tests.test_kind_plugin:ToyDrafter",
    zlab_architecture="ToyDraftModel",
    speculators_type="toy",
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

"""speculators 0.9.0's own trainer (``speculators train``) on features our code dumps, run unmodified.

The data, by speculators' documented path for rows that are already tokenized: our rows go into a JSONL file of
``{"input_ids", "loss_mask"}`` records and ``speculators prepare-data`` turns them into its dataset folder (it passes
such rows through, truncated to ``--seq-length``, and shuffles them with ``--seed``). The prepared rows are read back
in their order (``datasets.load_from_disk``, in a process with .peers/ on its path) and their features dumped in
that order into its cache: ``DATA/hidden_states/hs_{i}.safetensors`` holding ``token_ids`` [seq] (int64) and
``hidden_states`` [seq, n + 1, H] (bf16), the preset's n target layers and then the last decoder layer's output
before the final norm, which speculators turns into the target's logits itself.

Its recipe, the preset's where speculators has the option:
- the preset's drafter: ``--from-pretrained`` a folder holding only the speculators ``config.json`` our exporter
  wrote (a config-only folder "initializes fresh draft weights from the saved speculator config": 8 layers, block
  16, the target layers as k + 1, the mask token are ours, the weights its own initialization);
- ``--total-seq-len`` = the preset's token budget (65,536: one packed sequence a step, as ours packs a step) and
  ``--max-anchors`` = its anchors (2,048 a step, as ours);
- ``--per-position-loss-weight dpace`` (alpha 0.5, as ours); its loss is its own (cross-entropy against the target's
  distribution; it has no option to train DFlash on the data's tokens);
- lr 1.2e-3 for AdamW and Muon alike (``--muon-lr`` defaults to ``--lr``), ``--scheduler-type cosine``,
  ``--scheduler-warmup-ratio 0.04``; its own Muon + AdamW (its default optimizer);
- ``--on-missing raise``: a row without features stops it instead of asking a vLLM server for them;
- ``--train-data-ratio`` must be below 1: it is set so that its validation split is exactly the last prepared row,
  which therefore trains with none of the budgets (``samples_trained`` counts only the rows it trained on).
- ``--loss-implementation eager``: its default fused loss (two autotuned Triton kernels) stops at the first step on
  a card under torch 2.11 (the torch SpecForge 0.2.0 pins): its forward is compiled, and dynamo, tracing the loss's
  backward, raises "ListVariable(length=21) is already tracked for mutation" on the second kernel's autotune
  configs, the same list as the first kernel's (``losses/fused.py`` decorates both with one ``triton.autotune``).
  Its eager cross-entropy is compiled with the forward, on the card as on the CPU.

The budget. speculators has no wall-clock limit and its schedule needs a step horizon (``--max-steps``, which is
also the cosine's length). So at equal GPU minutes a probe first times its step on these features (``PROBE_STEPS``
steps, ``--log-freq 1``: its per-step ``step_ms``; its time is not counted, as a user who knows the step time from
an earlier run); the run then gets ``--max-steps`` = the steps that fit the time left after the dump and ``--epochs``
= the epochs that hold them (counted with its own batch sampler: with more epochs than that, every epoch after the
cap would still train one step), and is stopped at the deadline if still running: its export is then its last
epoch-end checkpoint saved inside the budget. At equal data: ``--epochs 1``, the checkpoint it saves at the end.
The export is the checkpoint folder itself, ``SAVE/<epoch>/`` in the speculators format our evaluator loads.

On a machine without an accelerator (--smoke on this CPU), speculators' trainer moves the model and batches to
device index 0 (train/trainer.py:348, 533) and synchronizes the accelerator to time a step; none of its options nor
any torch setting makes index 0 the CPU. There its unmodified CLI runs under ``python -m
launch.bench.peers.speculators --on-cpu`` (torch, not speculators, is adapted: a bare device index means the CPU,
and the accelerator sync is a no-op), with these documented options of its own: ``--draft-attn-impl sdpa``
(flex attention is for GPUs), ``--hidden-states-dtype float32`` (its autocast is CUDA's, off on the CPU, so bf16
features would meet fp32 weights), ``--num-workers 0``, and, past the smoke's tiny drafter, ``--optimizer adamw``
(its Muon's bf16 Newton-Schulz takes minutes a step of the preset's drafter on a CPU).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.bench.peers.common import (
    PEERS_DIR,
    REPO,
    Budget,
    DraftShape,
    FeatureCapture,
    PeakGpuMemory,
    PeerJob,
    PeerRun,
    TrainingRow,
    peer_env,
    run_to_deadline,
)

SEED = 0
"""prepare-data's shuffle and the trainer's packing order (``--seed`` of both)."""
PROBE_STEPS = 30
PROBE_SKIP = 5
"""The probe's first steps, left out of its step time (compilation, the data loader filling up)."""
SMOKE_STEPS = 2
LOG_EVERY = 25
"""``--log-freq`` of a timed run: speculators synchronizes the card at every step it logs."""
PLAN_MARGIN = 0.98
"""The share of the time left that the plan fills: what the probe does not time (an epoch end's validation of
one row, the sampler's next packing) must fit the rest, or the deadline stops the run before its last save."""
WRITERS = 8


@dataclass(frozen=True)
class Layout:
    """The prepared dataset as speculators trains on it: its rows in its order, and the batches its sampler packs
    of the training split, epoch by epoch, as (rows, tokens) each."""

    rows: list[TrainingRow]
    epochs: list[list[tuple[int, int]]]
    ratio: float
    """``--train-data-ratio``: all rows but the last train (``validation_ratio``)."""

    def epochs_for(self, steps: int) -> int:
        """The fewest epochs whose batches hold ``steps`` steps (ValueError if the layout holds fewer)."""
        held = 0
        for count, batches in enumerate(self.epochs, 1):
            held += len(batches)
            if held >= steps:
                return count
        raise ValueError(f"{steps} steps need more than the {len(self.epochs)} epochs laid out ({held} steps)")

    def trained(self, steps: int) -> tuple[int, int]:
        """(rows, tokens) of the first ``steps`` batches, epochs one after the other."""
        batches = [batch for epoch in self.epochs for batch in epoch][:steps]
        return sum(rows for rows, _ in batches), sum(tokens for _, tokens in batches)


def validation_ratio(rows: int) -> float:
    """``--train-data-ratio`` whose validation split is exactly the last row: speculators cuts at
    ``int(rows * ratio)`` and refuses a ratio of 1."""
    if rows < 2:
        raise ValueError(f"speculators needs at least 2 rows (one is its validation split), got {rows}")
    return (rows - 0.5) / rows


def write_rows(path: Path, rows: Sequence[TrainingRow]) -> None:
    """The rows as speculator-format JSONL records, the input ``speculators prepare-data`` passes through."""
    with open(path, "w") as out:
        for row in rows:
            out.write(json.dumps({"input_ids": row.input_ids, "loss_mask": row.loss_mask}) + "\n")


def write_hidden_states(path: Path, row: TrainingRow, features: torch.Tensor) -> int:
    """One row's features in speculators' cache format; its bytes. ``features`` is [seq, n + 1, H], the last entry
    the last layer's output before the final norm."""
    from safetensors.torch import save_file

    seq = len(row.input_ids)
    if features.dim() != 3 or features.shape[0] != seq:
        raise ValueError(f"{seq} tokens but features of shape {tuple(features.shape)}")
    save_file(
        {
            "token_ids": torch.tensor(row.input_ids, dtype=torch.long),
            "hidden_states": features.to(torch.bfloat16).contiguous(),
        },
        str(path),
    )
    return path.stat().st_size


def dump(folder: Path, rows: Sequence[TrainingRow], capture: FeatureCapture, layers: list[int]) -> int:
    """Every row's features into ``folder`` as ``hs_{i}.safetensors``, i its index in ``rows``; their bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    total, pending = 0, deque()
    with ThreadPoolExecutor(WRITERS) as writers:
        for index, features in capture(rows, layers):
            pending.append(
                writers.submit(write_hidden_states, folder / f"hs_{index}.safetensors", rows[index], features)
            )
            while len(pending) > 8 * WRITERS:  # a disk slower than the target holds back the capture, not the memory
                total += pending.popleft().result()
        return total + sum(f.result() for f in pending)


def cli(*args: str) -> list[str]:
    """speculators' command line: its own CLI where torch has an accelerator, else under the CPU adaptation."""
    if torch.accelerator.is_available():
        return [sys.executable, "-m", "speculators", *args]
    return [sys.executable, "-m", "launch.bench.peers.speculators", "--on-cpu", *args]


def env() -> dict[str, str]:
    """The peers' environment, with this repository on the path too (for ``--on-cpu`` and ``--layout``). Rich pads
    every line of speculators' log to the console's width and wraps at spaces, never inside ``step_ms=VALUE``: 300
    columns keep its metric lines whole enough to read and its log small."""
    base = peer_env(COLUMNS="300")
    return {**base, "PYTHONPATH": f"{base['PYTHONPATH']}:{REPO}"}


def run_logged(command: list[str], log: Path) -> None:
    """Run ``command`` to its end, its output appended to ``log``; exit naming the log when it fails."""
    with open(log, "a") as out:
        out.write(f"\n== {' '.join(command)}\n")
    code, _ = run_to_deadline(command, log, env(), None)
    if code != 0:
        sys.exit(f"{' '.join(command[:4])} failed with exit {code}; see {log}")


def read_layout(data: Path, total_seq_len: int, steps: int, log: Path) -> Layout:
    """The prepared dataset's layout (``--layout`` in a process with .peers/ on its path): its rows, and its
    sampler's batches for epoch 0, or for as many epochs as hold ``steps``."""
    out = data.parent / "layout.json"
    command = [sys.executable, "-m", "launch.bench.peers.speculators", "--layout", str(data), str(out)]
    run_logged([*command, str(total_seq_len), str(steps)], log)
    layout = json.loads(out.read_text())
    out.unlink()
    rows = [TrainingRow(ids, mask) for ids, mask in layout["rows"]]
    epochs = [[(rows_in, tokens) for rows_in, tokens in epoch] for epoch in layout["epochs"]]
    return Layout(rows, epochs, validation_ratio(len(rows)))


def step_seconds(log_text: str) -> list[float]:
    """The seconds of every step speculators timed (its ``step_ms`` metric), in order."""
    return [float(ms) / 1000 for ms in re.findall(r"step_ms=([0-9.e+-]+)", log_text)]


def saved_checkpoints(save: Path) -> list[tuple[int, Path, float]]:
    """(steps, folder, when it was complete) of every epoch checkpoint speculators saved, in step order: its
    ``training_state.json`` is written last (train/trainer.py ``maybe_save_checkpoint``)."""
    found = []
    for state in save.glob("*/training_state.json"):
        if state.parent.name.isdigit():
            found.append((int(json.loads(state.read_text())["global_step"]), state.parent, state.stat().st_mtime))
    return sorted(found)


@dataclass(frozen=True)
class Probe:
    """speculators' timing on these features, from a short run."""

    step_s: float
    """Seconds a step (the median of its own step_ms, past the first steps)."""
    startup_s: float
    """Seconds of the run that are not steps: start, data, compilation, one epoch-end save."""
    save_s: float
    """Seconds of an epoch's end: its checkpoint, from the first file to the last, and the validation after it."""

    def steps_for(self, seconds: float, steps_per_epoch: int) -> int:
        """The steps that fit ``seconds`` (at least one): the start, the steps, and a save every
        ``steps_per_epoch`` steps after the first."""
        per_step = self.step_s + self.save_s / steps_per_epoch
        return max(1, int((seconds * PLAN_MARGIN - self.startup_s + self.save_s) / per_step))


class Speculators:
    """The speculators peer (``launch.bench.peers.common.Peer``)."""

    name = "speculators"

    def __init__(self, token_budget: int = 65536, anchors: int = 2048, max_len: int = 1024, smoke: bool = False):
        self.token_budget, self.anchors, self.max_len, self.smoke = token_budget, anchors, max_len, smoke

    def missing(self) -> str | None:
        check = [sys.executable, "-m", "speculators", "train", "--help"]
        if subprocess.run(check, env=env(), capture_output=True).returncode == 0:
            return None
        return f"speculators: speculators 0.9.0 is not importable from {PEERS_DIR}: run launch/setup_peers.sh"

    def prepare(self, work: Path, rows: Sequence[TrainingRow], draft: DraftShape, log: Path) -> tuple[Path, Layout]:
        """``speculators prepare-data`` of ``rows`` into ``work``/data, and the layout it made of them."""
        write_rows(work / "rows.jsonl", rows)
        data = work / "data"
        command = ["prepare-data", "--model", str(draft.target_dir), "--data", str(work / "rows.jsonl")]
        command += ["--output", str(data), "--seq-length", str(self.max_len), "--seed", str(SEED)]
        if self.smoke:
            command += ["--num-preprocessing-workers", "1"]
        run_logged(cli(*command), log)
        return data, read_layout(data, self.token_budget, SMOKE_STEPS if self.smoke else 0, log)

    def train_args(self, work: Path, target: Path, layout: Layout, epochs: int, steps: int | None) -> list[str]:
        """``speculators train``'s options for a run in ``work`` (see the module's docstring)."""
        args = ["train", "--speculator-type", "dflash", "--verifier-name-or-path", str(target)]
        args += ["--from-pretrained", str(work / "draft"), "--data-path", str(work / "data")]
        args += ["--save-path", str(work / "save")]
        args += ["--log-dir", str(work / "logs"), "--on-missing", "raise", "--seed", str(SEED)]
        args += ["--total-seq-len", str(self.token_budget), "--max-anchors", str(self.anchors)]
        args += [
            "--train-data-ratio",
            repr(layout.ratio),
            "--per-position-loss-weight",
            "dpace",
            "--dpace-alpha",
            "0.5",
        ]
        args += ["--optimizer", "muon", "--lr", "1.2e-3", "--scheduler-type", "cosine"]
        args += ["--scheduler-warmup-ratio", "0.04", "--epochs", str(epochs)]
        args += ["--log-freq", str(LOG_EVERY)] + (["--max-steps", str(steps)] if steps else [])
        args += ["--loss-implementation", "eager"]
        if not torch.accelerator.is_available():
            args += ["--draft-attn-impl", "sdpa", "--hidden-states-dtype", "float32", "--num-workers", "0"]
            if not self.smoke:
                # Its Muon orthogonalizes in bf16, which has no fast CPU kernel here: 468 s of a 557 s step of the
                # preset's drafter on two busy cores. The smoke's tiny drafter keeps it, as on a card.
                args[args.index("--optimizer") + 1] = "adamw"
        return args

    def _probe(self, work: Path, target: Path, layout: Layout, log: Path) -> Probe:
        """speculators on these features: a short run of epoch 0 saving into ``probe/``, timed by its own step_ms
        and its checkpoint's files, then removed."""
        steps = min(PROBE_STEPS, len(layout.epochs[0]))
        args = self.train_args(work, target, layout, 1, steps)
        args[args.index("--save-path") + 1] = str(work / "probe")
        args[args.index("--log-freq") + 1] = "1"
        logged = log.stat().st_size if log.exists() else 0
        started = time.monotonic()
        run_logged(cli(*args), log)
        wall = time.monotonic() - started
        with open(log) as text:
            text.seek(logged)
            times = step_seconds(text.read())
        if not times:
            sys.exit(f"speculators' probe printed no step_ms; see {log}")
        steady = sorted(times[PROBE_SKIP:] or times)
        step_s = steady[len(steady) // 2]
        # the save's files and its validation's val_metrics.json; train_command.txt is written when the run starts
        written = [p.stat().st_mtime for p in (work / "probe" / "0").iterdir() if p.suffix != ".txt"]
        save_s = max(written) - min(written)
        _rmtree(work / "probe")
        return Probe(step_s, max(0.0, wall - len(times) * step_s), save_s)

    def _plan(
        self, work: Path, target: Path, layout: Layout, budget: Budget, dump_s: float, log: Path
    ) -> tuple[Layout, int, int | None, float | None]:
        """(the layout laid out far enough, --epochs, --max-steps, the seconds it may train) for ``budget``."""
        if self.smoke:
            return layout, layout.epochs_for(SMOKE_STEPS), SMOKE_STEPS, None
        if budget.equal_data:
            return layout, 1, None, None
        probe = self._probe(work, target, layout, log)
        left = budget.train_seconds_left(dump_s)
        steps = probe.steps_for(left, len(layout.epochs[0]))
        with open(log, "a") as out:
            out.write(f"\n== probe: {probe}; {steps} steps in {left:.0f} s\n")
        layout = read_layout(work / "data", self.token_budget, steps, log)
        return layout, layout.epochs_for(steps), steps, left

    def run(self, job: PeerJob) -> PeerRun:
        work, rows, capture, draft, budget, log = job.work, job.rows, job.capture, job.draft, job.budget, job.log
        for stale in ("data", "save", "probe", "logs", "draft"):
            _rmtree(work / stale)  # prepare-data keeps an existing dataset and train resumes an existing save
        (work / "draft").mkdir(parents=True)
        (work / "draft" / "config.json").write_bytes((draft.speculators_dir / "config.json").read_bytes())
        layers = [*draft.target_layer_ids, draft.num_target_layers - 1]
        with PeakGpuMemory() as peak:
            started = time.monotonic()
            data, layout = self.prepare(work, rows, draft, log)
            dump(data / "hidden_states", layout.rows, capture, layers)
            dump_s = time.monotonic() - started
            if hasattr(capture, "close"):
                capture.close()  # the card to speculators alone
            layout, epochs, steps, left = self._plan(work, draft.target_dir, layout, budget, dump_s, log)
            deadline_wall = None if left is None else time.time() + left
            deadline = None if left is None else time.monotonic() + left
            args = self.train_args(work, draft.target_dir, layout, epochs, steps)
            with open(log, "a") as out:
                out.write(f"\n== speculators {' '.join(args)}\n")
            code, train_s = run_to_deadline(cli(*args), log, env(), deadline)
        if code not in (0, None):
            sys.exit(f"speculators train failed with exit {code}; see {log}")
        saved = saved_checkpoints(work / "save")
        if deadline_wall is not None:
            saved = [entry for entry in saved if entry[2] <= deadline_wall]
            train_s = min(train_s, left)
        if not saved:
            sys.exit(f"speculators saved no checkpoint inside its budget; see {log}")
        trained_steps, checkpoint, _ = saved[-1]
        samples, tokens = layout.trained(trained_steps)
        disk = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
        return PeerRun(checkpoint, dump_s, train_s, tokens, samples, peak.peak_bytes, disk, trained_steps)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _layout_main(data: str, out: str, total_seq_len: str, steps: str) -> None:
    """``--layout``: run where .peers/ is on the path. Reads the prepared dataset as speculators' trainer does and
    packs its training split with speculators' own sampler (train/dataloader.py ``_setup_dataloader``)."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    dataset = load_from_disk(data).with_format(None)
    rows = [[ids, mask] for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True)]
    lengths = list(dataset["seq_len"])[: int(len(dataset) * validation_ratio(len(dataset)))]  # train/data.py's cut
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=int(total_seq_len), lengths=lengths, num_replicas=1, rank=0, seed=SEED
    )
    epochs, held = [], 0
    while not epochs or held < int(steps):
        sampler.set_epoch(len(epochs))
        batches = [[len(batch), int(sum(lengths[i] for i in batch))] for batch in sampler]
        epochs.append(batches)
        held += len(batches)
    Path(out).write_text(json.dumps({"rows": rows, "epochs": epochs}))


def _on_cpu_main(argv: list[str]) -> None:
    """``--on-cpu``: speculators' own CLI where torch has no accelerator: a bare device index (its local rank) means
    the CPU, and synchronizing the accelerator does nothing."""
    module_to, tensor_to = torch.nn.Module.to, torch.Tensor.to

    def on_cpu(args: tuple) -> tuple:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return ("cpu", *args[1:])
        return args

    torch.nn.Module.to = lambda self, *args, **kwargs: module_to(self, *on_cpu(args), **kwargs)
    torch.Tensor.to = lambda self, *args, **kwargs: tensor_to(self, *on_cpu(args), **kwargs)
    torch.accelerator.synchronize = lambda *_args, **_kwargs: None
    from speculators.__main__ import app

    sys.argv = ["speculators", *argv]
    app()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--layout"]:
        _layout_main(*sys.argv[2:])
    elif sys.argv[1:2] == ["--on-cpu"]:
        _on_cpu_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m launch.bench.peers.speculators --layout DATA OUT TOKENS STEPS | --on-cpu ARGS")

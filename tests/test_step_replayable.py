"""What a CUDA graph of the training step needs: no host read inside the step, and the same shapes every step.

No host read: a real Trainer (tiny config, one of each kind) trains one step on the CPU under a dispatch mode that records every
operator that reads a tensor's value on the host (``item``, ``int()``, ``float()``, ``bool()``, ``nonzero``, a
boolean-mask index, ``unique``, ``repeat_interleave`` without ``output_size``, ``tolist``): on CUDA each is a device
to host synchronisation. The step is what ``Trainer.run`` does between taking a batch and the window's bookkeeping:
forward, loss, backward, clipping, the optimizer as it runs on CUDA (fused AdamW, Muon), the schedule and the
window's device sums; the metrics are read once per log window, outside it. Anchors and masks are prepared ahead of
the step (``Drafter.prepare``), in the flex form CUDA builds, which must read nothing either. The mode sees the
operators Python calls; what one operator's CPU kernel reads inside itself is below it (fused AdamW's CPU kernel reads
each step count, which CUDA's reads on the device), so the profiler of ``launch.bench.step --profile`` still counts
those on a CPU.

The same shapes: batches of other documents, padded to the token budget as the trainer pads them for its compiled
layers (``pad_packed``), give blocks, flex masks, metrics and gradients of one shape; only the document boundaries
(``cu_seqlens``, ``sample_ids``) vary, which ``prepare`` alone reads.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.batch import PackedBatch, pad_packed
from common.config import load_config, save_config
from common.drafter.blocks import build_blocks
from common.drafter.masks import build_masks, in_block_mask, in_block_pairs
from common.rundir import RunDir
from producer.build import load_target
from tests.drafter_fixtures import random_batch, tiny_config
from trainer.feeder import Received
from trainer.optim import build_optimizer
from trainer.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("dflash", "dflash2", "dspark")

VALUE_READS = {
    "aten._local_scalar_dense.default",  # item(), int(), float(), bool() of a tensor
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten.is_nonzero.default",
    "aten._unique.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
}
"""Operators whose output depends on a tensor's values on the host (their shape or a Python number)."""


class HostReads(TorchDispatchMode):
    """Records each operator call that reads a tensor's value on the host, with where in the project it was made."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._reads_values(str(func), args, kwargs):
            self.record(str(func))
        return func(*args, **kwargs)

    @staticmethod
    def _reads_values(name: str, args: tuple, kwargs: dict) -> bool:
        if name in VALUE_READS:
            return True
        if name in ("aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"):
            return kwargs.get("output_size") is None  # the output's length is the repeats' sum
        if name.startswith(("aten.index.Tensor", "aten.index_put", "aten._index_put_impl_")):
            indices = args[1] if len(args) > 1 else ()
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
        return False

    def record(self, name: str) -> None:
        frames = [
            f
            for f in traceback.extract_stack()
            if f.filename.startswith(str(ROOT)) and "/.venv/" not in f.filename and f.filename != __file__
        ]
        where = ", ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}" for f in frames[-3:])
        self.reads[f"{name} at {where}"] += 1


@contextlib.contextmanager
def recording_host_reads():
    """The HostReads mode, plus ``tolist`` and ``numpy``, which a CPU tensor serves without an operator."""
    mode = HostReads()
    with pytest.MonkeyPatch.context() as patch:
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)

            def reading(self, *args, _original=original, _method=method, **kwargs):
                mode.record(f"Tensor.{_method}")
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, method, reading)
        with mode:
            yield mode


def tiny_trainer(run_dir: Path, kind: str, optimizer: str, *overrides: str) -> Trainer:
    """A Trainer as the trainer process builds it on the tiny config, after a producer exported the target's head;
    its optimizer as it is built on CUDA (fused AdamW, which keeps the step counts on the device)."""
    run = RunDir(run_dir)
    run.checkpoints.mkdir(parents=True)
    overrides = (
        'logging.wandb_mode="disabled"',
        f'drafter.kind="{kind}"',
        f'training.optimizer="{optimizer}"',
        *overrides,
    )
    cfg = load_config(ROOT / "launch" / "tiny.toml", list(overrides))
    save_config(cfg, run.config)
    load_target(cfg, run, producer_id=0, device=None, group=None)
    trainer = Trainer(cfg, run)
    if trainer.device.type != "cuda":
        optim = trainer.optim
        lr, decay = cfg.training.lr, cfg.training.weight_decay
        optim.optimizer = build_optimizer(trainer.drafter, optimizer, lr, decay, fused=True)
        optim.scheduler = torch.optim.lr_scheduler.LambdaLR(optim.optimizer, optim.scheduler.lr_lambdas[0])
        trainer.optimizer, trainer.scheduler = optim.optimizer, optim.scheduler
    return trainer


def received_batch(trainer: Trainer, seed: int) -> Received:
    """A batch of four documents on the trainer's device, padded to the token budget as the feeder pads it there."""
    config = trainer.draft_config
    batch = random_batch([300, 200, 20, 480], config, seed=seed, with_last_hidden=True)
    padded = pad_packed(batch.tensors(), trainer.cfg.batching.token_budget)
    batch = PackedBatch.from_tensors(padded).to(trainer.device)
    return Received(batch, 0, seed, [], None, list(range(4)), 1000)


def train_one_step(trainer: Trainer, received: Received) -> dict[str, torch.Tensor]:
    """What ``Trainer.run`` does with a batch it took: the step and the window's bookkeeping."""
    metrics = trainer.train_step(received)
    trainer.metrics.window.add(received, metrics, 0.0, 0.0, trainer.flops(received, metrics))
    return metrics


@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_reads_nothing_on_the_host(short_tmp, kind):
    trainer = tiny_trainer(short_tmp / "run", kind, "muon" if kind == "dflash" else "adamw")
    try:
        num_anchors, generator = trainer.cfg.drafter.num_anchors, trainer.optim.generator
        train_one_step(trainer, received_batch(trainer, seed=1))  # the optimizer's state is made on the first
        received = received_batch(trainer, seed=2)
        received.prepared = trainer.drafter.prepare(received.batch, num_anchors, generator)
        with recording_host_reads() as recorded:
            train_one_step(trainer, received)
        assert not recorded.reads, f"{kind}: host reads in the step: {dict(recorded.reads)}"
        summary = trainer.metrics.window.summary()  # the window's one read, where the trainer logs
        assert summary["loss"] > 0 and 0 <= summary["coverage"] <= 1 and summary["tflops"] > 0
    finally:
        trainer.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_a_training_step_on_cuda_never_waits_for_the_device(short_tmp, kind):
    """The same step on CUDA as the trainer runs it there (compiled layers, bf16 autocast, fused AdamW or Muon, the
    next batch prepared during the backward), under torch's sync debug mode: any synchronising call is an error."""
    optimizer = "muon" if kind == "dflash" else "adamw"
    trainer = tiny_trainer(short_tmp / "run", kind, optimizer, 'launch.trainer_devices=["cuda:0"]')
    try:
        num_anchors, generator = trainer.cfg.drafter.num_anchors, trainer.optim.generator

        def batches(seed: int) -> tuple[Received, Received]:
            """A batch prepared ahead, and the next one, prepared inside the step during the backward, as the trainer
            has them."""
            received, upcoming = received_batch(trainer, seed), received_batch(trainer, seed + 1)
            received.prepared = trainer.drafter.prepare(received.batch, num_anchors, generator)
            trainer.batches.upcoming = upcoming
            return received, upcoming

        # The same path twice before the step under test: it compiles, makes the optimizer's state and runs every
        # kernel once (a first run may autotune, which waits for the device).
        for seed in (1, 3):
            train_one_step(trainer, batches(seed)[0])
        received, upcoming = batches(5)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train_one_step(trainer, received)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert upcoming.prepared is not None
        summary = trainer.metrics.window.summary()
        assert summary["loss"] > 0 and summary["tflops"] > 0
    finally:
        trainer.batches.upcoming = None
        trainer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_flex_masks_cuda_trains_with_are_prepared_without_host_reads(short_tmp, kind):
    trainer = tiny_trainer(short_tmp / "run", kind, "adamw")
    try:
        config, batch = trainer.draft_config, received_batch(trainer, seed=3).batch
        generator = torch.Generator().manual_seed(0)
        with recording_host_reads() as recorded:  # Drafter.prepare as it runs on CUDA
            blocks = build_blocks(
                batch, trainer.cfg.drafter.num_anchors, config.block_size, config.mask_token_id, generator
            )
            build_masks(blocks, config, form="flex")
        assert not recorded.reads, f"{kind}: host reads preparing the step: {dict(recorded.reads)}"
    finally:
        trainer.close()


def test_the_recorder_sees_each_kind_of_host_read():
    """The test above would pass on a recorder that sees nothing: each read it must catch, caught."""
    x = torch.arange(6.0)
    reads = [
        lambda: x.sum().item(),
        lambda: float(x[0]),
        lambda: bool(x[1] > 0),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: torch.unique(x),
        lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
        lambda: x.tolist(),
    ]
    for read in reads:
        with recording_host_reads() as recorded:
            read()
        assert recorded.reads, f"not seen: {read}"
    with recording_host_reads() as recorded:
        torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]), output_size=6)
        torch.where(x > 2, x, 0.0).sum()
    assert not recorded.reads, dict(recorded.reads)


def shapes_of(value, name: str = "") -> dict[str, tuple]:
    """Shape and dtype of every tensor in ``value`` (dataclasses, dicts, sequences, a BlockMask and its mask_mod's
    tensors), by where it sits."""
    if isinstance(value, torch.Tensor):
        return {name: (tuple(value.shape), value.dtype)}
    if callable(value) and getattr(value, "__closure__", None):  # a mask_mod: the tensors it reads
        cells = [c.cell_contents for c in value.__closure__]
        return {k: v for i, c in enumerate(cells) for k, v in shapes_of(c, f"{name}.cell{i}").items()}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif hasattr(value, "__dict__"):
        items = vars(value).items()
    else:
        return {}
    return {k: v for key, item in items for k, v in shapes_of(item, f"{name}.{key}").items()}


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_at_the_token_budget_has_the_same_shapes(short_tmp, kind):
    trainer = tiny_trainer(short_tmp / "run", kind, "adamw")
    try:
        config, budget = trainer.draft_config, trainer.cfg.batching.token_budget
        num_anchors, generator = trainer.cfg.drafter.num_anchors, trainer.optim.generator
        seen = []
        for seed, documents in enumerate(([300, 200, 20, 504], [1000], [90] * 9 + [7])):
            batch = random_batch(documents, config, seed=seed, with_last_hidden=True)
            batch = PackedBatch.from_tensors(pad_packed(batch.tensors(), budget))  # as the feeder pads it
            blocks = build_blocks(batch, num_anchors, config.block_size, config.mask_token_id, generator)
            flex = build_masks(blocks, config, form="flex")
            received = Received(batch, 0, seed, [], None, batch.sample_ids.tolist(), sum(documents))
            received.prepared = (blocks, trainer.drafter.masks(blocks))
            metrics = trainer.train_step(received)
            grads = {n: p.grad for n, p in trainer.drafter.named_parameters() if p.grad is not None}
            seen.append((batch.cu_seqlens.shape, shapes_of({"blocks": blocks, "flex": flex, "metrics": metrics})))
            assert not grads, "the optimizer step leaves no gradient behind"
        boundaries, shapes = zip(*seen)
        assert shapes[0] == shapes[1] == shapes[2]
        assert len(set(boundaries)) == 3, "the document boundaries are what varies (prepare reads them)"
    finally:
        trainer.close()


def test_empty_documents_appended_change_no_block_nor_mask():
    """The document boundaries are what varies from batch to batch: padded to a fixed count with empty documents,
    ``prepare`` too would have one set of shapes (and could be replayed with the step), drawing the same blocks."""
    config = tiny_config()
    batch = random_batch([100, 60, 7, 200], config, with_last_hidden=True)
    tensors = batch.tensors()
    boundaries = tensors["cu_seqlens"]
    padded = {**tensors, "cu_seqlens": torch.cat([boundaries, boundaries[-1:].expand(6)])}
    prepared = []
    for packed in (batch, PackedBatch.from_tensors(padded)):
        generator = torch.Generator().manual_seed(3)
        blocks = build_blocks(packed, 64, config.block_size, config.mask_token_id, generator)
        prepared.append(shapes_and_values(blocks, build_masks(blocks, config, form="flex")))
    assert prepared[0].keys() == prepared[1].keys()
    for name, value in prepared[0].items():
        assert torch.equal(value, prepared[1][name]), name


def shapes_and_values(blocks, masks) -> dict[str, torch.Tensor]:
    """The tensors of the blocks and of the flex masks (theirs, and those their mask_mod reads), by name."""
    named = {f"blocks.{k}": v for k, v in vars(blocks).items()}
    for layer_type, mask in masks.items():
        named.update({f"{layer_type}.{k}": v for k, v in vars(mask).items() if isinstance(v, torch.Tensor)})
        cells = [c.cell_contents for c in mask.mask_mod.__closure__]
        named.update({f"{layer_type}.mask_mod.{i}": c for i, c in enumerate(cells) if isinstance(c, torch.Tensor)})
    return named


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 16, 40])
def test_the_visible_pairs_of_a_block_are_counted_on_the_host_as_the_mask_has_them(block_size, causal, window):
    assert in_block_pairs(block_size, causal, window) == int(in_block_mask(block_size, causal, window).sum())

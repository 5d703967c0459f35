"""The rows every trainer of the table trains on, and the target's features over them for the peers' dumps.

The rows are our producer's documents: the synthesized chat records rendered by our chat renderer with the target's
tokenizer (producer/data/render.py, the same loss masks, truncated to data.max_seq_len), the held-out records left out
exactly as our run leaves them out (the same ``held_out_ids``), in our producer's epoch-0 order.

The features come from our producer's own capture (producer/target_model/capture.py ``Target``): documents packed without padding
into batches of batching.token_budget tokens (``split_by_length``, longest first, as each producer window is cut),
the target in the preset's precision (bf16 on a GPU), its packed attention kernel (varlen on a GPU) and, on a GPU,
its compiled decoder layers, the forward stopping after the deepest layer asked for. A naive loop of one
``model(..., output_hidden_states=True)`` per row would run every layer and the lm_head on one short row at a time.
"""

from __future__ import annotations

import dataclasses
import gc
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from common.batch import Document
from common.config import load_config
from launch.bench.peers.common import TrainingRow
from launch.bench.quality import PRESET, SMOKE_OVERRIDES
from producer.data.batching import BatchPlan, pack_documents, split_by_length
from producer.data.build import run_sources
from producer.data.order import OrderConfig, ShardOrder
from producer.data.sources import DataSource
from producer.target_model.capture import Target
from producer.target_model.load import build_target_config, load_target_model

RENDER_WINDOW = 512
"""Records rendered and tokenized in one call (batching.window_docs, our producer's window)."""


def run_config(gguf: Path, out: Path, held_out: int, smoke: bool):
    """The configuration our row trains with (``launch.bench.quality`` on ``out``'s synthesized data): the preset,
    the GGUF target, the smoke settings with --smoke, ``held_out`` records held out."""
    overrides = [
        f"target.path={json.dumps(str(gguf.resolve()))}",
        *(SMOKE_OVERRIDES if smoke else []),
        f"data.paths={json.dumps([str(out / 'data' / 'synthesized' / '*.jsonl')])}",
        f"eval.num_prompts={held_out}",
    ]
    return load_config(PRESET, overrides)


def training_source(cfg) -> DataSource:
    """The training records of ``cfg``'s data (its held-out records left out, as our run leaves them out)."""
    vocab_size = int(build_target_config(cfg.target).vocab_size)
    source, _ = run_sources(cfg, vocab_size)
    return source


def epoch_order(cfg, source: DataSource) -> list[int]:
    """The training records' ids in our one producer's epoch-0 order (data.shuffle_seed)."""
    order = ShardOrder(len(source), OrderConfig(seed=cfg.data.shuffle_seed, num_shards=1, shard_index=0))
    return [int(i) for i in order.epoch_ids(0)]


def first_batches(cfg, source: DataSource, samples: int) -> tuple[int, list[int]]:
    """(K, ids): the fewest of our producer's first batches that hold ``samples`` records, and their records' ids
    (at least ``samples`` of them, whole batches); all of epoch 0 if it holds fewer."""
    plan = BatchPlan(source, ShardOrder(len(source), OrderConfig(seed=cfg.data.shuffle_seed)), cfg.batching)
    ids: list[int] = []
    batches = 0
    for cursor, batch in plan.iter_batches():
        if cursor.epoch > 0 or len(ids) >= samples:
            break
        ids += batch
        batches += 1
    return batches, ids


def rows_of(
    source: DataSource, ids: Sequence[int], max_tokens: int | None = None
) -> tuple[list[int], list[TrainingRow]]:
    """(the ids kept, their rows): the records of ``ids`` in their order as our producer renders them, as many as
    fit ``max_tokens`` tokens together (the peers' disk cap). Bad records (none in synthesized data) and rows without
    two supervised tokens in a row (SpecForge refuses them) are left out."""
    kept: list[int] = []
    rows: list[TrainingRow] = []
    tokens = 0
    for start in range(0, len(ids), RENDER_WINDOW):
        window = [int(i) for i in ids[start : start + RENDER_WINDOW]]
        source.prefetch(window)  # rendered and tokenized together, as our producer does a window
        for sample_id in window:
            document = source.get(sample_id)
            if document is None:
                continue
            mask = document.loss_mask.astype(bool)
            if not (mask[1:] & mask[:-1]).any():
                continue
            tokens += len(document)
            if max_tokens is not None and tokens > max_tokens:
                return kept, rows
            kept.append(sample_id)
            rows.append(TrainingRow(document.input_ids.tolist(), document.loss_mask.tolist()))
    return kept, rows


def tokens_of(source: DataSource, ids: Sequence[int]) -> int:
    """Tokens of the records ``ids`` (each counted as often as it is named: every epoch's)."""
    counts = Counter(int(i) for i in ids)
    unique = list(counts)
    total = 0
    for start in range(0, len(unique), RENDER_WINDOW):
        window = unique[start : start + RENDER_WINDOW]
        source.prefetch(window)
        total += sum(counts[i] * len(document) for i in window if (document := source.get(i)) is not None)
    return total


class TargetCapture:
    """The ``FeatureCapture`` of the peers: our producer's ``Target`` over the rows, on ``device`` (the target loaded
    on first use, and let go by ``close`` so that a peer's trainer has the card to itself)."""

    def __init__(self, cfg, device: str) -> None:
        self.cfg = cfg
        self.target_cfg = dataclasses.replace(cfg.target, device=device)
        self.model: torch.nn.Module | None = None
        self.targets: dict[tuple[int, ...], Target] = {}

    def _target(self, layers: tuple[int, ...]) -> Target:
        if self.model is None:
            self.model = load_target_model(self.target_cfg)
        if layers not in self.targets:
            self.targets[layers] = Target(
                self.model, list(layers), attention=self.target_cfg.attention, compile=self.target_cfg.compile
            )
        return self.targets[layers]

    @torch.inference_mode()
    def __call__(self, rows: Sequence[TrainingRow], layers: Sequence[int]) -> Iterator[tuple[int, torch.Tensor]]:
        captured = tuple(sorted(set(layers)))
        target = self._target(captured)
        pick = torch.tensor([captured.index(layer) for layer in layers])
        hidden = target.hidden_size
        batching = self.cfg.batching
        lengths = [len(row.input_ids) for row in rows]
        for batch in split_by_length(
            list(range(len(rows))), lengths, batching.token_budget, batching.max_docs_per_batch
        ):
            documents = [
                Document(i, np.asarray(rows[i].input_ids, np.int32), np.asarray(rows[i].loss_mask, np.uint8))
                for i in batch
            ]
            packed = pack_documents(documents)
            if target.device.type == "cuda":
                packed.input_ids, packed.cu_seqlens = packed.input_ids.pin_memory(), packed.cu_seqlens.pin_memory()
            aux = target.capture(packed).aux_hidden.view(packed.num_tokens, len(captured), hidden)
            host = aux[:, pick.to(aux.device)].to(torch.bfloat16).cpu()
            bounds = packed.cu_seqlens.tolist()
            for j, i in enumerate(batch):
                yield i, host[bounds[j] : bounds[j + 1]]

    def close(self) -> None:
        """Let the target go (its GPU memory too)."""
        self.targets.clear()
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

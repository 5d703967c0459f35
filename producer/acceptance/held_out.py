"""The held-out prompts an evaluation decodes: the run's held-out records (``held_out_records``: the first
``eval.num_prompts`` good ones, those left out counted), and the prompts of a record: its first ``eval.prompt_len``
tokens or those before its first supervised token (``prompt_of``), or with ``eval.every_turn`` one per assistant
turn, the conversation before it (``turn_documents``).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.batch import Document
from common.config import RunConfig
from producer.data.build import run_sources
from producer.data.chat import check_turn_order, validate_messages
from producer.data.files import BadRecord, DataError
from producer.data.held_out import SubsetSource
from producer.data.render import ChatSource
from producer.data.sources import DataSource

log = logging.getLogger(__name__)


@dataclass
class HeldOut:
    """The held-out records an evaluation decodes, and those it left out."""

    documents: list[Document]
    skipped: list[str] = field(default_factory=list)
    """``file:line reason`` of each record left out: bad (the data source's reason), or a conversation whose turns do
    not alternate."""


def _chat_records(source: DataSource) -> DataSource | None:
    """A source whose records are conversations that ``read_json`` reads, or None (tokenized or synthetic data)."""
    base = source.source if isinstance(source, SubsetSource) else source
    return source if isinstance(base, ChatSource) else None


def held_out_records(cfg: RunConfig, vocab_size: int, held_out_file: Path | None = None) -> HeldOut:
    """The first ``eval.num_prompts`` good documents of the run's held-out split (producer/data/build.py run_sources:
    ``eval.paths``, the synthetic documents after ``data.num_samples``, or records of the data never trained on,
    those the run's ``held_out_file`` names when given), and the records left out on the way, each counted and logged
    with its ``file:line``: bad ones, and, for an evaluation at each assistant turn, conversations whose turns do not
    alternate. None of them stops the evaluation."""
    _, source = run_sources(cfg, vocab_size, held_out_file=held_out_file)
    chat = _chat_records(source) if cfg.eval.every_turn else None
    held = HeldOut([])
    for sample_id in range(len(source)):
        rejected_before = Counter(source.stats.bad)
        document = source.get(sample_id)
        if document is None:
            reason = ", ".join(source.stats.bad - rejected_before) or "bad record"
            held.skipped.append(f"{source.location(sample_id)} {reason}")
            continue
        if chat is not None:
            try:  # the rule synthesize.turns = "all" writes conversations by: each assistant turn answers a real one
                check_turn_order(validate_messages(chat.read_json(sample_id)))
            except BadRecord as bad:
                held.skipped.append(f"{source.location(sample_id)} {bad}")
                log.warning("held-out record %s skipped: %s", source.location(sample_id), bad)
                continue
        held.documents.append(document)
        if len(held.documents) == cfg.eval.num_prompts:
            break
    if not held.documents:
        raise DataError(
            f"eval: no held-out document to evaluate on ({len(source)} held-out records, none usable"
            + (f"; {'; '.join(held.skipped[:3])}" if held.skipped else "")
            + "); a data set of fewer than 10 records holds none out: give eval.paths"
        )
    return held


def held_out_documents(cfg: RunConfig, vocab_size: int, held_out_file: Path | None = None) -> list[Document]:
    """The documents of ``held_out_records``."""
    return held_out_records(cfg, vocab_size, held_out_file).documents


def prompt_of(document: Document, prompt_len: int) -> torch.Tensor:
    """The document's first ``prompt_len`` tokens, or with 0 those before its first supervised token."""
    if prompt_len == 0:
        supervised = document.loss_mask.nonzero()[0]
        prompt_len = int(supervised[0]) if supervised.size else len(document)
    return torch.as_tensor(document.input_ids[:prompt_len], dtype=torch.long)


def supervised_runs(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of each maximal run of supervised tokens, in order: a chat record's assistant turns."""
    edges = np.diff(np.concatenate([[0], (np.asarray(loss_mask) != 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def turn_documents(document: Document, max_turns: int = 0) -> list[Document]:
    """The document once per assistant turn (``supervised_runs``): the conversation through that turn, supervised on
    that turn alone, so that its prompt (``prompt_of`` at 0) is the conversation before the turn and its decoded span
    (``decoded_span``) that turn's answer. At most ``max_turns`` turns (0: all), spread evenly from the first to the
    last."""
    runs = supervised_runs(document.loss_mask)
    if max_turns and len(runs) > max_turns:
        runs = [runs[i] for i in np.linspace(0, len(runs) - 1, max_turns).round().astype(int).tolist()]
    turns = []
    for start, end in runs:
        loss_mask = np.zeros(end, dtype=document.loss_mask.dtype)
        loss_mask[start:end] = document.loss_mask[start:end]
        turns.append(Document(document.sample_id, document.input_ids[:end], loss_mask))
    return turns

"""What a run's data section builds: its sources (``build_data_source``), its training and held-out documents
(``run_sources``) and a shard's batch plan (``build_plan``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from common.config import DataConfig, RunConfig
from producer.data.batching import BatchPlan
from producer.data.chat import chat_records
from producer.data.files import DataError, expand_paths
from producer.data.held_out import SubsetSource, split_held_out
from producer.data.order import OrderConfig, ShardOrder
from producer.data.render import ChatSource
from producer.data.sources import DataSource, ParquetSource, SyntheticSource, TokenizedJsonlSource


def build_data_source(config: DataConfig, tokenizer: Any = None) -> DataSource:
    """The source described by ``config``; chat data uses ``tokenizer`` (or loads config.tokenizer)."""
    if config.format == "synthetic":
        if config.vocab_size is None:
            raise ValueError("data.vocab_size must be set for synthetic data (the producer sets it from the target)")
        return SyntheticSource(config)
    if config.format == "tokenized":
        paths = expand_paths(config.paths)
        parquet = [p.endswith(".parquet") for p in paths]
        if all(parquet):
            return ParquetSource(config, paths)
        if any(parquet):
            raise ValueError("paths mixes parquet and JSONL files; use one kind per data set")
        return TokenizedJsonlSource(config, paths)
    if tokenizer is None:
        if config.tokenizer is None:
            raise ValueError("chat data needs a tokenizer: pass the target's or set tokenizer")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)

    return ChatSource(config, chat_records(config, expand_paths(config.paths, folders=True)), tokenizer)


def run_sources(
    cfg: RunConfig, target_vocab_size: int, tokenizer: Any = None, held_out_file: Path | None = None
) -> tuple[DataSource, DataSource]:
    """(training, held-out) documents of a run, the same in every process that asks.

    Held out: the files of ``eval.paths`` when given; for synthetic data the ``eval.num_prompts`` documents after
    ``data.num_samples`` (generated like the training ones); otherwise ``eval.num_prompts`` records of the data
    itself (at most a tenth of it), drawn by ``held_out_ids`` and never trained on, kept in ``held_out_file`` (a run's
    ``held_out.json``) from the first start on. Chat data is rendered with ``tokenizer``, else ``data.tokenizer``,
    else the target's.
    """
    data = cfg.data
    if data.format == "synthetic" and data.vocab_size is None:
        # Keep the last id free: with no tokenizer it is the drafter's mask token.
        data = dataclasses.replace(data, vocab_size=target_vocab_size - 1)
    if tokenizer is None and data.format == "chat" and data.tokenizer is None and cfg.target.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)
    count = cfg.eval.num_prompts
    if data.format == "synthetic":
        extended = build_data_source(dataclasses.replace(data, num_samples=data.num_samples + count))
        return build_data_source(data), SubsetSource(extended, np.arange(data.num_samples, data.num_samples + count))
    source = build_data_source(data, tokenizer=tokenizer)
    if cfg.eval.paths:
        try:
            held = build_data_source(dataclasses.replace(data, paths=list(cfg.eval.paths)), tokenizer=tokenizer)
        except DataError as error:  # the same readers as data.paths: name the key the user wrote
            raise DataError(str(error).replace("data.paths", "eval.paths", 1)) from None
        return source, held
    return split_held_out(source, count, data.shuffle_seed, held_out_file)


def build_plan(cfg: RunConfig, source: DataSource, shard_index: int, num_shards: int) -> BatchPlan:
    """The batches of shard ``shard_index`` of ``num_shards`` of ``source`` (a run's training documents, from
    ``run_sources``), in their deterministic order."""
    order = ShardOrder(
        len(source), OrderConfig(seed=cfg.data.shuffle_seed, num_shards=num_shards, shard_index=shard_index)
    )
    return BatchPlan(source, order, cfg.batching)

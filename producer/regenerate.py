"""The online form of synthesis (``data.regenerate = true``): the stream regenerates its records as it goes.

Each chat record's last assistant turn (every one, with ``synthesize.turns = "all"``) is written anew by the
producer's own target just before the record is batched, by the same code as the offline synthesis
(producer/conversation.py): the batch plan announces each window of sample ids (``DataSource.prefetch``) and the
whole window is answered in one batched generation (producer/target_model/generator.py), then captured like any other document. No
synthesis pass first, no second copy of the data on disk beyond the answers themselves. The cost: while the
producer answers a window it fills no slot, so the trainer lives on what the ring holds (nothing, for the first
window), and on one device generation and training take turns rather than overlap (BENCHMARKS.md, synthesis).

Exactly once by prompt: the ledger and the committed cursors already say which sample ids are trained; what
must not change is a document itself, or a batch computed again after a restart (a trainer's kill -9, a
producer's) would hold another text than the one planned. So the answers are kept, as the offline synthesis
keeps them (shards written whole in ``RUN/regenerated``, keyed by the record's ``file:line``), before any batch
of their window is published; a restarted producer reads them back and generates only what no shard holds.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from common.config import ConfigError, RunConfig
from common.rundir import RunDir
from producer.conversation import ConversationWriter, generation_of, record_conversation, tool_call_format
from producer.data.build import run_sources
from producer.data.files import BadRecord
from producer.data.render import render_chat, template_errors, template_kwargs_of
from producer.data.sources import DataSource
from producer.synthesize import ShardWriter, generation_config_of, generator_for, read_shards, stop_token_ids
from producer.target_model.generation import STATIC_CACHE_ENGINE

log = logging.getLogger(__name__)


def regenerated_source(
    cfg: RunConfig, target_vocab_size: int, model: nn.Module, run_dir: RunDir, shard_index: int
) -> RegeneratedSource:
    """The run's training records (its held-out ones left out) with their answers written by ``model`` as the stream
    reaches them and kept in RUN/regenerated; ConfigError without target.path, whose tokenizer renders both."""
    if cfg.target.path is None:
        raise ConfigError("data.regenerate: needs the producer's target, loaded from target.path with its tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.target.path)
    source, _ = run_sources(cfg, target_vocab_size, tokenizer=tokenizer, held_out_file=run_dir.held_out)
    return RegeneratedSource(source, model, tokenizer, cfg, run_dir.root / "regenerated", shard_index)


class RegeneratedSource(DataSource):
    """The chat records of ``records`` (a source with ``read_json``) with their assistant turns the target's own:
    the last one, or every one with ``synthesize.turns = "all"``."""

    def __init__(
        self, records: DataSource, model: nn.Module, tokenizer: Any, cfg: RunConfig, folder: Path, producer_id: int
    ) -> None:
        super().__init__(records.config)
        self.records, self.model, self.tokenizer, self.cfg = records, model, tokenizer, cfg
        self.template_kwargs = dict(cfg.data.chat_template_kwargs)
        if cfg.synthesize.enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = cfg.synthesize.enable_thinking
        self.tool_format = tool_call_format(tokenizer, self.template_kwargs)
        self.answers = read_shards(folder) if folder.is_dir() else {}
        self.writer = ShardWriter(folder, producer_id, cfg.synthesize.records_per_shard, float("inf"))
        self.producer_id = producer_id
        self._generator = None
        self._cut_counted: set[str] = set()
        log.info(
            "regenerating the data's answers as the stream goes (synthesize.turns = %r); %d answers kept in %s from "
            "before",
            cfg.synthesize.turns,
            len(self.answers),
            folder,
        )

    def __len__(self) -> int:
        return len(self.records)

    def location(self, sample_id: int) -> str:
        return self.records.location(sample_id)

    def _read(self, sample_id: int) -> tuple[np.ndarray, np.ndarray]:
        key = self.location(sample_id)
        if key not in self.answers:
            self.prefetch([sample_id])
        answer = self.answers[key]
        if "skipped" in answer:
            raise BadRecord("not_regenerated", answer["skipped"])
        cut = answer["generation"].get("cut")
        if cut is not None and key not in self._cut_counted:
            self._cut_counted.add(key)
            self.stats.cut[cut["reason"]] += 1
        with template_errors():
            return render_chat(self.tokenizer, answer["messages"], **template_kwargs_of(answer, self.template_kwargs))

    def prefetch(self, sample_ids: list[int]) -> None:
        """Write, in one batched generation, the conversation of every record of ``sample_ids`` that has none kept;
        keep them (written whole) before returning, so that no batch of theirs is published before they are on
        disk."""
        missing = [i for i in sample_ids if self.location(i) not in self.answers]
        if not missing:
            return
        synth = self.cfg.synthesize
        conversations = []
        for sample_id in missing:
            key = self.location(sample_id)
            try:
                conversations.append(
                    record_conversation(key, self.records.read_json(sample_id), synth.turns, self.tool_format)
                )
            except BadRecord as bad:
                self._keep({"id": key, "skipped": str(bad)})
        generator = self._generator_of_target()
        settings = {
            "temperature": generator.config.temperature,
            "top_p": generator.config.top_p,
            "max_new_tokens": generator.config.max_new_tokens,
        }
        if synth.turns == "all":
            settings["turns"] = "all"
        if synth.max_conversation_tokens:
            settings["max_conversation_tokens"] = synth.max_conversation_tokens
        writer = ConversationWriter(
            self.tokenizer,
            self.template_kwargs,
            generator,
            tool_format=self.tool_format,
            max_conversation_tokens=synth.max_conversation_tokens,
        )
        with self._unpacked_attention(generator.engine):
            for conversation in writer.run(conversations, lambda: False):
                if conversation.skipped is not None:
                    self._keep({"id": conversation.key, "skipped": conversation.skipped})
                    continue
                record = {
                    "id": conversation.key,
                    "messages": conversation.messages,
                    "generation": generation_of(conversation, settings, turn_details=synth.turns == "all"),
                }
                if conversation.tools:
                    record["tools"] = conversation.tools
                self._keep(record)
        self.writer.flush()

    def _keep(self, record: dict) -> None:
        self.answers[record["id"]] = record
        self.writer.add(record)

    def _generator_of_target(self) -> Any:
        if self._generator is None:
            stop_ids = stop_token_ids(self.model, self.tokenizer)
            config = generation_config_of(self.cfg.synthesize, self.producer_id, stop_ids)
            self._generator = generator_for(self.model, config)
        return self._generator

    @contextlib.contextmanager
    def _unpacked_attention(self, engine: str):
        """The producer's target attends over packed documents; plain ``generate`` (the generator's fallback for
        models outside its own forward) needs the ordinary kernel meanwhile."""
        if engine == STATIC_CACHE_ENGINE:
            yield
            return
        packed = self.model.config._attn_implementation
        self.model.config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            self.model.config._attn_implementation = packed

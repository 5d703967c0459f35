"""The synthesis job: a producer's target writes on-policy training data, each prompt answered exactly once.

    python -m producer.synthesize --run-dir DIR --producer-id I [--device cuda:0]
    (started by ``launch/run_all.sh synthesize``, one per entry of launch.producer_devices)

Drafters learn what their target says, so the recipe every peer recommends trains on answers the target wrote
itself. The prompts are the user turns of the user's own chat records (``synthesize.prompts = "data"``, their
assistant turns regenerated), prompts the target writes itself from its chat template's user prefix (Magpie,
``"magpie"``), or both. The answers are generated in a static batch with continuous refill (producer/generate.py)
and written as OpenAI-format JSONL shards that ``data.format = "chat"`` reads as they are.

Exactly once. Every prompt has an id (``data:<record>`` or ``magpie:<n>``) and belongs to producer
``index % num_producers``, whatever happened before. Finished records collect in memory and are written as one
shard file (``p<I>-<seq>.jsonl``: a temporary name, fsync, rename) every ``records_per_shard`` records or
``flush_every_s`` seconds; prompts that cannot be answered (longer than max_prompt_tokens, an empty self-written
prompt) go to a ``.skipped`` file beside it, written first. At its start a producer reads the ids of every
shard and skipped file of the folder and answers only the others: a stop, a kill -9 or a restart loses at most
the records not yet written, which are answered again, and nothing is written twice. A temporary file never
matches ``*.jsonl``, so nothing half-written passes for a shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig, SynthesizeConfig, load_config
from common.drafter.evaluate import stop_tokens_of
from common.lifecycle import EXIT_CONFIG_ERROR, die_with_parent, exit_process
from common.rundir import RunDir, atomic_write_json, fsync_file
from producer.data import BadRecord, DataError, expand_paths, validate_messages
from producer.generate import GenerationConfig, GenerationMemoryError, Generator, Request

log = logging.getLogger(__name__)

MAGPIE_PLACEHOLDER = "\x00MAGPIE\x00"
"""Rendered as the user's message to find where the template's user prefix ends."""


@dataclass(frozen=True)
class Prompt:
    """One prompt to answer: ``messages`` (the conversation up to its last user turn) or, for Magpie, none yet."""

    id: str
    index: int
    """Position in the run's list of prompts: the producer ``index % num_producers`` answers it."""
    messages: tuple[dict[str, Any], ...] | None
    source: str
    """Where it comes from: ``file:line`` of a data record, or ``magpie``."""


def data_prompts(cfg: RunConfig) -> list[Prompt]:
    """The user turns of the chat records of data.paths, each cut after its last user message. A record that is
    not a chat record with a user turn stops the run (DataError naming file:line): it would fail every try."""
    if cfg.data.format != "chat":
        raise ConfigError(
            f"data.format: synthesize.prompts={cfg.synthesize.prompts!r} answers the user turns of chat "
            f"records, got data.format={cfg.data.format!r}"
        )
    prompts: list[Prompt] = []
    for path in expand_paths(cfg.data.paths):
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_number}"
                try:
                    messages = validate_messages(_with_answer_slot(json.loads(line)))[:-1]
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: not a JSON line ({exc.msg} at column {exc.colno})") from None
                except BadRecord as bad:
                    raise DataError(f"{where}: {bad}") from None
                last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
                if last_user is None:
                    raise DataError(f"{where}: no user message to answer")
                prompts.append(Prompt(f"data:{len(prompts)}", len(prompts), tuple(messages[: last_user + 1]), where))
    return prompts


def _with_answer_slot(record: Any) -> Any:
    """The record with an empty assistant turn after it, so that one with no answer yet passes the chat checks."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return {"messages": [*record["messages"], {"role": "assistant", "content": ""}]}
    if isinstance(record, dict) and isinstance(record.get("conversations"), list):
        return {"conversations": [*record["conversations"], {"from": "gpt", "value": ""}]}
    return record


def all_prompts(cfg: RunConfig) -> list[Prompt]:
    """The run's prompts in their fixed order: the data's, then the self-written ones."""
    synth = cfg.synthesize
    prompts = data_prompts(cfg) if synth.prompts in ("data", "both") else []
    if synth.prompts in ("magpie", "both"):
        first = len(prompts)
        prompts += [Prompt(f"magpie:{n}", first + n, None, "magpie") for n in range(synth.num_magpie)]
    return prompts


def magpie_prefix(tokenizer: Any, template_kwargs: dict[str, Any], system: str = "") -> str:
    """What the chat template writes before a user's message, under ``system`` ("": its default system prompt,
    if any): the target continues it with a user's message of its own. ConfigError when the template has no user
    turn."""
    messages = [{"role": "system", "content": system}] if system else []
    try:
        text = tokenizer.apply_chat_template(
            [*messages, {"role": "user", "content": MAGPIE_PLACEHOLDER}],
            tokenize=False,
            add_generation_prompt=False,
            **template_kwargs,
        )
    except Exception as exc:  # a template that raises on a lone user turn cannot be prompted this way
        raise ConfigError(
            f"synthesize.prompts: the chat template cannot render a user turn ({type(exc).__name__}: "
            f"{exc}); self-written prompts need one"
        ) from None
    if MAGPIE_PLACEHOLDER not in text:
        raise ConfigError(
            "synthesize.prompts: the chat template writes no user message (no user role); self-written prompts need one"
        )
    return text[: text.index(MAGPIE_PLACEHOLDER)]


# -- the shards ----------------------------------------------------------------------------------


def read_shards(folder: Path) -> dict[str, dict]:
    """Every record answered or skipped in ``folder`` (whole shards only), by prompt id."""
    records: dict[str, dict] = {}
    for path in sorted(folder.glob("*.jsonl")) + sorted(folder.glob("*.skipped")):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                records[record["id"]] = record
    return records


class ShardWriter:
    """Writes one producer's finished records as whole shard files (see the module docstring)."""

    def __init__(self, folder: Path, producer_id: int, records_per_shard: int, flush_every_s: float) -> None:
        self.folder = folder
        self.producer_id = producer_id
        self.records_per_shard = records_per_shard
        self.flush_every_s = flush_every_s
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(f".p{producer_id}-*.tmp"):  # a write a kill interrupted: never renamed, never counted
            stale.unlink()
        taken = [int(p.name.split("-")[1].split(".")[0]) for p in folder.glob(f"p{producer_id}-*")]
        self.sequence = max(taken, default=0)
        self.records: list[dict] = []
        self.skipped: list[dict] = []
        self.written = 0
        self.last_flush = time.monotonic()

    def add(self, record: dict) -> None:
        (self.skipped if "skipped" in record else self.records).append(record)
        if (
            len(self.records) + len(self.skipped) >= self.records_per_shard
            or time.monotonic() - self.last_flush >= self.flush_every_s
        ):
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.records and not self.skipped:
            return
        self.sequence += 1
        name = f"p{self.producer_id}-{self.sequence:06d}"
        # The skipped file first: a kill between the two leaves answered records undone (answered again), never
        # the other way round.
        for records, suffix in ((self.skipped, ".skipped"), (self.records, ".jsonl")):
            if records:
                self._write_whole(self.folder / f"{name}{suffix}", records)
        self.written += len(self.records)
        self.records, self.skipped = [], []

    def _write_whole(self, path: Path, records: list[dict]) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        fsync_file(tmp)
        os.replace(tmp, path)
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(folder)  # the rename itself survives a power loss
        finally:
            os.close(folder)


# -- the job -------------------------------------------------------------------------------------


class Synthesis:
    """One producer's share of the prompts, answered by its target and written as shards."""

    def __init__(self, cfg: RunConfig, run: RunDir, producer_id: int, device: str | None) -> None:
        from transformers import AutoTokenizer

        from producer.target import load_target_model

        self.cfg, self.run_dir, self.producer_id = cfg, run, producer_id
        self.synth: SynthesizeConfig = cfg.synthesize
        if cfg.target.path is None:
            raise ConfigError("target.path: synthesis needs a real target with a tokenizer and chat template")
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.target.path)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ConfigError(f"target.path: the tokenizer of {cfg.target.path} has no chat template")
        self.template_kwargs = dict(cfg.data.chat_template_kwargs)
        if self.synth.enable_thinking is not None:
            self.template_kwargs["enable_thinking"] = self.synth.enable_thinking
        # One user prefix per system prompt of the self-written prompts (magpie:n takes the (n mod k)-th).
        self.systems = list(self.synth.magpie_system_prompts) or [""]
        self.prefix_ids = (
            [
                self.tokenizer(magpie_prefix(self.tokenizer, self.template_kwargs, system), add_special_tokens=False)[
                    "input_ids"
                ]
                for system in self.systems
            ]
            if self.synth.prompts != "data"
            else []
        )
        prompts = all_prompts(cfg)  # every record checked before the target loads: a bad one stops in seconds
        self.folder = cfg.synthesize.folder(run.root)
        done = read_shards(self.folder) if self.folder.is_dir() else {}
        share = cfg.launch.total_producers
        self.total = sum(1 for p in prompts if p.index % share == producer_id)
        self.pending = [p for p in prompts if p.index % share == producer_id and p.id not in done]
        self.writer = ShardWriter(self.folder, producer_id, self.synth.records_per_shard, self.synth.flush_every_s)
        log.info(
            "producer %d synthesizes %d of its %d prompts (%d done before) into %s",
            producer_id,
            len(self.pending),
            self.total,
            self.total - len(self.pending),
            self.folder,
        )
        target_cfg = dataclasses.replace(cfg.target, device=device) if device else cfg.target
        self.model = load_target_model(target_cfg)
        self.model.config._attn_implementation = "sdpa"  # generation runs unpacked sequences
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.stop = False
        # Both static caches are made now, before anything is written: one that cannot fit stops at once (exit 2).
        self.answers = generator_for(self.model, generation_config_of(self.synth, producer_id, self.stop_ids))
        self.questions = None
        if any(p.messages is None for p in self.pending):
            self.questions = generator_for(
                self.model,
                generation_config_of(
                    self.synth, producer_id, self.stop_ids, magpie_prompt_tokens=max(map(len, self.prefix_ids))
                ),
            )

    def system_index(self, prompt: Prompt) -> int:
        """Which of synthesize.magpie_system_prompts the self-written ``prompt`` (magpie:n) is written under."""
        return int(prompt.id.removeprefix("magpie:")) % len(self.systems)

    def generation_settings(self) -> dict[str, Any]:
        """What every record of this run says about how it was made."""
        s = self.synth
        settings = {
            "target": self.cfg.target.path,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "max_new_tokens": s.max_new_tokens,
            "seed": s.seed,
        }
        if self.synth.enable_thinking is not None:
            settings["enable_thinking"] = self.synth.enable_thinking
        return settings

    def prompt_settings(self, prompt: Prompt) -> dict[str, Any]:
        """How a self-written prompt was written: the system prompt it was steered by, where not the default."""
        system = self.systems[self.system_index(prompt)] if prompt.source == "magpie" else ""
        return {"magpie_system_prompt": system} if system else {}

    def run(self) -> int:
        s, answers, questions = self.synth, self.answers, self.questions
        settings = self.generation_settings()
        started, reported = time.monotonic(), time.monotonic()
        self._report(
            answers, started
        )  # the launcher shows this start's share and what is done at once, not the last start's
        by_id = {p.id: p for p in self.pending}
        for finished in answers.generate(self._answer_requests(questions)):
            prompt, messages = by_id[finished.key[0]], finished.key[1]
            if finished.stop_reason == "prompt_too_long":
                self.writer.add(
                    {
                        "id": prompt.id,
                        "skipped": f"prompt longer than synthesize.max_prompt_tokens={s.max_prompt_tokens}",
                        "source": prompt.source,
                    }
                )
            else:
                text = self.tokenizer.decode(
                    [t for t in finished.new_ids if t not in self.stop_ids], skip_special_tokens=False
                )
                self.writer.add(
                    {
                        "id": prompt.id,
                        "messages": [*messages, {"role": "assistant", "content": text}],
                        "source": prompt.source,
                        "generation": {
                            **settings,
                            **self.prompt_settings(prompt),
                            "stop_reason": finished.stop_reason,
                            "new_tokens": len(finished.new_ids),
                        },
                    }
                )
            if time.monotonic() - reported > 10:
                reported = time.monotonic()
                self._report(answers, started)
            if self.stop:
                break
        self.writer.flush()
        self._report(answers, started, final=True)
        return 0

    def _answer_requests(self, questions: Generator | None) -> Iterator[Request]:
        """Answer requests in prompt order; Magpie prompts get their user message from ``questions`` first, a
        chunk of rows at a time, while the answer rows wait in their cache."""
        pending = list(self.pending)
        chunk = 4 * self.synth.rows
        position = 0
        while position < len(pending) and not self.stop:
            batch = pending[position : position + chunk]
            position += len(batch)
            written = self._write_questions(questions, batch) if questions is not None else {}
            for prompt in batch:
                messages = list(prompt.messages) if prompt.messages is not None else written.get(prompt.id)
                if messages is None:
                    continue  # an empty self-written prompt: recorded as skipped
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
                )
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                yield Request(key=(prompt.id, messages), prompt_ids=ids)

    def _write_questions(self, questions: Generator, batch: list[Prompt]) -> dict[str, list[dict]]:
        wanted = [p for p in batch if p.messages is None]
        written: dict[str, list[dict]] = {}
        requests = (Request(key=p.id, prompt_ids=self.prefix_ids[self.system_index(p)]) for p in wanted)
        for finished in questions.generate(requests):
            text = self.tokenizer.decode(
                [t for t in finished.new_ids if t not in self.stop_ids], skip_special_tokens=True
            ).strip()
            if text:
                written[finished.key] = [{"role": "user", "content": text}]
            else:
                self.writer.add({"id": finished.key, "skipped": "the self-written prompt is empty", "source": "magpie"})
        return written

    def _report(self, generator: Generator, started: float, final: bool = False) -> None:
        stats = generator.stats
        status = {
            "producer": self.producer_id,
            "pid": os.getpid(),
            "job": "synthesize",
            "written": self.writer.written,
            "pending_at_start": len(self.pending),
            "total": self.total,
            "new_tokens": stats.new_tokens,
            "tokens_per_s": stats.tokens_per_second,
            "occupancy": stats.occupancy,
            "engine": generator.engine,
            "seconds": time.monotonic() - started,
            "finished": final,
        }
        atomic_write_json(self.folder / f"status-p{self.producer_id}.json", status, durable=False)
        log.info(
            "producer %d: %d records written this start, %.0f new tokens/s, rows %.0f%% busy (%s)",
            self.producer_id,
            self.writer.written,
            stats.tokens_per_second,
            100 * stats.occupancy,
            generator.engine,
        )


def generation_config_of(
    synth: SynthesizeConfig, producer_id: int, stop_ids: tuple[int, ...], magpie_prompt_tokens: int | None = None
) -> GenerationConfig:
    """How producer ``producer_id`` generates for ``synthesize.*``: the answers (synthesis and regeneration alike), or
    with ``magpie_prompt_tokens`` (the longest Magpie prefix) the self-written user turns. Each producer samples from
    its own seed, so producers that sample never draw the same stream."""
    if magpie_prompt_tokens is not None:
        return GenerationConfig(
            max_new_tokens=synth.magpie_max_tokens,
            temperature=synth.magpie_temperature,
            top_p=synth.magpie_top_p,
            seed=synth.seed + 7919 * (producer_id + 1),
            stop_token_ids=stop_ids,
            rows=synth.rows,
            max_prompt_tokens=magpie_prompt_tokens,
        )
    return GenerationConfig(
        max_new_tokens=synth.max_new_tokens,
        temperature=synth.temperature,
        top_p=synth.top_p,
        seed=synth.seed + producer_id,
        stop_token_ids=stop_ids,
        rows=synth.rows,
        max_prompt_tokens=synth.max_prompt_tokens,
    )


def generator_for(model: Any, config: GenerationConfig) -> Generator:
    """``Generator(model, config)``; a static KV cache that cannot fit is a ConfigError naming the keys that size it."""
    try:
        return Generator(model, config)
    except GenerationMemoryError as exc:
        raise ConfigError(
            f"synthesize.rows: {exc}; lower synthesize.rows, or synthesize.max_prompt_tokens and "
            "synthesize.max_new_tokens (a row's positions)"
        ) from None


def stop_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Where a turn ends: the target's end-of-sequence ids (as the evaluator stops), the tokenizer's eos and the
    generation config's (one id or a list): a chat template's end of turn is often only in the latter two."""
    ids = set(stop_tokens_of(model))
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids |= {int(i) for i in (configured if isinstance(configured, list) else [configured]) if i is not None}
    return tuple(sorted(ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--producer-id", type=int, required=True)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s synth{args.producer_id} %(levelname)s %(message)s")
    die_with_parent()
    run = RunDir(args.run_dir)
    try:
        cfg = load_config(run.config)
        job = Synthesis(cfg, run, args.producer_id, args.device)
    except (ConfigError, DataError) as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR

    def request_stop(_signum: int, _frame: object) -> None:
        job.stop = True  # finish the record in hand, write what is done, exit

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    code = job.run()
    sys.stdout.flush()
    exit_process(code)


if __name__ == "__main__":
    sys.exit(main())

"""The synthesis job: a producer's target writes on-policy training data, each prompt answered exactly once.

    python -m producer.synthesize --run-dir DIR --producer-id I [--device cuda:0]
    (started by ``launch/run_all.sh synthesize``, one per entry of launch.producer_devices)

Drafters learn what their target says, so the recipe every peer recommends trains on answers the target wrote
itself. The prompts are the user's own chat records (``synthesize.prompts = "data"``: their last assistant turn, or
with ``synthesize.turns = "all"`` every one, written anew), conversations the target writes itself from its chat
template's user prefix (Magpie, ``"magpie"``, ``synthesize.magpie_turns`` user turns each), or both. Each
conversation is written turn by turn (producer/conversation.py, the code path regeneration shares), its turns
generated in a static batch with continuous refill (producer/target_model/generator.py), and kept as one record of the
OpenAI-format JSONL shards that ``data.format = "chat"`` reads as they are.

Exactly once. Every prompt has an id (``data:<record>`` or ``magpie:<n>``) and belongs to producer
``index % num_producers``, whatever happened before. A conversation is kept once it has ended, as one record.
Finished records collect in memory and are written as one shard file (``p<I>-<seq>.jsonl``: a temporary name,
fsync, rename) every ``records_per_shard`` records or ``flush_every_s`` seconds; prompts that cannot be answered (a
record whose turns are out of order or whose tool result has no call, a prompt longer than max_prompt_tokens, an
empty self-written prompt) go to a ``.skipped`` file beside it with their reason and ``file:line``, written first.
At its start a producer reads the ids of every shard and skipped file of the folder and answers only the others: a
stop, a kill -9 or a restart loses at most the records not yet written (a conversation in flight is written again
from its first turn), and nothing is written twice. A temporary file never
matches ``*.jsonl``, so nothing half-written passes for a shard.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig, SynthesizeConfig
from common.lifecycle import exit_process, run_role
from common.rundir import RunDir, fsync_file
from common.status import SynthesisStatus
from producer.conversation import (
    Conversation,
    ConversationWriter,
    ToolCallFormat,
    conversation_script,
    generation_of,
    magpie_prefix,
    tool_call_format,
)
from producer.data.chat import chat_records, record_tools
from producer.data.files import BadRecord, DataError, expand_paths
from producer.target_model.generation import GenerationConfig
from producer.target_model.generator import Generator
from producer.target_model.load import stop_tokens_of
from producer.target_model.static_cache import GenerationMemoryError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One conversation to write: a data record's (``messages``, its script) or, for Magpie, none yet."""

    id: str
    index: int
    """Position in the run's list of prompts: the producer ``index % num_producers`` answers it."""
    messages: tuple[dict[str, Any], ...] | None
    source: str
    """Where it comes from: ``file:line`` of a data record, or ``magpie``."""
    tools: tuple[dict[str, Any], ...] | None = None
    """The record's tool definitions."""
    skipped: str | None = None
    """Why the record cannot be written (turns out of order, a tool result without its call, ...): recorded as
    skipped, not tried again."""


def data_prompts(cfg: RunConfig, tool_format: ToolCallFormat | None = None) -> list[Prompt]:
    """The chat records of data.paths, read as training reads them (producer/data/files.py: any container and layout),
    as conversations to write (``synthesize.turns``): one that cannot be written is a prompt marked skipped, naming
    its file:line. A line that is not JSON, or data without a record to write, stops the run (DataError): it would
    fail every try."""
    if cfg.data.format != "chat":
        raise ConfigError(
            f"data.format: synthesize.prompts={cfg.synthesize.prompts!r} answers the user turns of chat "
            f"records, got data.format={cfg.data.format!r}"
        )
    records = chat_records(cfg.data, expand_paths(cfg.data.paths, folders=True))  # what training reads, as it does
    prompts: list[Prompt] = []
    for sample_id in range(len(records)):
        where = records.location(sample_id)
        prompt_id, index = f"data:{len(prompts)}", len(prompts)
        try:
            record = records.read(sample_id)
            script = conversation_script(record, cfg.synthesize.turns, tool_format)
            tools = record_tools(record)
        except BadRecord as bad:
            if bad.reason == "empty":  # a blank line: no prompt, so the ids of the others stay as they were
                continue
            if bad.reason == "invalid_json":
                raise DataError(f"{where}: not a JSON line ({bad.detail})") from None
            prompts.append(Prompt(prompt_id, index, None, where, skipped=str(bad)))
            continue
        prompts.append(Prompt(prompt_id, index, tuple(script), where, tuple(tools) if tools else None))
    skipped = [p for p in prompts if p.skipped is not None]
    if len(skipped) == len(prompts):
        first = f"; first: {skipped[0].source} {skipped[0].skipped}" if skipped else ""
        raise DataError(f"data.paths: no chat record to write in {cfg.data.paths} ({len(skipped)} skipped{first})")
    return prompts


def all_prompts(cfg: RunConfig, tool_format: ToolCallFormat | None = None) -> list[Prompt]:
    """The run's prompts in their fixed order: the data's, then the self-written ones."""
    synth = cfg.synthesize
    prompts = data_prompts(cfg, tool_format) if synth.prompts in ("data", "both") else []
    if synth.prompts in ("magpie", "both"):
        first = len(prompts)
        prompts += [Prompt(f"magpie:{n}", first + n, None, "magpie") for n in range(synth.num_magpie)]
    return prompts


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


# -- progress ------------------------------------------------------------------------------------

STATUS_EVERY_S = 2.0
"""How often a producer rewrites its status file: steadily, through a generation batch of minutes too."""
LOG_EVERY_S = 30.0
"""How often it logs a line of its progress."""
RECENT_S = 60.0
"""The window of the producer's pace now, which scales its prices (``SynthesisProgress.pace_now``)."""
PRIOR_STEPS = 32
"""How many of a kind's own decode steps the price it takes from the other kinds counts as (``step_seconds``)."""


class SynthesisProgress:
    """How far one producer is through its share, for its status file. Display only: what is done is what the shards
    hold. Turns are counted as its generators finish them and tokens as they make them, so the status moves, and its
    time left holds, through a batch in which no conversation ends (a Magpie chunk's user turns, minutes on a CPU).

    The time left is counted in decode steps, each kind of turn's at that kind's own price: a step costs about the
    same however many of its rows are busy (the static cache runs them all), and the kinds take turns (a chunk's
    user turns, then its answers), so the kinds' times add up. A kind prices its steps from the time it has run; one
    that has not run yet from the others' steps less their sampling, plus its own (none when greedy): on a CPU a
    sampled Magpie user turn's nucleus draw sorts the whole vocabulary, which made its steps 2-3x a greedy
    answer's."""

    def __init__(self, generators: dict[str, Generator], planned: Counter) -> None:
        """``generators``: by kind of turn ("answers", "questions"); ``planned``: the turns of each kind the pending
        prompts plan."""
        self.generators = generators
        self.planned = Counter(planned)
        self.answered = 0
        self.started = time.monotonic()
        self._seconds: Counter = Counter()
        """Seconds spent on each kind's steps: one generator runs at a time, so each interval between two looks goes
        to the kinds whose steps or prefills advanced in it (in proportion to their steps), or to the last that
        did: what runs around the generators (templates, shards) is priced into the steps."""
        self._steps: Counter = Counter()
        self._work: Counter = Counter()
        self._looked = self.started
        self._last_kind: str | None = None
        self._recent: deque[tuple[float, float, Counter]] = deque()
        """(when, seconds, steps by kind) of each look within the last ``RECENT_S``: the machine's pace now."""

    def ended(self, planned: Counter, conversation: Conversation | None) -> None:
        """A prompt is answered (kept, cut short or skipped, ``conversation`` None where it never started): the turns
        it planned and did not write will not come."""
        self.answered += 1
        written = Counter()
        if conversation is not None:
            written["answers"] = len(conversation.answers)
            written["questions"] = sum(turn["role"] == "user" for turn in conversation.turns)
        self.planned.subtract(planned - written)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def turns(self) -> int:
        """Turns the generators finished."""
        return sum(generator.stats.finished for generator in self.generators.values())

    def tokens(self) -> int:
        """New tokens made so far, those of the turns still being written included."""
        return sum(generator.stats.generated_tokens for generator in self.generators.values())

    def eta_s(self) -> float | None:
        """Seconds left: the sum over the kinds of turn of their steps left (``steps_left``) at their price per step
        (``step_seconds``). None before the first step."""
        self._look()
        if not sum(self._steps.values()):
            return None
        left = sum(self.steps_left(kind) * self.step_seconds(kind) for kind in self.generators)
        return left * self.pace_now()

    def pace_now(self) -> float:
        """The last ``RECENT_S``'s seconds over what the kinds' prices say their steps in it cost: on a shared CPU the
        producer's share of the cores changes under the run (a Magpie wave took 110 s, then 360 s, then 60 s), which
        prices averaged since the start follow minutes late. 1 before any step."""
        seconds = sum(interval for _, interval, _ in self._recent)
        priced = sum(steps[kind] * self.step_seconds(kind) for _, _, steps in self._recent for kind in steps)
        return seconds / priced if priced > 0 else 1.0

    def steps_left(self, kind: str) -> float:
        """Decode steps a kind still needs: its tokens left over its busy rows while turns wait to start, and at least
        what a running turn lacks (the last rows drain at one token a step). A turn's expected length is the tokens
        made so far over the turns finished (the running turns' lengths so far count: the short turns end first),
        at most the cap; a running turn lacks that much or what its cap leaves."""
        generator = self.generators[kind]
        stats, cap = generator.stats, generator.config.max_new_tokens
        running_so_far = stats.generated_tokens - stats.new_tokens
        mean = min(cap, stats.generated_tokens / stats.finished) if stats.finished else cap
        lacks = min(mean, cap - running_so_far / stats.active_rows) if stats.active_rows else 0.0
        waiting = max(0, self.planned[kind] - stats.finished - stats.active_rows)
        busy_rows = generator.config.rows * (stats.occupancy or 1.0)
        return max((waiting * mean + stats.active_rows * lacks) / busy_rows, lacks)

    def step_seconds(self, kind: str) -> float:
        """A kind's seconds per decode step: its own so far, beside (as ``PRIOR_STEPS`` of its steps) the others'
        without their sampling, plus their sampling if this kind samples too: its first steps alone would price its
        first prefill, a whole wave's prompts, into a few steps."""
        others = [k for k in self.generators if k != kind and self._steps[k]]
        if not others:
            return self._seconds[kind] / self._steps[kind]
        steps = sum(self._steps[k] for k in others)
        sampling = sum(self.generators[k].stats.sampling_seconds for k in others)
        forward = max(0.0, sum(self._seconds[k] for k in others) - sampling)
        samples = self.generators[kind].config.temperature > 0
        prior = (forward + (sampling if samples else 0.0)) / steps
        return (self._seconds[kind] + PRIOR_STEPS * prior) / (self._steps[kind] + PRIOR_STEPS)

    def _look(self) -> None:
        """Give the time since the last look to the kinds whose steps or prefills advanced in it."""
        now = time.monotonic()
        interval, self._looked = now - self._looked, now
        work = {kind: g.stats.decode_steps + g.stats.prefill_forwards for kind, g in self.generators.items()}
        steps = {kind: g.stats.decode_steps - self._steps[kind] for kind, g in self.generators.items()}
        moved = [kind for kind in work if work[kind] > self._work[kind]]
        for kind in moved:
            share = steps[kind] / sum(steps[k] for k in moved) if sum(steps[k] for k in moved) else 1 / len(moved)
            self._seconds[kind] += interval * share
        for kind in self.generators:
            self._steps[kind] += steps[kind]
            self._work[kind] = work[kind]
        if moved:
            self._last_kind = max(moved, key=lambda kind: steps[kind])
        elif self._last_kind is not None:
            self._seconds[self._last_kind] += interval
        self._recent.append((now, interval, +Counter(steps)))
        while self._recent and self._recent[0][0] < now - RECENT_S:
            self._recent.popleft()


# -- the job -------------------------------------------------------------------------------------


class Synthesis:
    """One producer's share of the prompts, written by its target as conversations and kept as shards."""

    def __init__(self, cfg: RunConfig, run: RunDir, producer_id: int, device: str | None) -> None:
        from transformers import AutoTokenizer

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
        # The system prompts that steer the self-written user turns (magpie:n takes the (n mod k)-th).
        self.systems = list(self.synth.magpie_system_prompts) or [""]
        prefix_lengths = self._magpie_prefix_lengths()
        self.tool_format = tool_call_format(self.tokenizer, self.template_kwargs)
        prompts = all_prompts(cfg, self.tool_format)  # every record checked before the target loads
        self.folder = cfg.synthesize.folder(run.root)
        done = read_shards(self.folder) if self.folder.is_dir() else {}
        share = cfg.launch.total_producers
        self.total = sum(1 for p in prompts if p.index % share == producer_id)
        self.pending = [p for p in prompts if p.index % share == producer_id and p.id not in done]
        self.writer = ShardWriter(self.folder, producer_id, self.synth.records_per_shard, self.synth.flush_every_s)
        self.skipped: Counter = Counter()
        """Prompts recorded as skipped in this start, per reason."""
        self.first_skipped: list[str] = []
        self.cut: Counter = Counter()
        """Conversations cut in this start, per reason."""
        self.cut_after_turn: Counter = Counter()
        log.info(
            "producer %d synthesizes %d of its %d prompts (%d done before) into %s",
            producer_id,
            len(self.pending),
            self.total,
            self.total - len(self.pending),
            self.folder,
        )
        self.stop = False
        self._lock = threading.Lock()
        """Between the job and its status thread: the counts change together."""
        if self.pending:  # a finished share never loads its target (a large one takes minutes to load)
            self._load_target(device, prefix_lengths)

    def _load_target(self, device: str | None, prefix_lengths: list[int]) -> None:
        """The target and its generators. Both static caches are made now, before anything is written: one that
        cannot fit stops at once (exit 2)."""
        from producer.target_model.load import load_target_model

        target_cfg = dataclasses.replace(self.cfg.target, device=device) if device else self.cfg.target
        self.model = load_target_model(target_cfg)
        self.model.config._attn_implementation = "sdpa"  # generation runs unpacked sequences
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.answers = generator_for(self.model, generation_config_of(self.synth, self.producer_id, self.stop_ids))
        self.questions = self._questions_generator(prefix_lengths)
        generators = {"answers": self.answers, **({"questions": self.questions} if self.questions else {})}
        self.progress = SynthesisProgress(generators, sum(map(self.planned_turns, self.pending), Counter()))

    def _magpie_prefix_lengths(self) -> list[int]:
        """The token length of each system prompt's Magpie prefix (none where every prompt is the data's). Measured
        before the target loads: a template without a user turn stops the run in seconds."""
        if self.synth.prompts == "data":
            return []
        return [
            len(
                self.tokenizer(magpie_prefix(self.tokenizer, self.template_kwargs, system), add_special_tokens=False)[
                    "input_ids"
                ]
            )
            for system in self.systems
        ]

    def _questions_generator(self, prefix_lengths: list[int]) -> Generator | None:
        """The generator of Magpie's self-written user turns, or None where no pending prompt is Magpie's."""
        if not any(p.source == "magpie" for p in self.pending):
            return None
        # Follow-up user turns are written after the conversation so far: their prompts are as long as an answer's.
        longest = self.synth.max_prompt_tokens if self.synth.magpie_turns > 1 else max(prefix_lengths)
        return generator_for(
            self.model, generation_config_of(self.synth, self.producer_id, self.stop_ids, magpie_prompt_tokens=longest)
        )

    def planned_turns(self, prompt: Prompt) -> Counter:
        """The turns the target writes for ``prompt``, by kind ("answers", and "questions" for Magpie's own user
        turns)."""
        if prompt.skipped is not None:
            return Counter()
        if prompt.messages is None:
            return Counter(answers=self.synth.magpie_turns, questions=self.synth.magpie_turns)
        return Counter(answers=self.conversation_of(prompt).planned_turns)

    def conversation_of(self, prompt: Prompt) -> Conversation:
        """The conversation the target writes for ``prompt`` (one not skipped before it starts)."""
        if prompt.messages is None:
            return Conversation.self_written(prompt, self.synth.magpie_turns, self.system_index(prompt))
        tools = list(prompt.tools) if prompt.tools else None
        return Conversation.of_record(prompt, list(prompt.messages), tools, all_turns=self.synth.turns == "all")

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
        if self.synth.max_conversation_tokens:
            settings["max_conversation_tokens"] = self.synth.max_conversation_tokens
        return settings

    def prompt_settings(self, prompt: Prompt) -> dict[str, Any]:
        """How a record's conversation was written, where not the default: for a data record, its turns; for a
        self-written one, the system prompt that steered it and its user turns."""
        if prompt.source != "magpie":
            return {"turns": "all"} if self.synth.turns == "all" else {}
        system = self.systems[self.system_index(prompt)]
        settings: dict[str, Any] = {"magpie_system_prompt": system} if system else {}
        if self.synth.magpie_turns > 1:
            settings["magpie_turns"] = self.synth.magpie_turns
        return settings

    def request_stop(self) -> None:
        """Finish the conversations in hand, write what is done, exit (a rerun continues)."""
        self.stop = True

    def run(self) -> int:
        if not self.pending:
            SynthesisStatus(
                producer=self.producer_id, pid=os.getpid(), total=self.total, eta_s=0.0, finished=True
            ).write(SynthesisStatus.path(self.folder, self.producer_id))
            log.info(
                "producer %d: all %d of its prompts were done before; the target is not loaded",
                self.producer_id,
                self.total,
            )
            return 0
        answers = self.answers
        # The launcher shows this start's share and what is done at once, not the last start's.
        self._report()
        done = threading.Event()
        reporter = threading.Thread(target=self._report_until, args=(done,), name="status", daemon=True)
        reporter.start()
        writer = ConversationWriter(
            self.tokenizer,
            self.template_kwargs,
            answers,
            questions=self.questions,
            magpie_systems=self.systems,
            tool_format=self.tool_format,
            max_conversation_tokens=self.synth.max_conversation_tokens,
        )
        try:
            for conversation in writer.run(self._conversations(), lambda: self.stop):
                with self._lock:
                    self._keep(conversation)
            self.writer.flush()
        finally:
            done.set()
            reporter.join()
        self._report(final=True)
        return 0

    def _report_until(self, done: threading.Event) -> None:
        """The status file every STATUS_EVERY_S and a log line every LOG_EVERY_S, until ``done``."""
        logged = time.monotonic()
        while not done.wait(STATUS_EVERY_S):
            log_now = time.monotonic() - logged >= LOG_EVERY_S
            logged = time.monotonic() if log_now else logged
            try:
                self._report(log_now=log_now)
            except OSError as exc:  # display only: the job goes on (a full disk stops it at its next shard)
                log.warning("could not write the status file: %s", exc)

    def _conversations(self) -> Iterator[Conversation]:
        """The pending prompts' conversations in prompt order; a prompt skipped before it starts is recorded as such."""
        for prompt in self.pending:
            if prompt.skipped is not None:
                with self._lock:
                    self._skip(prompt, prompt.skipped)
                    self.progress.ended(Counter(), None)
            else:
                yield self.conversation_of(prompt)

    def _keep(self, conversation: Conversation) -> None:
        prompt: Prompt = conversation.key
        self.progress.ended(self.planned_turns(prompt), conversation)
        if conversation.skipped is not None:
            self._skip(prompt, conversation.skipped)
            return
        if conversation.cut is not None:
            self.cut[conversation.cut["reason"]] += 1
            self.cut_after_turn[conversation.cut["after_turn"]] += 1
        record = {"id": prompt.id, "messages": conversation.messages, "source": prompt.source}
        turn_details = self.synth.turns == "all" or self.synth.magpie_turns > 1
        settings = {**self.generation_settings(), **self.prompt_settings(prompt)}
        record["generation"] = generation_of(conversation, settings, turn_details)
        if conversation.tools:
            record["tools"] = conversation.tools
        self.writer.add(record)

    def _skip(self, prompt: Prompt, reason: str) -> None:
        self.skipped[reason.split(":")[0]] += 1
        if len(self.first_skipped) < 10:
            self.first_skipped.append(f"{prompt.source} {reason}")
        self.writer.add({"id": prompt.id, "skipped": reason, "source": prompt.source})

    def _report(self, final: bool = False, log_now: bool = True) -> None:
        progress, answers = self.progress, self.answers
        seconds = progress.seconds
        tokens_per_s = progress.tokens() / seconds if seconds else 0.0
        with self._lock:
            status = SynthesisStatus(
                producer=self.producer_id,
                pid=os.getpid(),
                written=self.writer.written,
                answered=progress.answered,
                turns=progress.turns(),
                turns_planned=max(0, sum(progress.planned.values())),
                eta_s=0.0 if final else progress.eta_s(),
                pending_at_start=len(self.pending),
                total=self.total,
                new_tokens=progress.tokens(),
                tokens_per_s=tokens_per_s,
                occupancy=answers.stats.occupancy,
                engine=answers.engine,
                seconds=seconds,
                finished=final,
                skipped=dict(self.skipped),
                first_skipped=list(self.first_skipped),
                cut=dict(self.cut),
                cut_after_turn={str(turn): n for turn, n in sorted(self.cut_after_turn.items())},
            )
            status.write(SynthesisStatus.path(self.folder, self.producer_id))
        if log_now or final:
            log.info(
                "producer %d: %d of %d prompts answered this start (%d written), %d skipped, %d cut short, %.0f new "
                "tokens/s, rows %.0f%% busy (%s)",
                self.producer_id,
                status.answered,
                len(self.pending),
                status.written,
                sum(status.skipped.values()),
                sum(status.cut.values()),
                tokens_per_s,
                100 * status.occupancy,
                answers.engine,
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
    code = run_role(
        args.run_dir, lambda cfg, run: Synthesis(cfg, run, args.producer_id, args.device), repeating=(DataError,)
    )
    sys.stdout.flush()
    exit_process(code)


if __name__ == "__main__":
    sys.exit(main())

"""``launch/run_all.sh check``: what training would see, without starting a run.

Loads the config (``--config`` or the tiny default, with ``key=value`` overrides), the target's config
and tokenizer (no weights), the drafter it implies, and a sample of the data, then prints: what each entry of
data.paths is read as (chat data: container, split, layout), the counts of good and bad records (with ``file:line``
of the first bad ones), the conversations a synthesis cut short and, with ``synthesize.turns = "all"``, the records
the target cannot write turn by turn, token length statistics, the share of supervised tokens, and one rendered
sample with its supervised tokens marked. Exit 0 when the data has good records, 2 on a configuration or data
error (one line naming the key or file), or when no record of the sample is usable.

    launch/run_all.sh check --config my.toml target.path=/models/Qwen3-8B data.paths='["train.jsonl"]'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, RunConfig, load_config
from common.lifecycle import EXIT_CONFIG_ERROR
from launch.runs import DEFAULT_CONFIG

SUPERVISED_OPEN, SUPERVISED_CLOSE = "\x1b[1;32m", "\x1b[0m"


def _tokenizer(cfg: RunConfig) -> Any:
    """The tokenizer the producers render chat data with (data.tokenizer, else the target's), or None."""
    source = cfg.data.tokenizer or cfg.target.path
    if source is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _drafter_summary(cfg: RunConfig, tokenizer: Any) -> str:
    """The drafter this config implies: its shape, target layers and mask token (from the target's config)."""
    from common.drafter.draft_config import DraftConfig
    from producer.target_model.load import build_target_config

    target = build_target_config(cfg.target)
    d = cfg.drafter
    overrides = d.draft_overrides()
    mask = d.mask_token_id if d.mask_token_id is not None or tokenizer is not None else int(target.vocab_size) - 1
    try:
        draft = DraftConfig.from_target(
            target, num_draft_layers=d.num_layers, tokenizer=tokenizer, mask_token_id=mask, **overrides
        )
    except ValueError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith("drafter.") else f"drafter.{message}") from None
    return (
        f"target {target.model_type}: {target.num_hidden_layers} layers, hidden {target.hidden_size}, vocab "
        f"{target.vocab_size}\ndrafter: {draft.num_hidden_layers} layers {draft.layer_types}, hidden "
        f"{draft.hidden_size}, heads {draft.num_attention_heads}/{draft.num_key_value_heads} of {draft.head_dim}, "
        f"target layers {draft.target_layer_ids}, mask token {draft.mask_token_id}"
        + (
            f" ({tokenizer.convert_ids_to_tokens(draft.mask_token_id)!r})"
            if tokenizer is not None and draft.mask_token_id < len(tokenizer)
            else ""
        )
        + (f"\n{described}" if (described := draft.options.describe(draft)) else "")
        + _serving_notes(draft)
    )


def _serving_notes(draft) -> str:
    """What a real server will refuse of this drafter, said before it is trained (the kind's table knows)."""
    from common.drafter.kinds import kind_of

    refusal = kind_of(draft.kind).llamacpp_refusal
    reason = refusal(draft) if refusal is not None else None
    return f"\nnote: {reason}" if reason else ""


def marked(tokenizer: Any, input_ids: np.ndarray, loss_mask: np.ndarray, color: bool) -> str:
    """The decoded sample with its supervised spans marked (green, or between [[ and ]] without a terminal)."""
    opened, closed = (SUPERVISED_OPEN, SUPERVISED_CLOSE) if color else ("[[", "]]")
    out, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or loss_mask[end] != loss_mask[start]:
            text = (
                tokenizer.decode(input_ids[start:end])
                if tokenizer is not None
                else " ".join(map(str, input_ids[start:end]))
            )
            out.append(f"{opened}{text}{closed}" if loss_mask[start] else text)
            start = end
    return "".join(out)


def spread_ids(num_records: int, count: int) -> np.ndarray:
    """``count`` record ids spread over ``num_records`` (a bad tail shows too), sorted, each once."""
    count = min(count, num_records)
    return np.unique(np.linspace(0, num_records - 1, count).round().astype(int)) if count else np.array([], int)


@dataclass
class ConversationTally:
    """What sampled chat records say about multi-turn regeneration: the conversations a synthesis or regeneration
    cut short (their ``generation.cut``) and, with ``synthesize.turns = "all"``, the records the target could not
    write turn by turn."""

    all_turns: bool
    """``synthesize.turns = "all"``: each record's script is read as the target would write it."""
    tool_format: Any
    """How the template writes a tool call (``producer.conversation.tool_call_format``); None when it writes none
    the target's turns can be read back from, or when not ``all_turns``."""
    cut: Counter = field(default_factory=Counter)
    cut_after_turn: Counter = field(default_factory=Counter)
    cut_where: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    skipped_where: list[str] = field(default_factory=list)
    with_tool_calls: int = 0

    def add(self, record: Any, where: str) -> None:
        """Count one record, read at ``where`` (file:line)."""
        from producer.conversation import conversation_script
        from producer.data.files import BadRecord

        generation = record.get("generation") if isinstance(record, dict) else None
        record_cut = generation.get("cut") if isinstance(generation, dict) else None
        if isinstance(record_cut, dict):
            self.cut[record_cut.get("reason")] += 1
            self.cut_after_turn[record_cut.get("after_turn")] += 1
            self.cut_where.append(
                f"{where} {record_cut.get('reason')} after assistant turn {record_cut.get('after_turn')} of "
                f"{record_cut.get('of_turns')}: {record_cut.get('detail')}"
            )
        if self.all_turns:
            try:
                script = conversation_script(record, "all", self.tool_format)
            except BadRecord as bad:
                self.skipped[bad.reason] += 1
                self.skipped_where.append(f"{where} {bad}")
                return
            self.with_tool_calls += any(m.get("tool_calls") for m in script)

    def lines(self, sampled: int) -> list[str]:
        """The report's lines, of ``sampled`` records read."""
        lines: list[str] = []
        if self.cut:
            reasons = ", ".join(f"{reason} {n}" for reason, n in self.cut.most_common())
            turns = ", ".join(f"{turn}: {n}" for turn, n in sorted(self.cut_after_turn.items(), key=str))
            lines.append(
                f"conversations cut short by the target: {sum(self.cut.values())} of the {sampled} sampled "
                f"({reasons}; after assistant turn {turns})"
            )
            lines += [f"  cut {line}" for line in self.cut_where]
        if self.all_turns:
            tool_format = self.tool_format
            writes = (
                f"writes a call as JSON after {tool_format.opener!r}"
                if tool_format is not None and tool_format.opener
                else "writes a call as JSON"
                if tool_format is not None
                else "writes no tool call the target's turns can be read back from: tool records are skipped"
            )
            skipped = self.skipped
            reasons = f" ({', '.join(f'{reason} {n}' for reason, n in skipped.most_common())})" if skipped else ""
            lines.append(
                f'synthesize.turns = "all": of the {sampled} sampled, {sum(skipped.values())} cannot be written turn '
                f"by turn and are skipped{reasons}; {self.with_tool_calls} of the others call tools (the template "
                f"{writes})"
            )
            lines += [f"  skipped {where}" for where in self.skipped_where]
        return lines

    def figures(self) -> dict[str, Any]:
        """The same as figures for ``--json``."""
        figures: dict[str, Any] = {
            "cut": dict(self.cut),
            "cut_after_turn": {str(turn): n for turn, n in self.cut_after_turn.items()},
            "cut_records": self.cut_where,
        }
        if self.all_turns:
            figures.update(turns_all_skipped=dict(self.skipped), turns_all_first_skipped=self.skipped_where)
            figures["tool_call_records"] = self.with_tool_calls
        return figures


def conversations(cfg: RunConfig, source: Any, ids: np.ndarray, tokenizer: Any) -> tuple[list[str], dict[str, Any]]:
    """What the sampled chat records say about multi-turn regeneration (``ConversationTally``): its lines and
    figures; a bad record is left to the bad records' report."""
    from producer.conversation import tool_call_format
    from producer.data.files import BadRecord

    template_kwargs = dict(cfg.data.chat_template_kwargs)
    if cfg.synthesize.enable_thinking is not None:
        template_kwargs["enable_thinking"] = cfg.synthesize.enable_thinking
    all_turns = cfg.synthesize.turns == "all"
    tally = ConversationTally(all_turns, tool_call_format(tokenizer, template_kwargs) if all_turns else None)
    for sample_id in ids.tolist():
        try:
            record = source.read_json(sample_id)
        except BadRecord:
            continue  # reported with the bad records
        tally.add(record, source.location(sample_id))
    return tally.lines(len(ids)), tally.figures()


def _read_as(source: Any) -> list[str]:
    """What each entry of data.paths is read as (container, split, layout: producer/data/files.py), for chat data;
    [] for the others."""
    base = getattr(source, "source", source)  # the training records of the held-out split
    describe = getattr(base, "describe", None)
    return describe() if describe is not None else []


def check(cfg: RunConfig, sample: int, color: bool) -> tuple[str, dict[str, Any]]:
    """The report (text) and its figures of what training would see of ``cfg``'s data."""
    from producer.data.build import run_sources
    from producer.target_model.load import build_target_config

    tokenizer = _tokenizer(cfg)
    lines = [_drafter_summary(cfg, tokenizer), f"optimizer: {cfg.training.optimizer_reason}"]
    if cfg.training.optimizer_fallback:
        lines.append(f"note: {cfg.training.optimizer_fallback}")
    chat = cfg.data.format == "chat"
    source, held_out = run_sources(
        cfg, int(build_target_config(cfg.target).vocab_size), tokenizer=tokenizer if chat else None
    )
    ids = spread_ids(len(source), sample)
    source.stats.keep_first_bad = held_out.stats.keep_first_bad = sample  # every bad record read, not the first 3
    documents = [d for d in (source.get(int(i)) for i in ids) if d is not None]
    held_ids = spread_ids(len(held_out), sample)
    held_good = sum(held_out.get(int(i)) is not None for i in held_ids)  # read: a bad one would fail an evaluation
    figures: dict[str, Any] = {}
    for part_lines, part_figures in (
        _records_report(cfg, source, ids, documents),
        _held_out_report(cfg, held_out, held_ids, held_good),
        conversations(cfg, source, ids, tokenizer) if chat else ([], {}),
        _tokens_report(cfg, source, documents, tokenizer, color) if documents else ([], {}),
    ):
        lines += part_lines
        figures.update(part_figures)
    return "\n".join(lines), figures


def _records_report(cfg: RunConfig, source: Any, ids: np.ndarray, documents: list) -> tuple[list[str], dict]:
    """The training records: how many, how many of the sample are good and bad (and where), what they are read as."""
    stats = source.stats
    figures = {
        "records": len(source),
        "sampled": int(len(ids)),
        "good": len(documents),
        "bad": dict(stats.bad),
        "first_bad": list(stats.first_bad),
        "truncated": stats.truncated,
        "optimizer": cfg.training.resolved_optimizer,
    }
    lines = [
        f"data: {len(source)} records in {cfg.data.format} format; sampled {len(ids)}: {len(documents)} good, "
        f"{sum(stats.bad.values())} bad {dict(stats.bad) or ''}".rstrip()
    ]
    read_as = _read_as(source)
    if read_as:
        figures["read_as"] = read_as
        lines += [f"  from {line}" for line in read_as]
    lines += [f"  bad record {where}" for where in stats.first_bad]
    return lines, figures


def _held_out_report(cfg: RunConfig, held_out: Any, held_ids: np.ndarray, held_good: int) -> tuple[list[str], dict]:
    """The records held out for evaluation: where they come from, how many of those read are good and bad."""
    held_stats = held_out.stats
    figures = dict(
        held_out=len(held_out),
        held_out_read=int(len(held_ids)),
        held_out_good=int(held_good),
        held_out_bad=dict(held_stats.bad),
        held_out_first_bad=list(held_stats.first_bad),
    )
    line = (
        f"held out for evaluation: {len(held_out)} records, "
        + (
            "the files of eval.paths"
            if cfg.eval.paths
            else "the synthetic documents after data.num_samples"
            if cfg.data.format == "synthetic"
            else "drawn from the data and never trained on (eval.num_prompts, at most a tenth of the records; eval.paths to "
            "give files instead)"
        )
        + f"; read {len(held_ids)}: {held_good} good, {sum(held_stats.bad.values())} bad "
        f"{dict(held_stats.bad) or ''}".rstrip()
    )
    return [line] + [f"  bad held-out record {where}" for where in held_stats.first_bad], figures


def _tokens_report(cfg: RunConfig, source: Any, documents: list, tokenizer: Any, color: bool) -> tuple[list[str], dict]:
    """The good documents' token lengths and supervised share, and the first one rendered with its supervised
    tokens marked."""
    lengths = np.array([len(d) for d in documents])
    supervised = np.array([int(d.loss_mask.sum()) for d in documents])
    figures = dict(
        tokens_min=int(lengths.min()),
        tokens_mean=float(lengths.mean()),
        tokens_p50=float(np.percentile(lengths, 50)),
        tokens_p90=float(np.percentile(lengths, 90)),
        tokens_max=int(lengths.max()),
        supervised_fraction=float(supervised.sum() / lengths.sum()),
    )
    first = documents[0]
    shown = marked(tokenizer, first.input_ids, first.loss_mask, color)
    legend = "supervised tokens in green" if color else "supervised tokens between [[ and ]]"
    lines = [
        f"tokens per document: min {lengths.min()}, mean {lengths.mean():.0f}, p50 {np.percentile(lengths, 50):.0f}, "
        f"p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()} (data.max_seq_len {cfg.data.max_seq_len}, "
        f"{source.stats.truncated} truncated); supervised {figures['supervised_fraction']:.1%} of the tokens",
        f"sample {first.sample_id} ({source.location(first.sample_id)}), {legend}:\n{shown}",
    ]
    return lines, figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/run_all.sh check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="TOML config (default: launch/tiny.toml)")
    parser.add_argument("--sample", type=int, default=1000, help="records to read, spread over the data (1000)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    from producer.data.files import DataError
    from producer.target_model.load import UnsupportedTarget

    # The data's own warnings are its bad records, one line each: the report lists every one already. Only while it
    # checks: the level of the data package's logger outlives a call made in-process (tests, a notebook).
    data_log = logging.getLogger("producer.data")
    level = data_log.level
    data_log.setLevel(logging.ERROR)
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
        report, figures = check(cfg, args.sample, color=sys.stdout.isatty())
    except (
        ConfigError,
        DataError,
        UnsupportedTarget,
        ValueError,
    ) as exc:  # ValueError: an override the target contradicts
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    finally:
        data_log.setLevel(level)
    print(report)
    if args.json:
        print(json.dumps(figures))
    if not figures["good"]:
        print("error: no record of the sample is usable (see the bad records above)", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/configuration.md, written from the config package (common/config/) so that the two cannot drift.

    python -m launch.tools.config_docs            # rewrite docs/configuration.md
    python -m launch.tools.config_docs --check    # exit 1, naming what differs, if it is not what this writes

It walks ``RunConfig``'s sections (its nested dataclasses) in order and writes one table per section, after
the section's class docstring: each field's dotted key, type, default, who reads it (the section's
``READ_BY``), whether restart-trainer may change it, and the attribute docstring that follows the field in
the section's source file (read with ``ast``; Python keeps no such docstring at run time). A field without a docstring or
without a ``READ_BY`` entry is an error naming the key. ``tests/test_config_docs.py`` fails when the
committed file differs from what this writes, so a field added to a section must come with a rerun.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
COMMAND = "python -m launch.tools.config_docs"

INTRO = """\
One TOML file plus dotted overrides, for example
`training.lr=3e-4 launch.num_producers=2 'launch.producer_devices=["cuda:0"]'`
(`launch/run_all.sh [--config FILE] [key=value ...]`). Errors name the key
(`training.lr: must be > 0, got -1.0`); unknown keys are errors, never silently ignored. The resolved
config, every value written out, is saved into the run directory as `config.toml`; running again on that
directory resumes with it. The presets, `launch/tiny.toml` the default (the README's table says what each is for
and which have been run): {presets}.

Every field says who reads it (its section's `READ_BY`, in `common/config/`). `restart-trainer` accepts changes of
what only the trainer or the launcher reads and refuses, naming the key, what a producer read at its start
or the drafter's checkpoint fixes (also `training.max_steps=0` when the producers were started with another
value: they count epochs only then). The column "restart-trainer" below says which."""


class ConfigDocError(ValueError):
    """A section in common/config/ lacks something the page needs (a field's docstring or READ_BY entry)."""


@dataclass
class Field:
    key: str
    type: str
    default: str
    readers: list[str]
    restart: str
    doc: str


@dataclass
class Section:
    name: str
    class_name: str
    doc: str
    fields: list[Field]


def _one_line(text: str) -> str:
    """A docstring as one line of Markdown: RST's double backticks as code spans, no raw HTML, no table breaks."""
    text = " ".join(inspect.cleandoc(text).split())
    text = text.replace("``", "`")
    return text.replace("<", "&lt;").replace("|", "\\|")


def docstrings(source: str, class_name: str) -> tuple[str | None, dict[str, str]]:
    """The docstring of class ``class_name`` in ``source`` and its attribute docstrings (the string literal
    right after a field), by field name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            docs = {}
            for statement, following in zip(node.body, node.body[1:]):
                if (
                    isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    docs[statement.target.id] = following.value.value
            return ast.get_docstring(node), docs
    raise ConfigDocError(f"no class {class_name} in the source")


def type_words(tp: Any) -> str:
    """An annotation in words (no '|': the page's tables would split on it)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(tp) if arg is not type(None)]
        words = " or ".join(type_words(arg) for arg in args)
        return f"{words}, or unset" if len(args) < len(typing.get_args(tp)) else words
    if origin is Literal:
        return "one of " + ", ".join(f"`{_toml(choice)}`" for choice in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list of {type_words(item)}s"
    if origin is dict:
        return "table"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", typing.Any: "any"}
    if tp in names:
        return names[tp]
    raise ConfigDocError(f"no words for the annotation {tp!r}")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return "unset" if value is None else f"`{_toml(value)}`"


def section_of(module: types.ModuleType, name: str, cls: type, missing: list[str]) -> Section:
    """The table of one section class (a config section, or a drafter kind's options) under the dotted ``name``;
    what it lacks is added to ``missing``. A field holding a sub-table named by another field (the drafter's
    options) is left to that sub-table's own section."""
    class_doc, docs = docstrings(Path(inspect.getfile(cls)).read_text(), cls.__name__)
    if not class_doc:
        missing.append(f"{name}: no docstring of {cls.__name__}")
    section_hints = typing.get_type_hints(cls)
    read_by = getattr(cls, "READ_BY", {})
    fields = []
    for f in dataclasses.fields(cls):
        if "table_named_by" in f.metadata:
            continue
        key = f"{name}.{f.name}"
        if f.name not in docs:
            missing.append(f"{key}: no docstring (a string literal on the line after the field)")
        if f.name not in read_by:
            missing.append(f"{key}: no READ_BY entry in {cls.__name__}")
        if f.name not in docs or f.name not in read_by:
            continue
        restart = "refused" if module.fixed_while_producers_run(key) else "may change"
        fields.append(
            Field(
                key,
                type_words(section_hints[f.name]),
                _default(f),
                read_by[f.name].split(),
                restart,
                _one_line(docs[f.name]),
            )
        )
    return Section(name, cls.__name__, _one_line(class_doc or ""), fields)


def sections(module: types.ModuleType) -> list[Section]:
    """RunConfig's sections of the config package ``module``, in order, with every field documented; after the
    drafter's, one per drafter kind with options: its ``[drafter.<kind>]`` table."""
    from common.drafter.kinds import KINDS

    run_config = module.RunConfig
    hints = typing.get_type_hints(run_config)
    out: list[Section] = []
    missing: list[str] = []
    for section_field in dataclasses.fields(run_config):
        out.append(section_of(module, section_field.name, hints[section_field.name], missing))
        if section_field.name == "drafter":
            kinds = "; ".join(f"`{kind.name}`: {_one_line(kind.summary)}" for kind in KINDS.values())
            out[-1].doc += f" The kinds (`drafter.kind`): {kinds}."
            for kind in KINDS.values():
                if dataclasses.fields(kind.options):
                    out.append(section_of(module, f"drafter.{kind.name}", kind.options, missing))
    if missing:
        raise ConfigDocError("; ".join(missing))
    return out


def render(module: types.ModuleType) -> str:
    """The whole page for the config package ``module``."""
    all_sections = sections(module)
    lines = [
        "# Configuration",
        "",
        f"<!-- Written by `{COMMAND}` from common/config/: edit the docstrings there, then rerun it. -->",
        "",
        f"Generated from `common/config/` (one module per section) by `{COMMAND}`; `tests/test_config_docs.py`",
        "fails when this page differs from what the generator writes. Edit the field's docstring in its section's",
        "module and rerun it.",
        "",
        INTRO.replace("{presets}", ", ".join(f"`launch/{p.name}`" for p in sorted((ROOT / "launch").glob("*.toml")))),
        "",
        "## Who reads a field",
        "",
        "| reader | when |",
        "|---|---|",
        *(f"| {name} | {_one_line(when)} |" for name, when in module.READERS.items()),
        "",
        "Sections: " + ", ".join(f"[`{s.name}`](#{s.name.replace('.', '')})" for s in all_sections) + ".",
    ]
    for section in all_sections:
        lines += [
            "",
            f"## {section.name}",
            "",
            f"{section.doc} (`{section.class_name}`)",
            "",
            "| key | type | default | read by | restart-trainer | what |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| `{f.key}` | {f.type} | {f.default} | {', '.join(f.readers)} | {f.restart} | {f.doc} |"
            for f in section.fields
        ]
    return "\n".join(lines) + "\n"


def _rows(text: str) -> dict[str, str]:
    """Table rows of the page by dotted key."""
    return {match.group(1): line for line in text.splitlines() if (match := re.match(r"\| `([\w.]+)` \|", line))}


def differences(expected: str, actual: str) -> list[str]:
    """What differs between the page the generator writes (``expected``) and ``actual``, one line each."""
    if expected == actual:
        return []
    want, have = _rows(expected), _rows(actual)
    found = [f"missing: {key}" for key in want if key not in have]
    found += [f"not in common/config/: {key}" for key in have if key not in want]
    found += [f"differs: {key}" for key in want if key in have and want[key] != have[key]]
    rest = [
        line
        for line in difflib.unified_diff(
            [line for line in actual.splitlines() if not re.match(r"\| `[\w.]+` \|", line)],
            [line for line in expected.splitlines() if not re.match(r"\| `[\w.]+` \|", line)],
            lineterm="",
            n=0,
        )
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    found += [f"other text: {line}" for line in rest[:10]]
    found += [f"other text: {len(rest) - 10} more lines"] if len(rest) > 10 else []
    return found or ["the page differs (whitespace or order)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1, naming what differs, if the page is stale")
    parser.add_argument("--out", type=Path, default=DOC, help=f"the page (default {DOC.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    import common.config

    try:
        page = render(common.config)
    except ConfigDocError as exc:
        print(f"common/config/: {exc}", file=sys.stderr)
        return 1
    if args.check:
        found = differences(page, args.out.read_text() if args.out.exists() else "")
        for line in found:
            print(f"{args.out}: {line}", file=sys.stderr)
        if found:
            print(f"{args.out} is not what common/config/ gives: run {COMMAND}", file=sys.stderr)
        return 1 if found else 0
    args.out.write_text(page)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

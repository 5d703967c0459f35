"""Building a config from TOML and dotted overrides, and writing it back out."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .base import ConfigError
from .run import RunConfig

RETIRED_KEYS = {"training": ("stall_every_steps", "stall_s")}
"""Keys that earlier versions wrote into every run's config.toml and this one no longer has: a file's are dropped, so
that those runs resume (the training pause they set is now a benchmark's DFLASH_FAULT_DELAY, common/faults.py)."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the value (ints widened to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {value!r}")
        return build(tp, value, key)
    if tp is bool:
        if type(value) is not bool:
            raise ConfigError(f"{key}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if type(value) is not int:
            raise ConfigError(f"{key}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise ConfigError(f"{key}: must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if type(value) is not str:
            raise ConfigError(f"{key}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported annotation {tp}")


def unknown_key(cls: type, data: dict, prefix: str = "", nested: bool = False) -> str | None:
    """The error for the first key of ``data`` that dataclass ``cls`` has no field for, naming the closest known
    key (a typo's likely meaning); with ``nested`` the sections' keys too. None when every key is known."""
    if hasattr(cls, "from_table"):  # a section that reads sub-tables of its own (the drafter kind's options)
        try:
            data = cls.from_table(data, prefix)
        except ConfigError as exc:
            return str(exc)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(data) - known)
    if unknown:
        closest = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"did you mean {where}{closest[0]}? " if closest else ""
        return f"unknown key {where}{unknown[0]} ({hint}known keys{' of ' + prefix if prefix else ''}: {', '.join(sorted(known))})"
    hints = typing.get_type_hints(cls) if nested else {}
    for name, value in data.items() if nested else ():
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict):
            message = unknown_key(hints[name], value, f"{where}{name}", nested)
            if message:
                return message
    return None


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """Make dataclass ``cls`` from nested plain data; errors name the dotted key."""
    hints = typing.get_type_hints(cls)
    unknown = unknown_key(cls, data, prefix)
    if unknown:
        raise ConfigError(unknown)
    if hasattr(cls, "from_table"):
        data = cls.from_table(data, prefix)
    kwargs = {name: _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # Sections raise "<field>: message"; prefix it with the section's own key.
        # (a sub-table's message names its own key under the section already)
        named = str(exc).startswith((f"{prefix}.", f"unknown key {prefix}."))
        raise ConfigError(f"{prefix}.{exc}" if prefix and not named else str(exc)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as TOML, else taken as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig) -> Any:
    """Read a TOML file (or start from the defaults) and apply ``key=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        for section, keys in RETIRED_KEYS.items():
            for key in keys:
                if isinstance(data.get(section), dict):
                    data[section].pop(key, None)
        unknown = unknown_key(cls, data, nested=True)  # the file's own keys: a typo there names the file
        if unknown:
            raise ConfigError(f"{path}: {unknown}")
    return build(cls, apply_overrides(data, list(overrides or [])))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dotted_values(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf value of a config by its dotted key as a file writes it (``drafter.<kind>.<option>``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        name = getattr(cfg, f.metadata["table_named_by"]) if "table_named_by" in f.metadata else f.name
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            out.update(dotted_values(value, f"{key}."))
        else:
            out[key] = value
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(cfg: Any) -> str:
    """The config as TOML (None values are left out: they are the defaults' way of saying unset)."""
    lines: list[str] = []

    def section(obj: Any, name: str) -> None:
        # a sub-table named by another field (the drafter's options, by its kind) is written under that name
        scalars = [
            (
                getattr(obj, f.metadata["table_named_by"]) if "table_named_by" in f.metadata else f.name,
                getattr(obj, f.name),
            )
            for f in dataclasses.fields(obj)
        ]
        if name:
            lines.append(f"[{name}]")
        for key, value in scalars:
            if value is not None and not dataclasses.is_dataclass(value):
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for key, value in scalars:
            if dataclasses.is_dataclass(value) and dataclasses.fields(value):  # an empty table says nothing
                section(value, f"{name}.{key}" if name else key)

    section(cfg, "")
    return "\n".join(lines).lstrip("\n")


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)

"""Making a config dataclass from plain data (a TOML table): each value checked against its field's annotation, an
unknown key named with the closest known one. Every section builds its sub-tables through it, the drafter kinds'
option tables among them."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

from .base import ConfigError


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

"""Building a config from TOML and dotted overrides, and writing it back out."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from .base import ConfigError
from .build import build, unknown_key
from .run import RunConfig

RETIRED_KEYS = {"training": ("stall_every_steps", "stall_s")}
"""Keys that earlier versions wrote into every run's config.toml and this one no longer has: a file's are dropped, so
that those runs resume (the training pause they set is now a benchmark's DFLASH_FAULT_DELAY, common/faults.py)."""


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

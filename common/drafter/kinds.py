"""The kinds table: every drafter kind this installation knows, by name (common/drafter/kind.py says what a kind is).

The built-in kinds are one line each below. A kind from outside the repository is a module that defines ``KIND``
(a ``DrafterKind``), named in the environment variable DFLASH_DRAFTER_KINDS (comma-separated module names; every
process of a run inherits it) or installed under the entry-point group ``dflash_stream.drafter_kinds``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping
from importlib.metadata import entry_points

from common.drafter.dflash import KIND as DFLASH
from common.drafter.dflash2 import KIND as DFLASH2
from common.drafter.dspark import KIND as DSPARK
from common.drafter.kind import DrafterKind
from common.drafter.lilicorr import KIND as LILICORR

PLUGINS_ENV = "DFLASH_DRAFTER_KINDS"
ENTRY_POINT_GROUP = "dflash_stream.drafter_kinds"


class KindTable(Mapping[str, DrafterKind]):
    """The kinds by name: the built-in ones, and the plugins, imported on the first lookup rather than with this
    module, since a plugin's module may import the drafter code, which reads this table."""

    def __init__(self, builtin: tuple[DrafterKind, ...]) -> None:
        self._kinds = {kind.name: kind for kind in builtin}
        self._plugins_loaded = False

    def _all(self) -> dict[str, DrafterKind]:
        if not self._plugins_loaded:
            self._plugins_loaded = True
            self._load_plugins()
        return self._kinds

    def _load_plugins(self) -> None:
        modules = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
        found = [importlib.import_module(name).KIND for name in modules]
        found += [entry.load() for entry in entry_points(group=ENTRY_POINT_GROUP)]
        for kind in found:
            if not isinstance(kind, DrafterKind):
                raise TypeError(f"{PLUGINS_ENV} / {ENTRY_POINT_GROUP}: {kind!r} is not a DrafterKind")
            if kind.name in self._kinds and self._kinds[kind.name] is not kind:
                raise ValueError(f"drafter kind {kind.name!r} is defined twice")
            self._kinds[kind.name] = kind

    def __getitem__(self, name: str) -> DrafterKind:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


KINDS = KindTable((DFLASH, DFLASH2, DSPARK, LILICORR))


def kind_of(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ValueError(f"drafter kind must be one of {sorted(KINDS)}, got {name!r}")
    return KINDS[name]


def kind_of_export(config_json: dict) -> DrafterKind | None:
    """The kind an exported config.json of either format describes (None: neither format's)."""
    speculators_type = config_json.get("speculators_model_type")
    architectures = config_json.get("architectures") or []
    for kind in KINDS.values():
        if speculators_type == kind.speculators_type or (
            speculators_type is None and kind.zlab_architecture in architectures
        ):
            return kind
    return None

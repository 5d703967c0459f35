"""The kinds table: every drafter kind this installation knows, by name (common/drafter/kind.py says what a kind is).

The built-in kinds are one line each below. A kind from outside the repository is a module that defines ``KIND``
(a ``DrafterKind``), named in the environment variable DFLASH_DRAFTER_KINDS (comma-separated module names; every
process of a run inherits it) or installed under the entry-point group ``dflash_stream.drafter_kinds``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from common.drafter.dflash import KIND as DFLASH
from common.drafter.dflash2 import KIND as DFLASH2
from common.drafter.dspark import KIND as DSPARK
from common.drafter.kind import DrafterKind
from common.drafter.lilicorr import KIND as LILICORR

if TYPE_CHECKING:
    import torch

    from common.drafter.base import Drafter
    from common.drafter.draft_config import DraftConfig
    from common.drafter.loss import LossConfig
    from common.drafter.target_head import TargetHead

PLUGINS_ENV = "DFLASH_DRAFTER_KINDS"
ENTRY_POINT_GROUP = "dflash_stream.drafter_kinds"

KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in (DFLASH, DFLASH2, DSPARK, LILICORR)}


def _load_plugins() -> None:
    modules = [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]
    found = [importlib.import_module(name).KIND for name in modules]
    found += [entry.load() for entry in entry_points(group=ENTRY_POINT_GROUP)]
    for kind in found:
        if not isinstance(kind, DrafterKind):
            raise TypeError(f"{PLUGINS_ENV} / {ENTRY_POINT_GROUP}: {kind!r} is not a DrafterKind")
        if kind.name in KINDS and KINDS[kind.name] is not kind:
            raise ValueError(f"drafter kind {kind.name!r} is defined twice")
        KINDS[kind.name] = kind


_load_plugins()


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


def build_drafter(
    config: DraftConfig,
    target_head: TargetHead,
    loss_config: LossConfig | None = None,
    attention_backend: str | None = None,
    device: torch.device | None = None,
) -> Drafter:
    """A fresh drafter of ``config.kind`` (built on ``device`` when given)."""
    import torch

    with torch.device(device) if device is not None else contextlib.nullcontext():
        return kind_of(config.kind).model_class()(config, target_head, loss_config, attention_backend)

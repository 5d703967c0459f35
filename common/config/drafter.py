"""The ``[drafter]`` section: the drafter's kind and shape."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from common.drafter.kind import DEFAULT_KIND

from .base import ConfigError, require
from .build import build


@dataclass
class DrafterConfig:
    """The drafter's shape. Unset sizes come from the target (docs/dflash.md); set ones override it."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "num_layers": "producer checkpoint",
        "target_layer_ids": "producer checkpoint",
        "num_anchors": "producer trainer",
        "block_size": "checkpoint",
        "layer_types": "checkpoint",
        "sliding_window": "checkpoint",
        "in_block_causality": "checkpoint",
        "mask_token_id": "checkpoint",
        "intermediate_size": "checkpoint",
        "num_attention_heads": "checkpoint",
        "num_key_value_heads": "checkpoint",
        "kind": "producer checkpoint",
        "init_from": "trainer",
        "options": "checkpoint trainer",
    }

    kind: str = DEFAULT_KIND
    """The drafter kind, one of the kinds table's (common/drafter/kinds.py; listed below with their options). A
    checkpoint resumes only as its own kind."""
    num_layers: int = 5
    """Number of draft decoder layers."""
    block_size: int = 16
    """Tokens per draft block B (slot 0 given, B - 1 predicted)."""
    num_anchors: int = 512
    """Blocks sampled per packed batch of ``batching.token_budget`` tokens: shared by its documents in proportion to
    their supervised tokens, and spread evenly over each. Raise it with token_budget to keep anchors per token."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Target layers (0-based, output of layer k) used as features; empty: the docs/dflash.md rule."""
    layer_types: list[str] = field(default_factory=list)
    """Per draft layer: full_attention or sliding_attention; empty: all full."""
    sliding_window: int | None = None
    """Window of sliding-attention layers: a slot sees keys fewer than this many positions away, in the
    context and in its own block. Their cost per block follows the window, not the document's length."""
    in_block_causality: Literal["sliding_causal", "bidirectional", "causal"] = "sliding_causal"
    """Which layers see only the earlier slots of their own block: sliding_causal (sliding layers causal,
    full layers bidirectional: what vLLM, SGLang and speculators serve by default, and how the released
    mixed drafts were trained), bidirectional (every layer) or causal (every layer). The export states it."""
    mask_token_id: int | None = None
    """Id of the mask token; None: from the target's tokenizer, else the last id of the vocabulary."""
    intermediate_size: int | None = None
    """MLP width; None: the target's."""
    num_attention_heads: int | None = None
    """Query heads; None: the target's."""
    num_key_value_heads: int | None = None
    """Key/value heads; None: the target's."""
    init_from: str | None = None
    """A DFlash or DFlash 2 checkpoint (checkpoints/step-N) or export to start a new run's drafter from: its
    weights are loaded; a kind that extends another (its ``warm_starts_from``) starts from that kind's drafter with
    its additions at their no-op values, so it first proposes exactly what that drafter did. Read at a fresh start
    only, never at a resume."""
    options: Any = field(default=None, metadata={"table_named_by": "kind"})
    """The kind's own options: the ``[drafter.<kind>]`` table, written below per kind.
    Runs saved before the tables wrote them flat in ``[drafter]``, which is read too."""

    def __post_init__(self) -> None:
        require(self.num_layers >= 1, "num_layers", "must be >= 1")
        from common.drafter.kinds import KINDS

        require(self.kind in KINDS, "kind", f"must be one of {sorted(KINDS)}, got {self.kind!r}")
        options_type = KINDS[self.kind].options
        if self.options is None or isinstance(self.options, dict):
            self.options = build(options_type, dict(self.options or {}), f"drafter.{self.kind}")
        require(
            isinstance(self.options, options_type), f"drafter.{self.kind}", f"must be a table, got {self.options!r}"
        )
        require(self.block_size >= 2, "block_size", "must be >= 2")
        require(self.num_anchors >= 1, "num_anchors", "must be >= 1")
        require(all(k >= 0 for k in self.target_layer_ids), "target_layer_ids", "must be >= 0")
        require(
            not self.layer_types or len(self.layer_types) == self.num_layers,
            "layer_types",
            f"needs one entry per layer ({self.num_layers}), got {len(self.layer_types)}",
        )
        require(
            all(t in ("full_attention", "sliding_attention") for t in self.layer_types),
            "layer_types",
            "entries must be full_attention or sliding_attention",
        )
        require(
            self.in_block_causality in ("sliding_causal", "bidirectional", "causal"),
            "in_block_causality",
            f"must be sliding_causal, bidirectional or causal, got {self.in_block_causality!r}",
        )
        if "sliding_attention" in self.layer_types:
            require(
                self.sliding_window is not None and self.sliding_window >= 1,
                "sliding_window",
                "must be set (>= 1) for sliding layers",
            )

    def draft_overrides(self) -> dict[str, Any]:
        """The DraftConfig fields this section sets (``DraftConfig.from_target`` derives the rest from the target):
        the one mapping of the trainer's drafter and of what ``check`` describes."""
        overrides: dict[str, Any] = {
            name: getattr(self, name) for name in ("block_size", "in_block_causality", "kind", "options")
        }
        for name in ("target_layer_ids", "layer_types"):
            if getattr(self, name):
                overrides[name] = list(getattr(self, name))
        for name in ("sliding_window", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        return overrides

    @classmethod
    def from_table(cls, data: dict[str, Any], prefix: str) -> dict[str, Any]:
        """The section's fields from its TOML table. The kind's options come from its ``[drafter.<kind>]`` table, or
        flat in the section as runs saved before the tables wrote them; flat options of another kind, which those
        runs wrote at their defaults, are dropped where they still hold those defaults, and so is another kind's table
        at its defaults. A table or an option of another kind set otherwise is an error naming it."""
        from common.drafter.kinds import KINDS

        data = dict(data)
        name = data.get("kind", DEFAULT_KIND)
        if name not in KINDS:
            raise ConfigError(f"{prefix}.kind: must be one of {sorted(KINDS)}, got {name!r}")
        for other in KINDS:
            if other != name and other in data:
                table = data[other]
                defaults = KINDS[other].options()
                if isinstance(table, dict) and all(getattr(defaults, k, object()) == v for k, v in table.items()):
                    del data[other]  # a saved run's table at its defaults, the run now asked to be another kind
                    continue
                raise ConfigError(
                    f"{prefix}.{other}: options of the {other} kind given to a {name} drafter ({prefix}.kind = "
                    f"{name!r}); remove the table, or set {prefix}.kind = {other!r}"
                )
        table = data.pop(name, None)
        if "options" in data:  # the section as dataclasses.asdict writes it
            table = {**data.pop("options"), **(table or {})}
        if table is not None and not isinstance(table, dict):
            raise ConfigError(f"{prefix}.{name}: must be a table, got {table!r}")
        options = dict(table or {})
        own = {f.name for f in fields(cls)}
        for key in [k for k in data if k not in own]:
            if key in KINDS[name].options.names():
                if key in options and options[key] != data[key]:
                    raise ConfigError(f"{prefix}.{key}: given both flat and as {prefix}.{name}.{key}")
                options[key] = data.pop(key)
                continue
            owner = next((kind for kind in KINDS.values() if key in kind.options.names()), None)
            if owner is not None:
                if data[key] != getattr(owner.options(), key):
                    raise ConfigError(
                        f"{prefix}.{key}: an option of the {owner.name} kind, given to a {name} drafter "
                        f"({prefix}.kind = {name!r})"
                    )
                del data[key]
        data["options"] = options
        return data

    @classmethod
    def table_readers(cls, table: str, name: str) -> set[str]:
        """Who reads ``name`` of the kind table ``table`` (its options' ``READ_BY``)."""
        from common.drafter.kinds import kind_of

        return set(kind_of(table).options.READ_BY[name].split())

"""What a drafter kind is: its options (``KindOptions``, the ``[drafter.<kind>]`` table) and its line of the kinds
table (``DrafterKind``: its head on the DFlash backbone and its names in the serving formats).

A kind is one module or package under common/drafter/ (or outside the repository, named in DFLASH_DRAFTER_KINDS or
installed under the entry-point group ``dflash_stream.drafter_kinds``; common/drafter/kinds.py loads them) that
defines a ``KindOptions`` subclass, a head (``common.drafter.head.KindHead``: what it adds to the objective, to a
proposal and to the parameters of the DFlash backbone), and ``KIND``, one ``DrafterKind``. Nothing outside the kind names its options: the trainer, the producers, the evaluator, ``check``,
export and the config docs read them through these two classes.

This module imports no torch: the configuration (common/config/) reads the options through it in every process.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

DEFAULT_KIND = "dflash"
"""The kind of a run that names none, and of an export written before config.json named its kind."""


class DraftShape(Protocol):
    """What a kind's hooks read of a drafter's config (a ``common.drafter.draft_config.DraftConfig``)."""

    hidden_size: int
    vocab_size: int
    block_size: int
    options: KindOptions


@dataclass
class KindOptions:
    """A kind's own options, the fields of its ``[drafter.<kind>]`` table (a docstring per field, as every section).

    ``READ_BY`` names each field's readers as the config sections do: "checkpoint" fields shape the drafter (they are
    written into its checkpoint and exports, and fixed by them); "trainer" fields shape only its training, and a
    restart-trainer may change them. ``__post_init__`` validates what can be checked without the target (raising
    ``common.config.ConfigError`` naming the field), ``resolved`` derives the defaults that depend on the drafter's
    shape, and ``check_shape`` checks what needs that shape too.
    """

    READ_BY: ClassVar[dict[str, str]] = {}

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def shape(self) -> dict[str, Any]:
        """The fields that shape the drafter (read by "checkpoint"), as written into its config.json."""
        return {name: getattr(self, name) for name in self.names() if "checkpoint" in self.READ_BY[name].split()}

    def export_fields(self) -> dict[str, Any]:
        """What config.json says of the kind in either format: its shape fields, and constants its servers read."""
        return self.shape()

    def with_shape(self, shape: dict[str, Any]) -> KindOptions:
        """These options with the shape fields of ``shape`` (a checkpoint's) in place of this run's."""
        return dataclasses.replace(self, **{k: v for k, v in shape.items() if k in self.names()})

    def check_run(self, run: Any) -> None:
        """ConfigError naming the key where another section of the run (a ``RunConfig``) contradicts the kind."""

    def resolved(self, config: DraftShape) -> KindOptions:
        """These options with every default that depends on the drafter's shape (a field left None, such as a rank
        bounded by the vocabulary) derived from it; the drafter's config holds these, so its checkpoint and exports
        name concrete values. The run's own options are left as given."""
        return self

    def check_shape(self, config: DraftShape) -> None:
        """ValueError where the options do not fit the drafter's shape (its hidden size, vocabulary, block)."""

    def describe(self, config: DraftShape) -> str:
        """One line for ``check``: what the kind adds to the DFlash backbone, in this drafter's sizes ("" for none)."""
        return ""


@dataclass(frozen=True, kw_only=True)
class DrafterKind:
    """One line of the kinds table: a kind's name, options, head and its names in the serving formats. A row states
    what its kind has of its own; every field with a default says what a kind that leaves it out is."""

    name: str
    """``drafter.kind``, ``DraftConfig.kind`` and the name of its ``[drafter.<name>]`` table."""
    options: type[KindOptions]
    """The kind's options class."""
    zlab_architecture: str
    """config.json ``architectures`` of z-lab's format (vLLM method "dflash", SGLang)."""
    speculators_type: str = ""
    """config.json ``speculators_model_type`` of the speculators format ("": the kind's name)."""
    speculators_architecture: str
    """config.json ``architectures`` of the speculators format."""
    step_memory_factor: float
    """Its training step's activations over DFlash's at equal shapes (what its own modules keep for the backward),
    measured on a GPU where it can be: the kinds benchmark sizes its rows to the card with it."""
    speculators_sliding_non_causal: bool = False
    """What speculators assumes of ``sliding_window_non_causal`` when a config of this kind leaves it out."""
    summary: str = ""
    """What the kind is, in a sentence (``drafter.kind``'s documentation lists them)."""
    vllm_method: str | None = None
    """vLLM's ``--speculative-config`` method for the z-lab export (None: vLLM does not serve it)."""
    sglang_algorithm: str | None = None
    """SGLang's ``--speculative-algorithm`` (None: SGLang does not serve it)."""
    llamacpp_spec_type: str | None = None
    """llama-server's ``--spec-type`` for a draft GGUF of this kind (None: llama.cpp does not serve it)."""
    vllm_cpu: bool = False
    """vLLM's CPU build serves it."""
    llamacpp_format: str = "zlab"
    """The export format llama.cpp's converter reads for this kind (its tensor names and config keys)."""
    llamacpp_refusal: Callable[[DraftShape], str | None] | None = None
    """Why llama.cpp would refuse to load a drafter of this kind with this config (None: it loads it)."""
    full_vocabulary: bool = False
    """The kind's own tables span the target's whole vocabulary: a target whose head was cut below its tokenizer
    cannot have one."""
    needs_final_hidden: bool = False
    """Its objective reads the target's distribution, so the producers ship the target's final hidden state."""
    head: str | None = None
    """What the kind adds to the DFlash backbone, a ``common.drafter.head.KindHead`` as ``module:Class`` (imported on
    first use: the configuration needs no torch); None: the backbone alone (DFlash)."""
    warm_starts_from: tuple[str, ...] = ()
    """Other kinds whose weights start a drafter of this kind (``Drafter.warm_start``), besides its own."""

    def __post_init__(self) -> None:
        if not self.speculators_type:
            object.__setattr__(self, "speculators_type", self.name)  # frozen: set once, here
        if not self.step_memory_factor >= 1.0:
            raise ValueError(
                f"drafter kind {self.name!r}: step_memory_factor must be >= 1.0 (DFlash's step is the least a kind "
                f"keeps), got {self.step_memory_factor!r}"
            )

    def head_class(self) -> type | None:
        """The kind's ``common.drafter.head.KindHead`` subclass (None: DFlash's backbone alone)."""
        if self.head is None:
            return None
        module, _, name = self.head.partition(":")
        return getattr(importlib.import_module(module), name)

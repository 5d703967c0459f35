"""The whole run's config (``RunConfig``, one field per section) and who reads each key."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from .base import require
from .batching import BatchingConfig
from .data import DataConfig
from .drafter import DrafterConfig
from .eval import EvalConfig
from .launch import LaunchConfig
from .logging import LoggingConfig
from .ring import RingConfig
from .synthesize import SynthesizeConfig
from .target import TargetConfig
from .training import TrainingConfig


@dataclass
class RunConfig:
    """Everything about one run."""

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    ring: RingConfig = field(default_factory=RingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    synthesize: SynthesizeConfig = field(default_factory=SynthesizeConfig)

    def __post_init__(self) -> None:
        require(
            self.batching.token_budget >= self.data.max_seq_len,
            "batching.token_budget",
            f"must be >= data.max_seq_len ({self.data.max_seq_len}) so every document fits a slot",
        )
        require(
            self.eval.every_steps % self.logging.log_every == 0,
            "eval.every_steps",
            f"must be a multiple of logging.log_every ({self.logging.log_every}), got {self.eval.every_steps}",
        )
        self.drafter.options.check_run(self)

    @property
    def ships_final_hidden(self) -> bool:
        """The producers ship the target's final hidden state: for soft or target labels, or a kind whose objective
        reads the target's distribution."""
        from common.drafter.kinds import kind_of

        return self.training.labels_from_target or kind_of(self.drafter.kind).needs_final_hidden


def readers(key: str) -> set[str]:
    """Who reads ``section.field`` (its section's ``READ_BY``)."""
    section, _, name = key.partition(".")
    section_type = typing.get_type_hints(RunConfig)[section]
    table, _, inner = name.partition(".")
    if inner:  # a section's own sub-table (the drafter kind's options)
        return section_type.table_readers(table, inner)
    return set(section_type.READ_BY[name].split())


def fixed_while_producers_run(key: str) -> bool:
    """Whether restart-trainer must refuse a change of ``key``: a producer or the checkpoint holds its value."""
    return bool(readers(key) & {"producer", "checkpoint"})

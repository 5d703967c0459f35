"""The run's configuration: one typed tree of dataclasses, loaded from TOML plus dotted overrides.

    cfg = load_config("run.toml", ["training.lr=3e-4", "launch.num_producers=2"])
    save_config(cfg, run_dir / "config.toml")   # the resolved config, every value written out

One module per TOML section (``target.py`` holds ``[target]``, and so on), ``run.py`` for the whole tree and
who reads each key, ``load.py`` for reading and writing TOML. Every field has a docstring (the string under
it), its section names its readers in ``READ_BY``, and each section validates itself in ``__post_init__``.
Errors name the dotted key (``training.lr: must be > 0``); unknown keys are errors, never silently ignored.
"""

from .base import READERS, ConfigError
from .batching import BatchingConfig
from .build import build, unknown_key
from .data import DataConfig
from .drafter import DrafterConfig
from .eval import EvalConfig
from .launch import LaunchConfig
from .load import (
    apply_overrides,
    dotted_values,
    load_config,
    parse_override,
    save_config,
    to_dict,
    to_toml,
)
from .logging import LoggingConfig
from .ring import RingConfig
from .run import RunConfig, fixed_while_producers_run, readers
from .synthesize import SynthesizeConfig
from .target import TargetConfig, resolve_model_path
from .training import TrainingConfig

__all__ = [
    "READERS",
    "BatchingConfig",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "EvalConfig",
    "LaunchConfig",
    "LoggingConfig",
    "RingConfig",
    "RunConfig",
    "SynthesizeConfig",
    "TargetConfig",
    "TrainingConfig",
    "apply_overrides",
    "build",
    "fixed_while_producers_run",
    "load_config",
    "parse_override",
    "readers",
    "resolve_model_path",
    "save_config",
    "to_dict",
    "dotted_values",
    "to_toml",
    "unknown_key",
]

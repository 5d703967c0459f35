"""The ``[logging]`` section: metrics, wandb and the log cadence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from .base import require


@dataclass
class LoggingConfig:
    """What the trainer reports and where."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "log_every": "trainer",
        "wandb_mode": "trainer",
        "wandb_project": "trainer",
        "progress": "launcher",
    }

    log_every: int = 10
    """Steps between metric lines (metrics.jsonl, wandb, progress line)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes the run under <run dir>/wandb for a later ``wandb sync``."""
    wandb_project: str = "dflash"
    """wandb project name."""
    progress: bool = True
    """A live progress line on the terminal."""

    def __post_init__(self) -> None:
        require(self.log_every >= 1, "log_every", "must be >= 1")
        require(
            self.wandb_mode in ("offline", "online", "disabled"),
            "wandb_mode",
            f"must be offline, online or disabled, got {self.wandb_mode!r}",
        )

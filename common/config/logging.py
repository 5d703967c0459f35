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
        "profile_steps": "trainer",
        "profile_after": "trainer",
    }

    log_every: int = 10
    """Steps between metric lines (metrics.jsonl, wandb, progress line)."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes the run under <run dir>/wandb for a later ``wandb sync``."""
    wandb_project: str = "dflash"
    """wandb project name."""
    progress: bool = True
    """A live progress line on the terminal."""
    profile_steps: int = 0
    """Steps of the run traced by torch.profiler (0: none): logs/trainer-profile.txt says per step how long the
    device was busy against the wall time, the kernels launched and the host reads of device values, then the
    operators and kernels by time and by calls; trainer.log has the summary's line."""
    profile_after: int = 200
    """Steps a trainer trains before its profile starts (counted from its start, a resumed one's too): past
    compilation and the rings' filling, so the profile shows the run's steady step."""

    def __post_init__(self) -> None:
        require(self.log_every >= 1, "log_every", "must be >= 1")
        require(self.profile_steps >= 0, "profile_steps", f"must be >= 0, got {self.profile_steps}")
        require(self.profile_after >= 0, "profile_after", f"must be >= 0, got {self.profile_after}")
        require(
            self.wandb_mode in ("offline", "online", "disabled"),
            "wandb_mode",
            f"must be offline, online or disabled, got {self.wandb_mode!r}",
        )

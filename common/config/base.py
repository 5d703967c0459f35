"""What every section shares: the error that names a key, the check that raises it, and the readers a field names."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the dotted key."""


def require(condition: bool, key: str, message: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


READERS = {
    "producer": "a producer, at its start: fixed while the producers run",
    "trainer": "the trainer, at its start: restart-trainer may change it",
    "launcher": "the launcher, as it goes (launch.*) or for a command (check, the progress view)",
    "checkpoint": "fixed by the drafter's first checkpoint: the drafter's shape and layout",
}
"""The readers a config field names in its section's ``READ_BY`` (every field names at least one)."""

"""The ``[synthesize]`` section: the target writing its own training data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from .base import require


@dataclass
class SynthesizeConfig:
    """On-policy data: the producers' target writes the answers (``launch/run_all.sh synthesize``,
    producer/synthesize.py) as OpenAI-format JSONL shards that ``data.format = "chat"`` reads."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "prompts": "producer",
        "num_magpie": "producer",
        "output_dir": "producer launcher",
        "max_new_tokens": "producer",
        "temperature": "producer",
        "top_p": "producer",
        "seed": "producer",
        "enable_thinking": "producer",
        "magpie_max_tokens": "producer",
        "magpie_temperature": "producer",
        "magpie_top_p": "producer",
        "magpie_system_prompts": "producer",
        "rows": "producer",
        "max_prompt_tokens": "producer",
        "records_per_shard": "producer",
        "flush_every_s": "producer",
        "turns": "producer launcher",
        "magpie_turns": "producer",
        "max_conversation_tokens": "producer",
    }

    prompts: Literal["data", "magpie", "both"] = "data"
    """Whose prompts the target answers: "data" (the user turns of data.paths, chat records, their assistant turns
    regenerated), "magpie" (num_magpie prompts the target writes itself from its chat template's user prefix,
    arXiv 2406.08464) or "both"."""
    num_magpie: int = 0
    """Self-written prompts (ids magpie:0 .. num_magpie - 1) for prompts = "magpie" or "both"."""
    output_dir: str = ""
    """Folder of the JSONL shards; empty: RUN/synthesized."""
    max_new_tokens: int = 1024
    """Longest answer in tokens (a longer one is cut and recorded with stop_reason "length")."""
    temperature: float = 0.0
    """Of the answers; 0: greedy, the target's own most likely text (what greedy speculative decoding meets)."""
    top_p: float = 1.0
    """Nucleus sampling of the answers (with temperature > 0)."""
    seed: int = 0
    """Seed of the sampling."""
    enable_thinking: bool | None = None
    """Passed to the chat template where it has a thinking switch (Qwen3); None: the template's default."""
    magpie_max_tokens: int = 128
    """Longest self-written prompt in tokens."""
    magpie_temperature: float = 1.0
    """Sampling of the self-written prompts (Magpie samples them; greedy would write one prompt over and over)."""
    magpie_top_p: float = 0.95
    """Nucleus sampling of the self-written prompts."""
    magpie_system_prompts: list[str] = field(default_factory=list)
    """System prompts that steer what the target asks, taken in turn: magpie:n writes its prompt under the
    (n mod k)-th, "" being the template's default (Magpie's domain prompts: a code assistant's makes it ask for
    code). The answer is written under the template's default, as an evaluation's prompts are. Empty: the default."""
    rows: int = 256
    """Sequences each producer decodes at once (its static KV cache holds rows x (max_prompt_tokens + max_new_tokens));
    a cache larger than 90% of the device's available memory stops the run (exit 2) saying how many rows fit."""
    max_prompt_tokens: int = 2048
    """Longest prompt (chat-rendered) answered; a longer one is recorded as skipped, so it is not tried again."""
    records_per_shard: int = 1000
    """Records per shard file: a shard is written whole (temporary name, fsync, rename) once it has this many."""
    flush_every_s: float = 60.0
    """A shard is also written after this many seconds with what is done: what a kill -9 can lose (and redo)."""
    turns: Literal["last", "all"] = "last"
    """Which assistant turns of a data record the target writes, in synthesis and in data.regenerate alike: "last"
    (the record up to its last user turn, answered once) or "all" (every assistant turn in order, each conditioned on
    the target's own earlier ones; user turns and tool results stay as recorded; the target's tool calls are
    regenerated, and a conversation whose call differs from the recorded one ends after that call;
    docs/conversations.md)."""
    magpie_turns: int = 1
    """User turns of a self-written (Magpie) conversation: after each answer the target also writes the next user
    turn from the template's user prefix after the conversation so far, then answers it."""
    max_conversation_tokens: int = 0
    """New tokens the target may write in one conversation (all its turns, self-written user turns included); the
    conversation ends after the turn that reaches it (recorded as cut). 0: no cap beyond max_new_tokens per turn."""

    def __post_init__(self) -> None:
        require(
            self.prompts in ("data", "magpie", "both"), "prompts", f"must be data, magpie or both, got {self.prompts!r}"
        )
        require(self.turns in ("last", "all"), "turns", f"must be last or all, got {self.turns!r}")
        require(self.magpie_turns >= 1, "magpie_turns", f"must be >= 1, got {self.magpie_turns}")
        require(
            self.max_conversation_tokens >= 0,
            "max_conversation_tokens",
            f"must be >= 0 (0: no cap), got {self.max_conversation_tokens}",
        )
        require(self.num_magpie >= 0, "num_magpie", f"must be >= 0, got {self.num_magpie}")
        require(
            self.prompts == "data" or self.num_magpie >= 1, "num_magpie", f"must be >= 1 for prompts={self.prompts!r}"
        )
        for name in ("max_new_tokens", "magpie_max_tokens", "rows", "max_prompt_tokens", "records_per_shard"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("temperature", "magpie_temperature"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("top_p", "magpie_top_p"):
            require(0 < getattr(self, name) <= 1, name, f"must be in (0, 1], got {getattr(self, name)}")
        require(self.seed >= 0, "seed", "must be >= 0")
        require(self.flush_every_s > 0, "flush_every_s", f"must be > 0, got {self.flush_every_s}")

    def folder(self, run_root: Path) -> Path:
        """Where the shards of the run at ``run_root`` go: output_dir, else RUN/synthesized."""
        return Path(self.output_dir) if self.output_dir else run_root / "synthesized"

"""The ``[eval]`` section: evaluation of the drafter against the target in producer 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .base import require


@dataclass
class EvalConfig:
    """Acceptance evaluation by real speculative decoding against the target (producer/acceptance/ runs it; the
    arithmetic is common/acceptance/'s)."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "every_steps": "trainer",
        "num_prompts": "producer",
        "max_new_tokens": "producer",
        "producer_share": "producer",
        "batch_prompts": "producer",
        "reference_cache_gb": "producer",
        "prompt_len": "producer",
        "paths": "producer",
        "gap_tolerance": "trainer",
        "temperature": "producer",
        "top_p": "producer",
        "top_k": "producer",
        "seed": "producer",
        "length_buckets": "producer",
        "every_turn": "producer",
        "max_turns": "producer",
        "timing_repeats": "producer",
        "confidence_min": "producer",
    }

    every_steps: int = 0
    """Evaluate every this many optimizer steps (trainer rank 0; eval/* lines in metrics.jsonl); 0: never.
    A multiple of logging.log_every, so the evaluation follows a metrics line and stays out of its throughput."""
    num_prompts: int = 8
    """Held-out documents whose prompts are decoded (and whose teacher-forced tau is the simulated one)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt (fewer when the target emits its end-of-sequence token). Any count: z-lab's
    published figures decode 2048."""
    producer_share: float = 0.25
    """Most of producer 0's time its evaluations take during training: after one of E seconds it makes batches for
    E * (1 - share) / share seconds before the next, and of the requests that came meanwhile only the newest is
    evaluated (the others are logged as skipped); the last step's, asked once training has ended, is taken at once. On a GPU it shares with the trainer an evaluation runs slower than
    alone, and one every few steps would otherwise stop the producer for good. 1: every request, oldest first."""
    batch_prompts: int = 16
    """Prompts drafted together: one drafter forward drafts a block for each (each keeps exactly what it keeps
    alone), and, where the target allows (no Gated-DeltaNet or sliding-window layers), one target forward extends
    their greedy continuations when the evaluator makes its reference, or verifies their blocks when it decodes
    sampled. 1: one prompt at a time."""
    reference_cache_gb: float = 8.0
    """Host memory the evaluator may keep the held-out documents' target features in between evaluations (page-
    locked on a GPU host), so that an evaluation after the first runs no target forward. Documents past it run
    through the target at every evaluation. The prompts' greedy continuations and their features are always kept."""
    prompt_len: int = 0
    """Prompt of a held-out document: its first prompt_len tokens; 0: the tokens before its first
    supervised token (the prompt turn of chat data)."""
    paths: list[str] = field(default_factory=list)
    """Held-out files in data.format; empty: synthetic data holds out the documents after data.num_samples, other
    data holds out num_prompts of its own records (at most a tenth of them), drawn by a fixed seed and
    data.shuffle_seed and never trained on (``check`` says how many)."""
    gap_tolerance: float = 0.3
    """Largest |real - simulated tau| without a warning, as a fraction of the most a block can gain
    (B - 1). The tiny default ends at 0.15-0.2 (real 1.9-2.0, simulated 2.45-2.5 of B = 4): real
    decoding meets more blocks where the drafter fails early, and its random target's text is not the data."""
    temperature: float = 0.0
    """0: greedy speculative decoding (the replay of the target's greedy text, fast). Above 0: sampled speculative
    decoding, lossless by rejection sampling (each draft token kept with probability min(1, p/q), a rejected one
    replaced by a draw from max(0, p - q), a bonus token from p), live, batch_prompts at a time: p is the target's
    distribution after this temperature, ``top_p`` and ``top_k``, q the drafter's proposal (DFlash: its logits
    through the same sampler; DFlash 2: its selector's softmax over its candidates). The simulated tau stays
    teacher-forced, and the two figures on the greedy text (sim_tau_greedy, sim_tau_walk) are left out."""
    top_p: float = 1.0
    """Nucleus sampling of the target and of a DFlash drafter (with temperature > 0): the smallest set of most likely
    tokens whose mass reaches top_p; 1: all."""
    top_k: int = 0
    """The top_k most likely tokens only (with temperature > 0), for the target and a DFlash drafter; 0: all."""
    seed: int = 0
    """Seed of sampled decoding (with temperature > 0): prompt i draws from its own generator seeded by seed and i,
    so an evaluation is reproducible and every evaluation of a run draws the same way."""
    length_buckets: list[int] = field(default_factory=lambda: [2048, 8192, 32768])
    """Edges in tokens of the context-length buckets that tau and per-position acceptance are also reported by
    (eval/tau_by_length/<bucket>; ``launch.evaluate --by-length`` prints the table): [2048, 8192, 32768] gives
    0-2K, 2K-8K, 8K-32K and 32K+. A verify forward counts in the bucket of its context: the prompt and the tokens
    generated before its block. Empty: one bucket of every length."""
    every_turn: bool = True
    """Evaluate a multi-turn held-out record at each of its assistant turns (each a maximal run of supervised
    tokens), the prompt being the conversation up to that turn, so the context grows as in a real conversation;
    false: its first assistant turn only. With prompt_len > 0 a record is one prompt either way. A record whose
    turns do not alternate is skipped and counted (eval/skipped_records, with its file:line in the log)."""
    max_turns: int = 8
    """Most assistant turns evaluated per record (with every_turn), spread evenly from its first to its last; 0:
    all. Each turn is a prompt whose greedy continuation and features the evaluator keeps, so a long agentic
    trace of dozens of turns would otherwise multiply the evaluation's memory and time by as many."""
    timing_repeats: int = 5
    """Timed repeats (after one warm-up) of the draft forward, the target's verify forward of one block and its
    one-token decode forward at each bucket's context, for the break-even tau (docs/evaluation.md); the fastest
    counts (other work on the machine only adds time). The target is timed once, with its reference; the drafter once per architecture. 0: no timing."""

    confidence_min: float = 0.0
    """A drafter whose proposals carry a confidence per draft has only its drafts before the first whose confidence is below this
    verified, as llama.cpp's ``--spec-draft-p-min`` cuts a block; 0: every draft. The report gives tau and the drafts
    verified per accepted draft with the cut and without it."""

    def __post_init__(self) -> None:
        require(0.0 <= self.confidence_min <= 1.0, "confidence_min", f"must lie in [0, 1], got {self.confidence_min}")
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        require(
            all(isinstance(edge, int) and edge > 0 for edge in self.length_buckets)
            and all(a < b for a, b in zip(self.length_buckets, self.length_buckets[1:])),
            "length_buckets",
            f"must be increasing positive token counts, got {self.length_buckets}",
        )
        require(self.max_turns >= 0, "max_turns", f"must be >= 0 (0: every turn), got {self.max_turns}")
        require(self.timing_repeats >= 0, "timing_repeats", f"must be >= 0 (0: no timing), got {self.timing_repeats}")
        require(self.every_steps >= 0, "every_steps", f"must be >= 0, got {self.every_steps}")
        require(self.num_prompts >= 1, "num_prompts", f"must be >= 1, got {self.num_prompts}")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        require(self.batch_prompts >= 1, "batch_prompts", f"must be >= 1, got {self.batch_prompts}")
        require(self.reference_cache_gb >= 0, "reference_cache_gb", f"must be >= 0, got {self.reference_cache_gb}")
        require(0 < self.producer_share <= 1, "producer_share", f"must be in (0, 1], got {self.producer_share}")
        require(self.prompt_len >= 0, "prompt_len", f"must be >= 0, got {self.prompt_len}")
        require(self.gap_tolerance > 0, "gap_tolerance", f"must be > 0, got {self.gap_tolerance}")
        require(self.temperature >= 0, "temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.top_k >= 0, "top_k", f"must be >= 0 (0: all tokens), got {self.top_k}")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")

"""The run's configuration: one typed tree of dataclasses, loaded from TOML plus dotted overrides.

    cfg = load_config("run.toml", ["training.lr=3e-4", "launch.num_producers=2"])
    save_config(cfg, run_dir / "config.toml")   # the resolved config, every value written out

Every field has a docstring (the string under it) and each section validates itself in
``__post_init__``. Errors name the dotted key (``training.lr: must be > 0``); unknown keys are
errors, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import shlex
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

SourceFormat = Literal["chat", "tokenized", "synthetic"]
LengthMode = Literal["chat", "fixed"]
LabelMode = Literal["data", "target_hard", "target_soft"]


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message names the dotted key."""


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key}: {message}")


def resolve_model_path(path: str, key: str) -> str:
    """A model folder with a config.json: ``path`` itself, the folder a GGUF file ``path`` is dequantized into
    (common/gguf.py), or the snapshot of the hub id ``path`` in the local Hugging Face cache (looked up only;
    nothing is downloaded). ConfigError naming ``key`` otherwise."""
    if (Path(path) / "config.json").is_file():
        return path
    if path.endswith(".gguf"):
        return _gguf_folder(path, key)
    if Path(path).exists():
        raise ConfigError(f"{key}: no config.json in {path}")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", path):  # not a hub id either
        raise ConfigError(f"{key}: {path} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(path, local_files_only=True)
    except LocalEntryNotFoundError:
        raise ConfigError(
            f"{key}: {path!r} is no folder and is not in the local Hugging Face cache ({HF_HUB_CACHE}); "
            f"download it first ({shlex.join(['huggingface-cli', 'download', path])}) or give its folder"
        ) from None
    if not (Path(snapshot) / "config.json").is_file():
        raise ConfigError(f"{key}: the cached snapshot of {path!r} ({snapshot}) has no config.json")
    return snapshot


def _gguf_folder(path: str, key: str) -> str:
    from common.gguf import GGUFError, dequantized_folder

    if not Path(path).is_file():
        raise ConfigError(f"{key}: no such GGUF file {path}")
    try:
        return str(dequantized_folder(path))
    except GGUFError as exc:
        raise ConfigError(f"{key}: {exc}") from None


# -- sections ------------------------------------------------------------------------------------


READERS = {
    "producer": "a producer, at its start: fixed while the producers run",
    "trainer": "the trainer, at its start: restart-trainer may change it",
    "launcher": "the launcher, as it goes (launch.*) or for a command (check, the progress view)",
    "checkpoint": "fixed by the drafter's first checkpoint: the drafter's shape and layout",
}
"""The readers a config field names in its section's ``READ_BY`` (every field names at least one)."""


def readers(key: str) -> set[str]:
    """Who reads ``section.field`` (its section's ``READ_BY``)."""
    section, _, name = key.partition(".")
    section_type = typing.get_type_hints(RunConfig)[section]
    return set(section_type.READ_BY[name].split())


def fixed_while_producers_run(key: str) -> bool:
    """Whether restart-trainer must refuse a change of ``key``: a producer or the checkpoint holds its value."""
    return bool(readers(key) & {"producer", "checkpoint"})


@dataclass
class TargetConfig:
    """The target model each producer loads once. With neither ``path`` nor ``config_json`` a tiny
    Qwen3 with random weights is built (the embedded default)."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "path": "producer trainer launcher",
        "config_json": "producer",
        "config_overrides": "producer trainer",
        "dtype": "producer trainer launcher",
        "device": "producer",
        "attention": "producer",
        "compile": "producer",
        "seed": "producer",
    }

    path: str | None = None
    """Local directory of a Hugging Face causal LM (config.json + safetensors), loaded with its weights; a GGUF
    file (``model.Q4_1.gguf``: dequantized once into a cached folder, tokenizer and chat template included, see
    common/gguf.py); or a hub id (``Qwen/Qwen3-8B``) already in the local Hugging Face cache, replaced by its snapshot folder
    (nothing is downloaded)."""
    config_json: str | None = None
    """A config.json (with ``model_type``) to build a target with random weights at real shapes."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields set on top of the path's / json's / tiny default's config (e.g. num_hidden_layers)."""
    dtype: str = "bfloat16"
    """Weight and activation dtype: bfloat16, float16 or float32."""
    device: str = "auto"
    """torch device of the target; ``auto``: cuda when available, else cpu. The launcher sets it per producer."""
    attention: str = "auto"
    """Packed attention kernel: auto, varlen, flex or sdpa."""
    compile: bool | None = None
    """torch.compile the target's decoder layers; None: on CUDA only, and not for a tensor-parallel target
    (compiling through transformers' sharding hooks is unverified) nor a mixture-of-experts one (its compile
    did not finish in minutes on an H200)."""
    seed: int = 0
    """Seed of the random weights (ignored when loading ``path``)."""

    def __post_init__(self) -> None:
        _check(self.path is None or self.config_json is None, "path", "give at most one of path and config_json")
        if self.path is not None:
            self.path = resolve_model_path(self.path, "path")
        if self.config_json is not None:
            _check(Path(self.config_json).is_file(), "config_json", f"no such file {self.config_json}")
        _check(
            self.dtype in ("bfloat16", "float16", "float32"),
            "dtype",
            f"must be bfloat16, float16 or float32, got {self.dtype!r}",
        )
        _check(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        _check(
            self.attention in ("auto", "varlen", "flex", "sdpa"),
            "attention",
            f"must be auto, varlen, flex or sdpa, got {self.attention!r}",
        )
        _check(self.seed >= 0, "seed", "must be >= 0")


@dataclass
class DataConfig:
    """Where documents come from and how they are cut to length."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "format": "producer",
        "paths": "producer",
        "max_seq_len": "producer",
        "too_long": "producer",
        "chat_template_kwargs": "producer",
        "vocab_size": "producer",
        "num_samples": "producer",
        "seed": "producer",
        "shuffle_seed": "producer",
        "length_mode": "producer",
        "mean_len": "producer",
        "min_len": "producer",
        "max_step": "producer",
        "tokenizer": "producer launcher",
        "regenerate": "producer",
        "cache_mb": "producer",
    }

    format: SourceFormat = "synthetic"
    """"chat" (JSONL messages), "tokenized" (JSONL or parquet input_ids) or "synthetic"."""
    paths: list[str] = field(default_factory=list)
    """Files for chat/tokenized, in order; glob patterns expand to their sorted matches."""
    max_seq_len: int = 3072
    """Longest document in tokens; longer ones are truncated or dropped (see too_long). Long contexts (32K to 128K,
    thinking and agentic traces) train in linear time and memory with sliding draft layers
    (drafter.layer_types, docs/internals.md "Long documents"); batching.token_budget must hold one such document."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """What to do with a document longer than max_seq_len."""
    tokenizer: str | None = None
    """Tokenizer path for chat data; None: the target's tokenizer."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template (e.g. {enable_thinking = false})."""
    vocab_size: int | None = None
    """Token ids must be < vocab_size (checked for tokenized data; synthetic: None means the target's)."""
    num_samples: int = 10_000
    """Synthetic only: number of documents in the data set (one epoch)."""
    seed: int = 0
    """Synthetic only: seed of the document contents."""
    shuffle_seed: int = 0
    """Seed of the per-epoch order of documents and of batches inside a window."""
    length_mode: LengthMode = "chat"
    """Synthetic only: "chat" (log-normal lengths around mean_len) or "fixed" (all mean_len)."""
    mean_len: int = 1000
    """Synthetic only: mean document length in tokens (the length in fixed mode)."""
    min_len: int = 32
    """Synthetic only: shortest document in chat mode."""
    max_step: int = 63
    """Synthetic only: largest stride of the arithmetic runs (small strides are easier to learn)."""
    regenerate: bool = False
    """Chat only: the producers' target answers each record as the stream reaches it (its last user turn, or with
    ``synthesize.turns = "all"`` every assistant turn, docs/conversations.md), and those answers are trained on (on-policy data without a synthesis first; producer/regenerate.py). Generation follows
    the synthesize section (max_new_tokens, temperature, rows, ...); the answers are kept in RUN/regenerated, so
    a batch computed again after a restart holds the same documents."""
    cache_mb: int = 1024
    """Host memory (MiB, per producer) for documents already read and rendered, reused by later epochs and replays
    instead of reading and rendering them again; the first records read are kept until it is full. 0: none kept."""

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        _check(
            self.format in ("chat", "tokenized", "synthetic"),
            "format",
            f"must be 'chat', 'tokenized' or 'synthetic', got {self.format!r}",
        )
        _check(
            self.format == "synthetic" or bool(self.paths),
            "paths",
            f"must name at least one file for format={self.format!r}",
        )
        _check(self.max_seq_len >= 1, "max_seq_len", f"must be >= 1, got {self.max_seq_len}")
        _check(
            self.too_long in ("truncate", "drop"), "too_long", f"must be 'truncate' or 'drop', got {self.too_long!r}"
        )
        _check(self.vocab_size is None or self.vocab_size >= 2, "vocab_size", f"must be >= 2, got {self.vocab_size}")
        _check(self.shuffle_seed >= 0, "shuffle_seed", "must be >= 0")
        _check(self.max_step >= 1, "max_step", "must be >= 1")
        _check(self.cache_mb >= 0, "cache_mb", f"must be >= 0, got {self.cache_mb}")
        _check(not self.regenerate or self.format == "chat", "regenerate", f"needs format='chat', got {self.format!r}")
        if self.format == "synthetic":
            _check(self.num_samples >= 1, "num_samples", f"must be >= 1, got {self.num_samples}")
            _check(
                self.length_mode in ("chat", "fixed"),
                "length_mode",
                f"must be 'chat' or 'fixed', got {self.length_mode!r}",
            )
            _check(
                1 <= self.min_len <= self.mean_len <= self.max_seq_len,
                "mean_len",
                f"min_len <= mean_len <= max_seq_len must hold, got {self.min_len}, {self.mean_len}, {self.max_seq_len}",
            )


@dataclass
class BatchingConfig:
    """How documents are grouped into token-budget batches (one batch = one ring slot)."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "token_budget": "producer trainer launcher",
        "max_docs_per_batch": "producer",
        "window_docs": "producer",
    }

    token_budget: int = 16384
    """Most tokens in one batch; sizes the ring slots (token_budget x bytes per token of the features, allocated once
    at the producer's start); must be >= data.max_seq_len, so that the longest document is one batch. A document
    longer than it is skipped and counted with its file:line; a shard where every one is stops the run (exit 2)."""
    max_docs_per_batch: int | None = None
    """Most documents in one batch; None for no limit."""
    window_docs: int = 512
    """Documents of the shard's order sorted by length together; larger groups lengths better
    but delays the samples of a window relative to the order by up to a window."""

    def __post_init__(self) -> None:
        _check(self.token_budget >= 1, "token_budget", f"must be >= 1, got {self.token_budget}")
        _check(
            self.max_docs_per_batch is None or self.max_docs_per_batch >= 1,
            "max_docs_per_batch",
            "must be >= 1 or unset",
        )
        _check(self.window_docs >= 1, "window_docs", f"must be >= 1, got {self.window_docs}")


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
        "conv_kernel_size": "checkpoint",
        "conv_group_size": "checkpoint",
        "selector_rank": "checkpoint",
        "selector_top_k": "checkpoint",
        "selector_loss_alpha": "trainer",
        "selector_missing_gold": "trainer",
        "selector_stop_gradient": "trainer",
        "init_from": "trainer",
    }

    kind: Literal["dflash", "dflash2"] = "dflash"
    """The drafter kind: dflash, or dflash2 (DFlash 2: a grouped dynamic causal convolution around each draft
    layer's attention and MLP, and a candidate selector that rescores the draft's top-K with a low-rank bilinear
    term of the previous token; servers run it as vLLM method dflash). A checkpoint resumes only as its own kind."""
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
    conv_kernel_size: int = 2
    """dflash2: taps of each dynamic convolution, looking back inside the block (1 is the position itself)."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic kernel delta; must divide the hidden size."""
    selector_rank: int = 256
    """dflash2: rank of the selector's bilinear term (codebooks of vocabulary x rank)."""
    selector_top_k: int = 16
    """dflash2: candidates per slot the selector rescores: the draft's top-K; at most the vocabulary."""
    selector_loss_alpha: float = 1.0
    """dflash2: weight of the selector's K-way cross-entropy beside the DFlash loss (0 trains no selector)."""
    selector_missing_gold: Literal["inject", "exclude"] = "inject"
    """dflash2: a slot whose gold token is not in the draft's top-K: inject it in place of the K-th candidate (as
    speculators does), or leave the slot out of the selector loss (as NeMo does)."""
    selector_stop_gradient: bool = False
    """dflash2: stop the selector loss's gradient at the draft hidden state, so it trains the selector alone and
    the backbone learns from the DFlash loss only (a SpecForge option)."""
    init_from: str | None = None
    """A DFlash or DFlash 2 checkpoint (checkpoints/step-N) or export to start a new run's drafter from: its
    weights are loaded, and a dflash2 drafter from a DFlash one gets identity convolutions and a no-op selector,
    so it first proposes exactly what the DFlash drafter did. Read at a fresh start only, never at a resume."""

    def __post_init__(self) -> None:
        _check(self.num_layers >= 1, "num_layers", "must be >= 1")
        _check(self.kind in ("dflash", "dflash2"), "kind", f"must be dflash or dflash2, got {self.kind!r}")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            _check(getattr(self, name) >= 1, name, "must be >= 1")
        _check(
            self.conv_kernel_size <= self.block_size,
            "conv_kernel_size",
            f"must be <= block_size ({self.block_size}): the taps look back inside the block only",
        )
        _check(self.selector_loss_alpha >= 0, "selector_loss_alpha", "must be >= 0")
        _check(
            self.selector_missing_gold in ("inject", "exclude"),
            "selector_missing_gold",
            f"must be inject or exclude, got {self.selector_missing_gold!r}",
        )
        _check(self.block_size >= 2, "block_size", "must be >= 2")
        _check(self.num_anchors >= 1, "num_anchors", "must be >= 1")
        _check(all(k >= 0 for k in self.target_layer_ids), "target_layer_ids", "must be >= 0")
        _check(
            not self.layer_types or len(self.layer_types) == self.num_layers,
            "layer_types",
            f"needs one entry per layer ({self.num_layers}), got {len(self.layer_types)}",
        )
        _check(
            all(t in ("full_attention", "sliding_attention") for t in self.layer_types),
            "layer_types",
            "entries must be full_attention or sliding_attention",
        )
        _check(
            self.in_block_causality in ("sliding_causal", "bidirectional", "causal"),
            "in_block_causality",
            f"must be sliding_causal, bidirectional or causal, got {self.in_block_causality!r}",
        )
        if "sliding_attention" in self.layer_types:
            _check(
                self.sliding_window is not None and self.sliding_window >= 1,
                "sliding_window",
                "must be set (>= 1) for sliding layers",
            )

    def draft_overrides(self) -> dict[str, Any]:
        """The DraftConfig fields this section sets (``DraftConfig.from_target`` derives the rest from the target):
        the one mapping of the trainer's drafter and of what ``check`` describes."""
        overrides: dict[str, Any] = {
            name: getattr(self, name)
            for name in (
                "block_size",
                "in_block_causality",
                "kind",
                "conv_kernel_size",
                "conv_group_size",
                "selector_rank",
                "selector_top_k",
            )
        }
        for name in ("target_layer_ids", "layer_types"):
            if getattr(self, name):
                overrides[name] = list(getattr(self, name))
        for name in ("sliding_window", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
            if getattr(self, name) is not None:
                overrides[name] = getattr(self, name)
        return overrides


@dataclass
class RingConfig:
    """Each producer's ring and the protocol timings."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "backend": "producer",
        "num_slots": "producer",
        "credits": "trainer",
        "heartbeat_interval_s": "producer trainer",
        "heartbeat_timeout_s": "producer trainer",
        "handshake_timeout_s": "trainer",
        "headroom_slots": "producer",
        "pause_detect_s": "producer",
    }

    backend: Literal["auto", "host", "cuda"] = "auto"
    """Where slots live: host (/dev/shm), cuda (GPU memory by CUDA IPC); auto: cuda when the producer has a GPU."""
    num_slots: int = 4
    """Slots per ring; each holds one batch of batching.token_budget tokens."""
    credits: int = 2
    """Batches a consumer may hold at once (its prefetch depth)."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats, both ways."""
    heartbeat_timeout_s: float = 10.0
    """Silence after which a peer is dead and its leases go back to the ring."""
    handshake_timeout_s: float = 60.0
    """How long a consumer waits for WELCOME."""
    headroom_slots: int = 0
    """Slots a producer keeps free while its consumers keep taking batches, filled only when they
    pause (no lease for ``pause_detect_s``) or are absent. On a GPU shared with a trainer rank this
    moves target work into the trainer's pauses (checkpoints, evaluations) instead of competing
    with its steps; after a pause the trainer trains from the backlog with the GPU to itself.
    0: always fill the whole ring (right for a producer with a GPU of its own)."""
    pause_detect_s: float = 1.0
    """Seconds without a lease after which a producer treats its consumers as paused (see headroom_slots)."""

    def __post_init__(self) -> None:
        _check(self.backend in ("auto", "host", "cuda"), "backend", f"must be auto, host or cuda, got {self.backend!r}")
        _check(self.num_slots >= 1, "num_slots", "must be >= 1")
        _check(
            0 <= self.headroom_slots < self.num_slots, "headroom_slots", f"must be in [0, num_slots={self.num_slots})"
        )
        _check(self.pause_detect_s > 0, "pause_detect_s", "must be > 0")
        _check(self.credits >= 1, "credits", "must be >= 1")
        _check(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        _check(
            self.heartbeat_timeout_s > 2 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            "must exceed twice heartbeat_interval_s",
        )
        _check(self.handshake_timeout_s > 0, "handshake_timeout_s", "must be > 0")


@dataclass
class TrainingConfig:
    """The optimisation: schedule, loss, checkpoints."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "lr": "trainer",
        "min_lr_ratio": "trainer",
        "warmup_ratio": "trainer",
        "weight_decay": "trainer",
        "grad_clip": "trainer",
        "max_steps": "trainer",
        "epochs": "trainer",
        "max_minutes": "trainer",
        "gamma": "trainer",
        "weighting": "trainer",
        "objective": "trainer",
        "optimizer": "trainer",
        "schedule": "trainer",
        "decay_ratio": "trainer",
        "feature_noise": "trainer",
        "checkpoint_every": "trainer",
        "keep_last": "trainer",
        "async_checkpoint": "trainer",
        "seed": "trainer",
        "device": "trainer",
        "compile": "trainer",
        "warm_start": "trainer",
        "parallelism": "trainer",
        "stall_every_steps": "trainer",
        "stall_s": "trainer",
        "label_mode": "producer trainer launcher",
    }

    lr: float = 6e-4
    """Peak learning rate (of AdamW, and of Muon's matrices, whose updates are scaled to AdamW's size)."""
    optimizer: Literal["auto", "adamw", "muon"] = "auto"
    """muon: Muon (momentum orthogonalised by Newton-Schulz) for the drafter's weight matrices, AdamW for norms
    and the rest (trainer/optim.py); not with parallelism fsdp, whose shards cannot be orthogonalised one by one.
    adamw: AdamW for every trained weight. auto: muon, or adamw with fsdp."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the linear warmup: cosine, a cosine decay to ``min_lr_ratio`` over the remaining steps; wsd
    (warmup-stable-decay), the peak held until the last ``decay_ratio`` of the steps, then a linear decay."""
    decay_ratio: float = 0.2
    """wsd: fraction of the steps spent in the final decay."""
    min_lr_ratio: float = 0.0
    """Learning rate at the end of the decay, as a fraction of lr."""
    warmup_ratio: float = 0.04
    """Fraction of the steps spent in linear warmup."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW's, and Muon's on its matrices)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    max_steps: int = 0
    """Optimizer steps of the run; 0: as many as ``epochs`` of data take (estimated from the data size)."""
    epochs: int = 6
    """Epochs of data when max_steps is 0."""
    max_minutes: float = 0.0
    """Training time budget in minutes (0: none): the run ends when it is spent or at the last step, whichever comes
    first, and the learning-rate schedule is as far along as the larger of the steps and the clock, so a run the
    clock ends still warms up and decays. The clock runs from the end of each trainer's first step (compilation is
    not training) and checkpoints carry it over restarts; waits for data, checkpoints and evaluations count. Runs
    of different step costs trained to one budget compare at equal GPU time; since the schedule reads the clock,
    two such runs are not equal step for step."""
    label_mode: LabelMode = "data"
    """data: the data tokens; target_hard (argmax CE) / target_soft (KL): the target's distribution (needs its last hidden state)."""
    objective: Literal["ce", "lk", "lk_hybrid"] = "ce"
    """Per-position loss: ce, cross-entropy against the label; lk, the LK loss (arXiv 2602.23881: one minus
    the drafter's probability of being accepted at that position); lk_hybrid, the two mixed."""
    weighting: Literal["decay", "streak", "dpace"] = "dpace"
    """Weight of block position k: decay, exp(-(k-1)/gamma); streak, the drafter's detached probability of
    reaching k; dpace, D-PACE (arXiv 2605.18810)."""
    gamma: float | None = None
    """Decay of the per-position loss weight exp(-(k-1)/gamma); None: 7 for B=16, 5 for B=10, 4 for B=8
    (docs/dflash.md)."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target features at step 0, cosine-annealed to 0 (0: off)."""
    checkpoint_every: int = 500
    """Save a checkpoint every this many steps (and always at the last step and on SIGTERM)."""
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: training stands still only while the state is copied to
    host memory (page-locked buffers as large as the weights and optimizer state, kept between
    checkpoints). The last checkpoint, and the one on a stop, are always waited for. The drafter
    exported for an evaluation is written the same way. Off: every checkpoint and export is written
    before the next step."""
    seed: int = 0
    """Seed of the drafter's initialisation and of anchor sampling."""
    device: str = "auto"
    """Trainer device; auto: cuda when available, else cpu (torchrun: cuda:LOCAL_RANK)."""
    compile: bool | None = None
    """torch.compile the draft layers; None: on CUDA only."""
    warm_start: bool = True
    """A single-process trainer that will take over on restart-trainer (the launcher's standby, or the
    trainer started for the restart) builds the head, the drafter and a step's compiled kernels while the
    old one still trains, so the takeover is a copy of the state and the next step (trainer/warm.py).
    It holds the head and the drafter's weights on the trainer's device meanwhile (6.6 GB for a
    Qwen3-8B draft); false: it only imports ahead."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """How several trainer ranks share the drafter. ddp: every rank holds all of it (weights,
    gradients, optimizer state) and gradients are all-reduced. fsdp (FSDP2): every rank holds
    1/ranks of each, and a layer's weights are gathered only for its forward and backward; for
    drafts whose training state does not fit one device. One rank: the same. Checkpoints are the
    same either way, so a restart may switch it or change the number of ranks."""
    stall_every_steps: int = 0
    """Benchmark aid: pause the training loop every this many steps (0: never), a stand-in for the
    evaluations and other pauses of real training. The feeder keeps heartbeats going meanwhile."""
    stall_s: float = 0.0
    """Benchmark aid: how long each pause of ``stall_every_steps`` lasts, in seconds."""

    @property
    def resolved_optimizer(self) -> Literal["adamw", "muon"]:
        """The optimizer ``optimizer`` names, auto resolved."""
        if self.optimizer != "auto":
            return self.optimizer
        return "adamw" if self.parallelism == "fsdp" else "muon"

    def __post_init__(self) -> None:
        _check(self.stall_every_steps >= 0, "stall_every_steps", "must be >= 0")
        _check(self.stall_s >= 0, "stall_s", "must be >= 0")
        _check(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be > 0, got {self.lr}")
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        _check(0 <= self.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
        _check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        _check(self.grad_clip >= 0, "grad_clip", "must be >= 0")
        _check(self.max_steps >= 0, "max_steps", "must be >= 0")
        _check(self.epochs >= 1, "epochs", "must be >= 1")
        _check(self.max_minutes >= 0 and math.isfinite(self.max_minutes), "max_minutes", "must be >= 0")
        _check(
            self.label_mode in ("data", "target_hard", "target_soft"),
            "label_mode",
            f"must be data, target_hard or target_soft, got {self.label_mode!r}",
        )
        _check(self.gamma is None or self.gamma > 0, "gamma", "must be > 0")
        _check(
            self.optimizer in ("auto", "adamw", "muon"),
            "optimizer",
            f"must be auto, adamw or muon, got {self.optimizer!r}",
        )
        _check(self.schedule in ("cosine", "wsd"), "schedule", f"must be cosine or wsd, got {self.schedule!r}")
        _check(0 < self.decay_ratio <= 1, "decay_ratio", "must be in (0, 1]")
        _check(
            self.objective in ("ce", "lk", "lk_hybrid"),
            "objective",
            f"must be ce, lk or lk_hybrid, got {self.objective!r}",
        )
        _check(
            self.weighting in ("decay", "streak", "dpace"),
            "weighting",
            f"must be decay, streak or dpace, got {self.weighting!r}",
        )
        _check(
            not (self.optimizer == "muon" and self.parallelism == "fsdp"),
            "optimizer",
            "muon needs whole weight matrices; use parallelism = \"ddp\" with it",
        )
        _check(self.feature_noise >= 0, "feature_noise", "must be >= 0")
        _check(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        _check(self.keep_last >= 1, "keep_last", "must be >= 1")
        _check(self.parallelism in ("ddp", "fsdp"), "parallelism", f"must be ddp or fsdp, got {self.parallelism!r}")


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
        _check(self.log_every >= 1, "log_every", "must be >= 1")
        _check(
            self.wandb_mode in ("offline", "online", "disabled"),
            "wandb_mode",
            f"must be offline, online or disabled, got {self.wandb_mode!r}",
        )


@dataclass
class LaunchConfig:
    """Which processes run where."""

    READ_BY: ClassVar[dict[str, str]] = {  # who reads each field (see READERS)
        "num_producers": "launcher producer",
        "producer_devices": "launcher producer",
        "trainer_devices": "launcher trainer",
        "restart_backoff_s": "launcher",
        "max_restarts": "launcher",
        "standby_trainer_after_s": "launcher",
        "ready_timeout_s": "launcher trainer",
        "mps": "launcher producer",
        "mps_producer_sm_percent": "launcher producer",
        "mps_trainer_sm_percent": "launcher trainer",
        "remote_producers": "launcher producer trainer",
    }

    num_producers: int = 2
    """Producers (one target each) the launcher starts on this host. With producer_devices set, one
    per listed device. 0 only with remote_producers (all targets on other hosts)."""
    producer_devices: list[str] = field(default_factory=list)
    """Devices of the producers, one entry each, e.g. ["cuda:0"]; empty: num_producers on cpu (or cuda:0
    when present). An entry naming several devices, comma-separated, is one producer whose target is
    sharded over them (tensor parallel, under torchrun): ["cuda:0,cuda:1", "cuda:2,cuda:3"] is two
    producers on two GPUs each, ["cpu,cpu"] one on two CPU processes. The number of devices must divide
    the target's attention and key/value heads, and a GPU of such an entry is in no other entry."""
    trainer_devices: list[str] = field(default_factory=list)
    """Devices of the trainer ranks; several: torchrun with one rank each."""
    restart_backoff_s: float = 2.0
    """First wait before restarting a crashed process; doubles per crash, reset after a minute up."""
    max_restarts: int = 10
    """Restarts of one process before the launcher gives up on the run."""
    standby_trainer_after_s: float = 30.0
    """Seconds a single-process trainer trains before the launcher starts a standby trainer beside it (imported
    and waiting, it makes restart-trainer take seconds); negative: never."""
    ready_timeout_s: float = 600.0
    """How long the launcher waits for a producer to load its target and report ready."""
    mps: bool = False
    """Run the run's processes as clients of a CUDA MPS daemon of the run's own (started and stopped by
    the launcher; needs nvidia-cuda-mps-control on PATH). Where a producer and trainer ranks share a
    GPU their kernels then run side by side; without MPS the GPU time-slices between the processes.
    See the README's placement section."""
    mps_producer_sm_percent: int | None = None
    """Under launch.mps: the share of a GPU's SMs (1-100) that a producer may use where it shares a GPU
    with a trainer rank (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of its processes). It reserves the rest for
    the trainer's step, so that a DDP rank is not slowed by the forward beside it. Size it from the
    stages alone: both run at the same rate when the producer has trainer / (producer + trainer)
    samples/s of the GPU (6.3 / (13.2 + 6.3): 32% for the Qwen3-8B shapes on an H200), if their
    speed scales with SMs. The cap is fixed when the producer starts and holds during the trainer's
    pauses too, so a capped producer refills ring.headroom_slots more slowly. None: no limit."""
    mps_trainer_sm_percent: int | None = None
    """Under launch.mps: the share of a GPU's SMs (1-100) that trainer ranks may use where they share a GPU
    with a producer (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the trainer's processes). The rest is never taken
    by the step's long matmuls, so the producer's kernels start at once: its forwards and, on producer 0,
    the evaluation's short drafting kernels, which beside an uncapped step wait for SMs at every launch
    (an evaluation of 0.8 s alone took 14 s beside the Qwen3-8B draft's step). The cap holds while the
    producer is idle too. None: no limit."""
    remote_producers: list[str] = field(default_factory=list)
    """Producers on other hosts, as ``tcp://host:port`` endpoints the trainer connects to (CURVE with
    the run's secrets/curve.json). Their producer ids follow the local ones: the k-th is
    ``local_producers + k``, started on its host with ``python -m producer.server --run-dir DIR
    --producer-id ID --listen tcp://0.0.0.0:PORT`` (DIR there holds copies of config.toml and
    secrets/curve.json). The data is sharded over local and remote producers; they ship the payload
    as ZeroMQ frames from a host ring (ring.backend auto means host for them)."""

    def __post_init__(self) -> None:
        _check(self.num_producers >= 0, "num_producers", "must be >= 0")
        _check(
            self.local_producers + len(self.remote_producers) >= 1,
            "num_producers",
            "must be >= 1 unless launch.remote_producers lists producers on other hosts",
        )
        if self.mps_producer_sm_percent is not None:
            _check(self.mps, "mps_producer_sm_percent", "needs launch.mps = true (it is an MPS client setting)")
            _check(
                1 <= self.mps_producer_sm_percent <= 100,
                "mps_producer_sm_percent",
                f"must be in 1..100, got {self.mps_producer_sm_percent}",
            )
        if self.mps_trainer_sm_percent is not None:
            _check(self.mps, "mps_trainer_sm_percent", "needs launch.mps = true (it is an MPS client setting)")
            _check(
                1 <= self.mps_trainer_sm_percent <= 100,
                "mps_trainer_sm_percent",
                f"must be in 1..100, got {self.mps_trainer_sm_percent}",
            )
        for index, endpoint in enumerate(self.remote_producers):
            _check(
                _is_tcp_connect_endpoint(endpoint),
                f"remote_producers[{index}]",
                f"must look like tcp://host:port with a host to connect to and a port in 1..65535, got {endpoint!r}",
            )
        _check(
            len(set(self.remote_producers)) == len(self.remote_producers), "remote_producers", "lists an endpoint twice"
        )
        _check_producer_devices(self.producer_devices)
        _check(self.restart_backoff_s >= 0, "restart_backoff_s", "must be >= 0")
        _check(self.max_restarts >= 0, "max_restarts", "must be >= 0")
        _check(self.ready_timeout_s > 0, "ready_timeout_s", "must be > 0")

    @property
    def local_producers(self) -> int:
        """Producers the launcher starts on this host (ids 0 .. local_producers - 1)."""
        return len(self.producer_devices) or self.num_producers

    @property
    def total_producers(self) -> int:
        """Every producer of the run, local and remote: the number of data shards."""
        return self.local_producers + len(self.remote_producers)

    def remote_producer_ids(self) -> dict[int, str]:
        """Producer id -> endpoint of each remote producer."""
        return {self.local_producers + k: endpoint for k, endpoint in enumerate(self.remote_producers)}


def _is_tcp_connect_endpoint(endpoint: str) -> bool:
    """``tcp://host:port`` with a host one can connect to (not a wildcard) and a valid port."""
    match = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", endpoint)
    return match is not None and match.group(1) not in ("*", "0.0.0.0", "[::]") and 1 <= int(match.group(2)) <= 65535


def _check_producer_devices(entries: list[str]) -> None:
    """launch.producer_devices: each entry one device (auto, cpu, cuda, cuda:N) or a tensor-parallel group
    (cpu only, or distinct cuda:N), and no GPU of a group in another entry: the ranks of a group wait for
    each other at every layer, so a GPU shared with another producer slows all of them."""
    group_of_gpu: dict[str, int] = {}
    for index, entry in enumerate(entries):
        key, devices = f"producer_devices[{index}]", [part.strip() for part in entry.split(",")]
        if len(devices) == 1:
            _check(
                re.fullmatch(r"auto|cpu|cuda(:\d+)?", devices[0]) is not None,
                key,
                f"must be auto, cpu, cuda or cuda:N (several, comma-separated, for tensor parallel), got {entry!r}",
            )
            continue
        if all(device == "cpu" for device in devices):
            continue
        _check(
            "cpu" not in devices,
            key,
            f"mixes cpu and GPUs in {entry!r}: a tensor-parallel producer runs on one kind of device",
        )
        for device in devices:
            _check(
                re.fullmatch(r"cuda:\d+", device) is not None,
                key,
                f"names {device!r}: each device of a tensor-parallel producer is cpu or cuda:N",
            )
        _check(
            len(set(devices)) == len(devices),
            key,
            f"names a GPU twice in {entry!r}: each rank of a tensor-parallel producer needs its own",
        )
        group_of_gpu.update(dict.fromkeys(devices, index))
    for index, entry in enumerate(entries):
        for device in entry.split(","):
            gpu = "cuda:0" if device.strip() == "cuda" else device.strip()
            group = group_of_gpu.get(gpu, index)
            _check(
                group == index,
                f"producer_devices[{index}]",
                f"{gpu} is also in launch.producer_devices[{group}], a tensor-parallel producer: its ranks wait for each other "
                "at every layer, so a GPU it shares slows all of them",
            )


@dataclass
class EvalConfig:
    """Acceptance evaluation by real speculative decoding against the target (producer/verify.py runs it; the
    arithmetic is common/drafter/evaluate.py's)."""

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
    """Most of producer 0's time its evaluations take: after one of E seconds it makes batches for E * (1 - share)
    / share seconds before the next, and of the requests that came meanwhile only the newest is evaluated
    (the others are logged as skipped). On a GPU it shares with the trainer an evaluation runs slower than
    alone, and one every few steps would otherwise stop the producer for good. 1: every request, oldest first."""
    batch_prompts: int = 16
    """Prompts drafted together: one drafter forward drafts a block for each (each keeps exactly what it keeps
    alone), and, where the target allows (no Gated-DeltaNet or sliding-window layers), one target forward extends
    their greedy continuations when the evaluator makes its reference. 1: one prompt at a time."""
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
    replaced by a draw from max(0, p - q), a bonus token from p), live and one prompt at a time: p is the target's
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

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        _check(
            all(isinstance(edge, int) and edge > 0 for edge in self.length_buckets)
            and all(a < b for a, b in zip(self.length_buckets, self.length_buckets[1:])),
            "length_buckets",
            f"must be increasing positive token counts, got {self.length_buckets}",
        )
        _check(self.max_turns >= 0, "max_turns", f"must be >= 0 (0: every turn), got {self.max_turns}")
        _check(self.timing_repeats >= 0, "timing_repeats", f"must be >= 0 (0: no timing), got {self.timing_repeats}")
        _check(self.every_steps >= 0, "every_steps", f"must be >= 0, got {self.every_steps}")
        _check(self.num_prompts >= 1, "num_prompts", f"must be >= 1, got {self.num_prompts}")
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(self.batch_prompts >= 1, "batch_prompts", f"must be >= 1, got {self.batch_prompts}")
        _check(self.reference_cache_gb >= 0, "reference_cache_gb", f"must be >= 0, got {self.reference_cache_gb}")
        _check(0 < self.producer_share <= 1, "producer_share", f"must be in (0, 1], got {self.producer_share}")
        _check(self.prompt_len >= 0, "prompt_len", f"must be >= 0, got {self.prompt_len}")
        _check(self.gap_tolerance > 0, "gap_tolerance", f"must be > 0, got {self.gap_tolerance}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 (0: all tokens), got {self.top_k}")
        _check(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")


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
        _check(
            self.prompts in ("data", "magpie", "both"), "prompts", f"must be data, magpie or both, got {self.prompts!r}"
        )
        _check(self.turns in ("last", "all"), "turns", f"must be last or all, got {self.turns!r}")
        _check(self.magpie_turns >= 1, "magpie_turns", f"must be >= 1, got {self.magpie_turns}")
        _check(
            self.max_conversation_tokens >= 0,
            "max_conversation_tokens",
            f"must be >= 0 (0: no cap), got {self.max_conversation_tokens}",
        )
        _check(self.num_magpie >= 0, "num_magpie", f"must be >= 0, got {self.num_magpie}")
        _check(
            self.prompts == "data" or self.num_magpie >= 1, "num_magpie", f"must be >= 1 for prompts={self.prompts!r}"
        )
        for name in ("max_new_tokens", "magpie_max_tokens", "rows", "max_prompt_tokens", "records_per_shard"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("temperature", "magpie_temperature"):
            _check(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        for name in ("top_p", "magpie_top_p"):
            _check(0 < getattr(self, name) <= 1, name, f"must be in (0, 1], got {getattr(self, name)}")
        _check(self.seed >= 0, "seed", "must be >= 0")
        _check(self.flush_every_s > 0, "flush_every_s", f"must be > 0, got {self.flush_every_s}")

    def folder(self, run_root: Path) -> Path:
        """Where the shards of the run at ``run_root`` go: output_dir, else RUN/synthesized."""
        return Path(self.output_dir) if self.output_dir else run_root / "synthesized"


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
        _check(
            self.batching.token_budget >= self.data.max_seq_len,
            "batching.token_budget",
            f"must be >= data.max_seq_len ({self.data.max_seq_len}) so every document fits a slot",
        )
        _check(
            self.eval.every_steps % self.logging.log_every == 0,
            "eval.every_steps",
            f"must be a multiple of logging.log_every ({self.logging.log_every}), got {self.eval.every_steps}",
        )


# -- building from plain data --------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; returns the value (ints widened to float)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be a table, got {value!r}")
        return build(tp, value, key)
    if tp is bool:
        if type(value) is not bool:
            raise ConfigError(f"{key}: must be true or false, got {value!r}")
        return value
    if tp is int:
        if type(value) is not int:
            raise ConfigError(f"{key}: must be an integer, got {value!r}")
        return value
    if tp is float:
        if type(value) not in (int, float):
            raise ConfigError(f"{key}: must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if type(value) is not str:
            raise ConfigError(f"{key}: must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported annotation {tp}")


def unknown_key(cls: type, data: dict, prefix: str = "", nested: bool = False) -> str | None:
    """The error for the first key of ``data`` that dataclass ``cls`` has no field for, naming the closest known
    key (a typo's likely meaning); with ``nested`` the sections' keys too. None when every key is known."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    where = f"{prefix}." if prefix else ""
    unknown = sorted(set(data) - known)
    if unknown:
        closest = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"did you mean {where}{closest[0]}? " if closest else ""
        return f"unknown key {where}{unknown[0]} ({hint}known keys{' of ' + prefix if prefix else ''}: {', '.join(sorted(known))})"
    hints = typing.get_type_hints(cls) if nested else {}
    for name, value in data.items() if nested else ():
        if dataclasses.is_dataclass(hints[name]) and isinstance(value, dict):
            message = unknown_key(hints[name], value, f"{where}{name}", nested)
            if message:
                return message
    return None


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """Make dataclass ``cls`` from nested plain data; errors name the dotted key."""
    hints = typing.get_type_hints(cls)
    unknown = unknown_key(cls, data, prefix)
    if unknown:
        raise ConfigError(unknown)
    kwargs = {name: _coerce(value, hints[name], f"{prefix}.{name}" if prefix else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # Sections raise "<field>: message"; prefix it with the section's own key.
        raise ConfigError(f"{prefix}.{exc}" if prefix and not str(exc).startswith(prefix + ".") else str(exc)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value); the value is read as TOML, else taken as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls: type = RunConfig) -> Any:
    """Read a TOML file (or start from the defaults) and apply ``key=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        unknown = unknown_key(cls, data, nested=True)  # the file's own keys: a typo there names the file
        if unknown:
            raise ConfigError(f"{path}: {unknown}")
    return build(cls, apply_overrides(data, list(overrides or [])))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return (
            repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(cfg: Any) -> str:
    """The config as TOML (None values are left out: they are the defaults' way of saying unset)."""
    lines: list[str] = []

    def section(obj: Any, name: str) -> None:
        scalars = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        if name:
            lines.append(f"[{name}]")
        for key, value in scalars:
            if value is not None and not dataclasses.is_dataclass(value):
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
        for key, value in scalars:
            if dataclasses.is_dataclass(value):
                section(value, f"{name}.{key}" if name else key)

    section(cfg, "")
    return "\n".join(lines).lstrip("\n")


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config atomically."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)

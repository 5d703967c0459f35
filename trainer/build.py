"""What a trainer builds its drafter from: the target's frozen head, the draft config, the compiled layers; and
``start_drafter``, the drafter a trainer starts with (fresh, resumed, or taken over from its predecessor).

Shared by the Trainer and the warm start (trainer/warm.py), which builds the same things ahead of a takeover: one
place says how, so that what a warm start built is what the trainer would have built.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.utils._pytree import tree_map

from common.codec import DTYPES
from common.config import ConfigError, RunConfig
from common.contract import Expectation
from common.drafter.base import Drafter
from common.drafter.draft_config import DraftConfig
from common.drafter.export import CONFIG_FILE, WEIGHTS_FILE, config_from_export, drafter_folder, drafter_from_state
from common.drafter.kinds import kind_of
from common.drafter.loss import LossConfig
from common.drafter.model import build_drafter
from common.drafter.target_head import TargetHead, load_target_head
from common.hf import target_identity, text_config_of
from common.naming import run_tag, sweep_stale_trainer_staging
from common.rundir import RunDir, read_json
from trainer import handover
from trainer.checkpoint import TrainerState, load_checkpoint
from trainer.ranks import Ranks

log = logging.getLogger(__name__)


def head_dir_of(cfg: RunConfig, run_dir: RunDir) -> Path:
    """The folder of the target's head: the target itself, or the head its first producer exported."""
    return run_dir.head_dir(cfg.target.path)


def head_is_ready(head_dir: Path) -> bool:
    return (head_dir / "config.json").is_file() and any(head_dir.glob("*.safetensors"))


def load_head(cfg: RunConfig, head_dir: Path, device: torch.device) -> tuple[Any, TargetHead]:
    """(the target's text config with the run's overrides, its frozen head on ``device``)."""
    from transformers import AutoConfig

    target_config = text_config_of(AutoConfig.from_pretrained(head_dir))  # a multimodal target's language model
    for key, value in cfg.target.config_overrides.items():
        setattr(target_config, key, value)
    # In the target's dtype: a producer casts a stored target's weights to it while loading, so the
    # drafter shares (and the handshake hashes) that embedding, not the checkpoint's fp32 one.
    return target_config, load_target_head(head_dir, device=device, dtype=DTYPES[cfg.target.dtype])


def draft_config_for(cfg: RunConfig, target_config: Any, head_dir: Path) -> DraftConfig:
    """The drafter the run's ``drafter`` section asks for, on this target."""
    d = cfg.drafter
    overrides = d.draft_overrides()
    tokenizer = None
    mask = d.mask_token_id
    has_tokenizer = any(
        (head_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    full_vocabulary = kind_of(d.kind).full_vocabulary
    if has_tokenizer and (mask is None or full_vocabulary):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(head_dir)
        if full_vocabulary and len(tokenizer) > int(target_config.vocab_size):
            # The kind's tables over the vocabulary, and what servers compute of them, span the target's head; a
            # head cut below its tokenizer (a pruned draft vocabulary) has no form of this kind.
            raise ConfigError(
                f"drafter.kind: {d.kind} needs the target's full vocabulary: its tokenizer has "
                f"{len(tokenizer)} tokens, its head {target_config.vocab_size}"
            )
    elif mask is None:
        # No tokenizer (a random target's exported head): the last id, which synthetic data never
        # uses. (transformers would return an empty tokenizer here, whose ids collide with data.)
        mask = int(target_config.vocab_size) - 1
    try:
        config = DraftConfig.from_target(
            target_config, num_draft_layers=d.num_layers, tokenizer=tokenizer, mask_token_id=mask, **overrides
        )
    except ValueError as exc:  # the drafter cannot be built as configured: the same on every try
        message = str(exc)
        raise ConfigError(message if message.startswith("drafter.") else f"drafter.{message}") from None
    if d.mask_token_id is None:
        token = tokenizer.convert_ids_to_tokens(config.mask_token_id) if tokenizer is not None else None
        name = f" {token!r}" if token is not None else ""
        if tokenizer is not None and token is None:
            name = f", the first id past the tokenizer's {len(tokenizer)} tokens"
        log.info(
            "drafter.mask_token_id unset: the mask token is %d%s (set drafter.mask_token_id to choose another)",
            config.mask_token_id,
            name,
        )
    return config


def loss_config_of(cfg: RunConfig) -> LossConfig:
    """How the run supervises its drafter (the training section; the kind's own loss options are its options)."""
    return LossConfig(
        label_mode=cfg.training.label_mode,
        gamma=cfg.training.gamma,
        weighting=cfg.training.weighting,
        objective=cfg.training.objective,
        feature_noise=cfg.training.feature_noise,
    )


def fresh_drafter(
    cfg: RunConfig, config: DraftConfig, head: TargetHead, loss_config: LossConfig, device: torch.device | None = None
) -> Drafter:
    """The drafter a new run starts from: initialised, or ``drafter.init_from``'s weights (of its own kind, or of a
    kind it extends, with its additions at their no-op values). ConfigError, naming the key, when they cannot be."""
    drafter = build_drafter(config, head, loss_config, device=device)
    if cfg.drafter.init_from is None:
        return drafter
    folder, own = drafter_folder(Path(cfg.drafter.init_from))
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"drafter.init_from: {cfg.drafter.init_from} is neither a checkpoint (step-N) nor an export "
            f"(no {CONFIG_FILE} and {WEIGHTS_FILE} in it)"
        )
    source = config_from_export(json.loads((folder / CONFIG_FILE).read_text()), own)
    for name in ("target_layer_ids", "mask_token_id", "hidden_size", "num_hidden_layers", "vocab_size"):
        if getattr(source, name) != getattr(config, name):
            raise ConfigError(
                f"drafter.init_from: {cfg.drafter.init_from} has {name} {getattr(source, name)}, this "
                f"run's drafter {getattr(config, name)}"
            )
    param = next(drafter.parameters())
    state = {k: v.to(param.dtype) for k, v in load_file(str(folder / WEIGHTS_FILE), device=str(param.device)).items()}
    try:
        drafter.warm_start(state)
    except (ValueError, RuntimeError) as exc:  # another kind or shape: the same on every try
        raise ConfigError(
            f"drafter.init_from: a {source.kind} drafter cannot start this run's {config.kind} "
            f"drafter: {str(exc).splitlines()[0]}"
        ) from None
    log.info("drafter.init_from: the %s drafter starts from the %s drafter in %s", config.kind, source.kind, folder)
    return drafter


def compiles(cfg: RunConfig, device: torch.device) -> bool:
    """Whether the draft layers are compiled: ``training.compile``, or on CUDA only when it is unset."""
    return cfg.training.compile if cfg.training.compile is not None else device.type == "cuda"


def compile_layers(drafter: Drafter) -> None:
    """Fuses norms, rotary and SwiGLU per layer. Batches are padded to the token budget (see pad_packed),
    so shapes are fixed and each kernel is compiled once. Under FSDP the compiled layer runs between
    FSDP's gather and reshard hooks, which dynamo leaves eager."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)


@dataclass
class WarmStart:
    """A head and a drafter built ahead of a takeover, and the configuration they were built from."""

    cfg: RunConfig
    device: torch.device
    target_config: Any
    head: TargetHead
    target_identity: str
    """The head's part of the handshake (a hash of the whole embedding: seconds at a large vocabulary)."""
    draft_config: DraftConfig
    drafter: Drafter
    """On ``device``, in the dtype of a fresh drafter; compiled when ``compiled``."""
    compiled: bool
    seconds: float

    def fits(self, cfg: RunConfig, device: torch.device) -> bool:
        """Whether a trainer with ``cfg`` on ``device`` would have built this head and drafter."""
        return (
            device == self.device
            and cfg.target == self.cfg.target
            and cfg.drafter == self.cfg.drafter
            and compiles(cfg, device) == self.compiled
        )

    def drafter_for(
        self, config: DraftConfig, weights: dict[str, torch.Tensor], loss_config: LossConfig
    ) -> Drafter | None:
        """The warm drafter holding ``weights``, if it has their architecture and dtype (else None)."""
        dtypes = {t.dtype for t in weights.values()}
        if config != self.drafter.config or dtypes != {self.drafter.fc.weight.dtype}:
            return None
        self.drafter.load_state_dict(weights, strict=True)  # copied onto the device
        self.drafter.loss_config = loss_config
        return self.drafter


def fitting_warm_start(
    warm: WarmStart | None, cfg: RunConfig, ranks: Ranks, takes_warm_start: bool
) -> WarmStart | None:
    """``warm`` if it fits this start: a single process, on a source that takes one (``takes_warm_start``), with
    the configuration it was built for; else None."""
    if warm is None or (ranks.world_size == 1 and takes_warm_start and warm.fits(cfg, ranks.device)):
        return warm
    log.info("the warm start does not fit the configuration of this start; building anew")
    return None


class StartClock:
    """Seconds of each part of a trainer's start, for its first log line."""

    def __init__(self) -> None:
        self.laps: list[tuple[str, float]] = []
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps.append((name, now - self.last))
        self.last = now

    def __str__(self) -> str:
        total = sum(s for _, s in self.laps)
        return f"{total:.1f} s (" + ", ".join(f"{name} {s:.1f}" for name, s in self.laps) + ")"


@dataclass
class DrafterStart:
    """What a trainer starts from, as plain state: the drafter on its device, what it was built from, and the
    training state it resumes (the Trainer, trainer/train.py, restores the optimizer and schedule from it)."""

    head: TargetHead
    draft_config: DraftConfig
    loss_config: LossConfig
    expect: dict
    """The handshake's expectation of the producers (the target, its captured layers, dtype, labels)."""
    drafter: Drafter
    compiled: bool
    warmed: bool
    """The drafter is the warm start's (trainer/warm.py), built while the predecessor still trained."""
    resumed: TrainerState | None
    """The checkpoint resumed, or the state handed over by restart-trainer (weights, train_state, meta)."""
    handed: TrainerState | None
    """The state handed over, when it is the one resumed (its disk checkpoint is still to write)."""
    staging: handover.SharedStaging | None
    """A single process's shared staging: its checkpoints' host buffers, which restart-trainer hands over."""
    origin: str
    """How it started, for the log: a fresh start, the checkpoint resumed, or the state taken over."""

    def train_state_to_load(self, device: torch.device) -> dict[str, Any]:
        """The resumed train state, for the optimizer to load. On a GPU the optimizer copies it to the device; on the
        CPU it would keep a handed-over state's shared pages as its own and change them under the background write
        of their checkpoint, so it gets a copy."""
        if device.type == "cuda" or self.resumed is not self.handed:
            return self.resumed.train_state
        return tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, self.resumed.train_state)


def start_drafter(
    cfg: RunConfig,
    run_dir: RunDir,
    ranks: Ranks,
    handed_over: dict | None,
    warm: WarmStart | None,
    wait_for: Callable[[Callable[[], bool], str], None],
    lap: Callable[[str], None],
) -> DrafterStart:
    """The drafter, sharing the target's frozen embedding, final norm and lm_head, resumed from the state handed
    over (``handed_over``, the predecessor's handover mark) or the latest checkpoint, or fresh. ``warm``: the head
    and drafter a warm start built ahead, used where they fit. ``wait_for(ready, what)`` waits for the first
    producer's head; ``lap(name)`` times each part."""
    head_dir = head_dir_of(cfg, run_dir)
    if warm is not None:
        target_config, head, draft_config = warm.target_config, warm.head, warm.draft_config
        identity = warm.target_identity
    else:
        wait_for(lambda: head_is_ready(head_dir), f"the target head in {head_dir} (written by the first producer)")
        target_config, head = load_head(cfg, head_dir, ranks.device)
        draft_config = draft_config_for(cfg, target_config, head_dir)
        identity = target_identity(target_config, head.embed_weight)
    lap("head")
    loss_config = loss_config_of(cfg)
    expect = Expectation(
        target_identity=identity,
        layer_ids=list(draft_config.target_layer_ids),
        dtype=cfg.target.dtype,
        last_hidden=cfg.ships_final_hidden,
    ).to_wire()
    latest = run_dir.latest_checkpoint()
    # A single process stages its checkpoints in /dev/shm, so that restart-trainer can hand them over; a successor
    # adopts the segments handed to it as its own staging.
    staging = handover.SharedStaging(run_tag(run_dir.root)) if ranks.world_size == 1 else None
    handed = _handed_state(handed_over, staging, latest, ranks)
    resumed = handed or (load_checkpoint(latest) if latest is not None else None)
    if ranks.rank == 0:
        # A successor handed a state over reads no checkpoint: the superseded write's folder it would remove
        # (seconds for gigabytes) is left to the sweep after its background write (trainer/checkpoint.py).
        for leftover in run_dir.sweep_partial_checkpoints() if handed is None else ():
            log.warning("cleaned up %s, left by a trainer killed while checkpointing", leftover.name)
        sweep_stale_trainer_staging(run_tag(run_dir.root))
    lap("state")
    drafter = _drafter_for(cfg, ranks, resumed, warm, head, draft_config, loss_config)
    warmed = warm is not None and drafter is warm.drafter
    compiled = compiles(cfg, ranks.device)
    if compiled and not warmed:
        compile_layers(drafter)
    lap("drafter")
    origin = "took over the state handed over" if handed else f"resumed from {latest.name}" if latest else "fresh start"
    return DrafterStart(
        head, draft_config, loss_config, expect, drafter, compiled, warmed, resumed, handed, staging, origin
    )


def _handed_state(
    handed_over: dict | None, staging: handover.SharedStaging | None, latest: Path | None, ranks: Ranks
) -> TrainerState | None:
    """The state the predecessor handed over, unless the latest checkpoint is later (then it resumes instead)."""
    handed = handover.take(handed_over, staging, pin=ranks.device.type == "cuda") if handed_over and staging else None
    if handed is None or latest is None:
        return handed
    if handed.meta["step"] < read_json(latest / "trainer_state.json")["step"]:
        log.warning(
            "the state handed over (step %d) is older than %s; resuming from the checkpoint",
            handed.meta["step"],
            latest.name,
        )
        return None
    return handed


def _drafter_for(
    cfg: RunConfig,
    ranks: Ranks,
    resumed: TrainerState | None,
    warm: WarmStart | None,
    head: TargetHead,
    draft_config: DraftConfig,
    loss_config: LossConfig,
) -> Drafter:
    """The drafter on its device: the state resumed (in the warm start's drafter where it fits), or a fresh one.

    Every rank builds (or loads) the same whole drafter on the host: DDP copies it to the device, FSDP keeps
    each rank's shards of it. A fresh one is the same on every rank (same seed). A single process resumes on its
    device: no host copy of the weights."""
    torch.manual_seed(cfg.training.seed)
    if resumed is None:
        drafter = fresh_drafter(cfg, draft_config, head, loss_config)
    else:
        config = config_from_export(resumed.drafter_config, own_checkpoint=True)
        if config.kind != cfg.drafter.kind:
            raise ConfigError(
                f"drafter.kind: the run's checkpoint holds a {config.kind} drafter, the configuration asks for "
                f"{cfg.drafter.kind}; start a new run (drafter.init_from can start it from this checkpoint)"
            )
        drafter = warm.drafter_for(config, resumed.weights, loss_config) if warm is not None else None
        if drafter is None:
            drafter = drafter_from_state(
                resumed.drafter_config,
                resumed.weights,
                head,
                loss_config,
                device=None if ranks.world_size > 1 else ranks.device,
            )
        # The checkpoint fixes the kind's shape; its training options are the run's (restart-trainer may change them).
        drafter.config.options = cfg.drafter.options.with_shape(drafter.config.options.shape())
    if not ranks.sharded:
        drafter.to(ranks.device)
    return drafter

"""The ``[target]`` section: the target model the producers load."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .base import ConfigError, require


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
        require(self.path is None or self.config_json is None, "path", "give at most one of path and config_json")
        if self.path is not None:
            self.path = resolve_model_path(self.path, "path")
        if self.config_json is not None:
            require(Path(self.config_json).is_file(), "config_json", f"no such file {self.config_json}")
        require(
            self.dtype in ("bfloat16", "float16", "float32"),
            "dtype",
            f"must be bfloat16, float16 or float32, got {self.dtype!r}",
        )
        require(
            re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            "device",
            f"must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(
            self.attention in ("auto", "varlen", "flex", "sdpa"),
            "attention",
            f"must be auto, varlen, flex or sdpa, got {self.attention!r}",
        )
        require(self.seed >= 0, "seed", "must be >= 0")

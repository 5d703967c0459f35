"""The frozen pieces of the target the drafter shares: embed_tokens, final norm and lm_head.

Loaded straight from the checkpoint's safetensors (only these three tensors), bit-identical to
the target's, held as non-persistent buffers so they never reach the optimizer or an export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.hf import text_config_dict, zero_centered_norm

# Checkpoint names tried in order (plain causal LMs first, then multimodal wrappers).
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "norm.weight")
LM_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


class TargetHead(nn.Module):
    """Frozen embedding, final RMSNorm and output projection of the target."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        norm_weight: torch.Tensor,
        rms_norm_eps: float,
        zero_centered_norm: bool = False,
    ) -> None:
        super().__init__()
        self.zero_centered_norm = zero_centered_norm
        if embed_weight.shape[1] != lm_head_weight.shape[1] or norm_weight.shape[0] != lm_head_weight.shape[1]:
            raise ValueError(
                f"inconsistent target head shapes: embed {tuple(embed_weight.shape)}, "
                f"lm_head {tuple(lm_head_weight.shape)}, norm {tuple(norm_weight.shape)}"
            )
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.register_buffer("norm_weight", norm_weight.detach(), persistent=False)
        self.rms_norm_eps = rms_norm_eps

    def _apply(self, fn, recurse=True):
        """Follow device moves but not dtype casts: the weights stay bit-identical to the target's."""

        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        return super()._apply(keep_dtype, recurse)

    @property
    def vocab_size(self) -> int:
        return self.lm_head_weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.lm_head_weight.shape[1]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(token_ids.long(), self.embed_weight)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm: Qwen3's order (normalise in fp32, cast, then scale), or for a
        zero-centred norm (Qwen3.5, Qwen3-Next) scale by ``1 + weight`` in fp32 and cast last."""
        variance = hidden.float().pow(2).mean(-1, keepdim=True)
        normed = hidden.float() * torch.rsqrt(variance + self.rms_norm_eps)
        if self.zero_centered_norm:
            return (normed * (1.0 + self.norm_weight.float())).to(hidden.dtype)
        return self.norm_weight * normed.to(hidden.dtype)

    @classmethod
    def random(
        cls,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        rms_norm_eps: float = 1e-6,
        seed: int = 0,
    ) -> TargetHead:
        """Random stand-in for benchmarks and tests."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        embed = (torch.randn(vocab_size, hidden_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
        head = (torch.randn(vocab_size, hidden_size, generator=gen) * 0.02).to(device=device, dtype=dtype)
        return cls(embed, head, torch.ones(hidden_size, device=device, dtype=dtype), rms_norm_eps)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            out.update({name: path for name in f.keys()})
    return out


def _read(files: dict[str, Path], candidates: tuple[str, ...]) -> torch.Tensor | None:
    for name in candidates:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                return f.get_tensor(name)
    return None


def load_target_head(
    model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> TargetHead:
    """Read embed_tokens, the final norm and lm_head of a HF checkpoint dir without loading the model.

    ``dtype=None`` keeps the checkpoint's dtype, so the tensors are bit-identical to the target's.
    A tied checkpoint (``tie_word_embeddings``) without ``lm_head.weight`` reuses the embedding.
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text_config = text_config_dict(config)
    files = _weight_files(model_dir)
    embed = _read(files, EMBED_NAMES)
    norm = _read(files, NORM_NAMES)
    lm_head = _read(files, LM_HEAD_NAMES)
    if embed is None or norm is None:
        raise KeyError(f"{model_dir}: no embed_tokens / final norm among {EMBED_NAMES} / {NORM_NAMES}")
    if lm_head is None:
        if not config.get("tie_word_embeddings", text_config.get("tie_word_embeddings", False)):
            raise KeyError(f"{model_dir}: no lm_head among {LM_HEAD_NAMES} and embeddings are not tied")
        lm_head = embed
    eps = float(text_config.get("rms_norm_eps", 1e-6))
    tensors = [t.to(device=device, dtype=dtype or t.dtype) for t in (embed, lm_head, norm)]
    return TargetHead(*tensors, rms_norm_eps=eps, zero_centered_norm=zero_centered_norm(text_config.get("model_type")))

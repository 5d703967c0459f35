"""Helpers shared by the drafter tests: tiny configs, random packed batches, a tiny real Qwen3 target."""

from __future__ import annotations

from pathlib import Path

import torch

from common.batch import PackedBatch
from common.drafter.draft_config import DraftConfig
from common.drafter.kind import DEFAULT_KIND
from common.drafter.kinds import kind_of
from common.drafter.target_head import TargetHead
from launch.bench.served.quick_drafter import train_on_transcripts  # noqa: F401  (the tests' name for it)


def tiny_config(**overrides) -> DraftConfig:
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        target_hidden_size=32,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=63,
        block_size=4,
    )
    values.update(overrides)
    # The kind's own options may be given flat, as keywords of their own: they go to its options.
    names = kind_of(values.get("kind", DEFAULT_KIND)).options.names()
    options = {name: values.pop(name) for name in list(values) if name in names}
    if options:
        values["options"] = {**(values.get("options") or {}), **options}
    return DraftConfig(**values)


def random_head(config: DraftConfig, seed: int = 0) -> TargetHead:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(config.vocab_size, config.hidden_size, generator=gen)
    head = torch.randn(config.vocab_size, config.hidden_size, generator=gen) * 0.2
    norm = 1.0 + 0.1 * torch.randn(config.hidden_size, generator=gen)
    return TargetHead(embed, head, norm, config.rms_norm_eps)


def random_batch(
    doc_lengths: list[int],
    config: DraftConfig,
    seed: int = 0,
    supervised_fraction: float = 0.8,
    with_last_hidden: bool = False,
) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(doc_lengths)
    cu = torch.tensor([0] + list(torch.tensor(doc_lengths).cumsum(0)), dtype=torch.int32)
    loss_mask = (torch.rand(total, generator=gen) < supervised_fraction).to(torch.uint8)
    return PackedBatch(
        input_ids=torch.randint(0, config.vocab_size - 1, (total,), generator=gen, dtype=torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=cu,
        sample_ids=torch.arange(len(doc_lengths)),
        aux_hidden=torch.randn(total, config.fused_feature_size, generator=gen),
        last_hidden=torch.randn(total, config.target_hidden_size, generator=gen) if with_last_hidden else None,
    )


def tiny_qwen3_target(
    directory: Path,
    vocab_size: int = 64,
    num_layers: int = 6,
    hidden: int = 32,
    tie_word_embeddings: bool = False,
    seed: int = 0,
):
    """A random-weight Qwen3 saved with save_pretrained and loaded back from disk."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return Qwen3ForCausalLM.from_pretrained(directory).eval()


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux_hidden, last_hidden) one document at a time: concat of hidden_states[k + 1], and the last
    decoder layer's output before the final norm (HF's last hidden_states entry is after it)."""
    captured: list[torch.Tensor] = []
    hook = target.model.layers[-1].register_forward_hook(
        lambda _m, _i, out: captured.append(out[0] if isinstance(out, tuple) else out)
    )
    aux = []
    try:
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            out = target(input_ids[None, start:end].long(), output_hidden_states=True)
            aux.append(torch.cat([out.hidden_states[k + 1][0] for k in layer_ids], dim=-1))
    finally:
        hook.remove()
    return torch.cat(aux), torch.cat([c.reshape(-1, c.shape[-1]) for c in captured])


def listed_tiles(block_mask, name: str) -> torch.Tensor:
    """One of a BlockMask's four tile lists (kv, full_kv: per query tile; q, full_q: per key tile, what the
    backward reads) as a bool matrix."""
    counts, indices = getattr(block_mask, f"{name}_num_blocks")[0, 0], getattr(block_mask, f"{name}_indices")[0, 0]
    tiles = torch.zeros(indices.shape, dtype=torch.bool)
    for row, count in enumerate(counts.tolist()):
        tiles[row, indices[row, :count].long()] = True
    return tiles


def host_reads(work) -> int:
    """How many host reads of a tensor's value (``item()``) ``work()`` makes, run once to compile first."""
    from torch.profiler import ProfilerActivity, profile

    work()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        work()
    return sum(event.name in ("aten::item", "aten::_local_scalar_dense") for event in prof.events())

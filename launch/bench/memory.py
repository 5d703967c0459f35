"""What a run's processes hold on their GPU, estimated from its configuration alone (the target's config, no
weights; nothing runs on a GPU), so that what cannot fit a card is never started (``launch.bench.kinds``).

A producer holds the target's weights (parameters x target.dtype), its ring when the ring is on the GPU
(ring.num_slots slots of the producer's own slot size, common/batch.py), and the working memory of its capture
forward over batching.token_budget tokens. A trainer rank holds the drafter's trained weights in float32 with their
gradients and two optimizer moments (AdamW's; Muon keeps one, so this bounds it), the target's frozen embedding and
output projection, the batches leased to it (ring.credits slots), and the activations of a step: every one of the
num_anchors x block_size query tokens keeps about 10 x hidden + 4 x intermediate bf16 values per drafter layer for
the backward, the context's keys and values per layer, the features' projection, and the loss over chunks of the
vocabulary (common/drafter/loss.py). Every process adds its CUDA context; what the caching allocator holds is its
peak times ``ALLOCATOR_SLACK``.

A kind with modules beside DFlash's (DFlash 2's selector, DSpark's heads) keeps more per query than its parameters
say: its step's activations are DFlash's times its row's ``step_memory_factor`` (common/drafter/kind.py), from the
measured steps.

Checked against measured peaks (BENCHMARKS.md, launch.bench.step on one H200): the SmolLM2 preset's DFlash step
allocated 9.5 GiB, estimated here 8.7 GiB before context and slack (its batch, weights, optimizer and step); DFlash
2's 12.0 GiB, here 11.4 GiB. With context and slack: DFlash's trainer 11.6 GiB and DFlash 2's 14.8 GiB, producers
4.1 GiB, against the kinds benchmark's trainers of 9-15 GB and producers of about 4 GB on an H100 (issue 56).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import RunConfig

GIB = 2**30
CUDA_CONTEXT = GIB // 2
"""A process's CUDA context and loaded kernels before any tensor (0.5-0.6 GiB with torch 2 on H100 and H200)."""
ALLOCATOR_SLACK = 1.2
"""What torch's caching allocator reserves over its peak allocation (cached blocks, fragmentation)."""
OPTIMIZER_BYTES = 16
"""Per trained parameter: float32 weight, gradient and two optimizer moments."""
QUERY_VALUES_PER_LAYER = (10, 4)
"""Values a query token keeps per drafter layer for the backward: 10 x hidden (norms, attention's q, k, v and output,
residuals) + 4 x intermediate (the MLP's gate, up, activation and down input)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one producer and one trainer rank of a config hold on their GPU (see the module's docstring)."""

    target_weights: int
    ring: int
    """The producer's ring, when it lives on the GPU (0 for a host ring)."""
    target_forward: int
    drafter_state: int
    drafter_weights: int
    target_head: int
    staged_batches: int
    step_activations: int

    @property
    def producer(self) -> int:
        # The ring is one driver allocation of its exact size, outside torch's allocator.
        return CUDA_CONTEXT + self.ring + int(ALLOCATOR_SLACK * (self.target_weights + self.target_forward))

    @property
    def trainer(self) -> int:
        held = self.drafter_state + self.target_head + self.staged_batches + self.step_activations
        return CUDA_CONTEXT + int(ALLOCATOR_SLACK * held)

    @property
    def standby(self) -> int:
        """A standby trainer (launch.standby_trainer_after_s): the head and the drafter's weights, waiting."""
        return CUDA_CONTEXT + int(ALLOCATOR_SLACK * (self.target_head + self.drafter_weights))

    def describe(self) -> str:
        def gib(value: int) -> str:
            return f"{value / GIB:.1f} GiB"

        return (
            f"producer {gib(self.producer)} (target {gib(self.target_weights)}, ring {gib(self.ring)}, forward "
            f"{gib(self.target_forward)}); trainer {gib(self.trainer)} (drafter and optimizer {gib(self.drafter_state)}, "
            f"head {gib(self.target_head)}, batches {gib(self.staged_batches)}, step {gib(self.step_activations)}); "
            f"standby trainer {gib(self.standby)}"
        )


def estimate(cfg: RunConfig) -> MemoryEstimate:
    """The estimate for ``cfg`` (ConfigError or ValueError where the config names no usable target or drafter)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.batch import SlotFormat
    from common.codec import DTYPES
    from common.drafter.draft_config import DraftConfig
    from common.drafter.kinds import kind_of
    from common.drafter.loss import LossConfig
    from common.drafter.model import build_drafter
    from common.drafter.target_head import TargetHead
    from producer.target_model.load import build_target_config

    target = build_target_config(cfg.target)
    dtype = DTYPES[cfg.target.dtype]
    d = cfg.drafter
    mask = d.mask_token_id if d.mask_token_id is not None else int(target.vocab_size) - 1
    draft = DraftConfig.from_target(target, num_draft_layers=d.num_layers, mask_token_id=mask, **d.draft_overrides())
    with torch.device("meta"):  # shapes only: nothing is allocated
        target_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(target).parameters())
        table = torch.empty(int(target.vocab_size), int(target.hidden_size), dtype=dtype)
        head = TargetHead(table, table, torch.empty(int(target.hidden_size)), 1e-6)
        trained = sum(p.numel() for p in build_drafter(draft, head).parameters() if p.requires_grad)

    tokens = cfg.batching.token_budget
    slot = SlotFormat(
        len(draft.target_layer_ids) * int(target.hidden_size), int(target.hidden_size), dtype, cfg.ships_final_hidden
    )
    slot_bytes = slot.slot_bytes(tokens, cfg.batching.max_docs_per_batch or tokens)
    intermediate = int(getattr(target, "intermediate_size", None) or 4 * target.hidden_size)
    forward = tokens * (4 * int(target.hidden_size) + 3 * intermediate) * dtype.itemsize
    queries = d.num_anchors * draft.block_size
    per_query = QUERY_VALUES_PER_LAYER[0] * draft.hidden_size + QUERY_VALUES_PER_LAYER[1] * draft.intermediate_size
    context_kv = 2 * draft.num_key_value_heads * draft.head_dim
    bf16 = 2
    activations = kind_of(d.kind).step_memory_factor * (
        queries * draft.num_hidden_layers * per_query * bf16
        + tokens * draft.num_hidden_layers * context_kv * bf16
        + tokens * (draft.fused_feature_size + draft.hidden_size) * bf16
        + 4 * LossConfig().chunk_rows * draft.vocab_size * 4
    )
    return MemoryEstimate(
        target_weights=target_params * dtype.itemsize,
        ring=0 if cfg.ring.backend == "host" else cfg.ring.num_slots * slot_bytes,
        target_forward=forward,
        drafter_state=trained * OPTIMIZER_BYTES,
        drafter_weights=trained * 4,
        target_head=2 * table.numel() * dtype.itemsize,
        staged_batches=cfg.ring.credits * slot_bytes,
        step_activations=int(activations),
    )

"""On a learnable task, features of a real (tiny, random-weight) Qwen3 target teach the drafter to
propose whole blocks: the simulated acceptance length rises well above 1."""

import torch

from common.batch import PackedBatch
from common.drafter.draft_config import DraftConfig
from common.drafter.loss import LossConfig
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import load_target_head
from tests.drafter_fixtures import target_features, tiny_qwen3_target

VOCAB = 64
MASK = 63


def arithmetic_batch(target, layer_ids, gen: torch.Generator, num_docs: int = 6) -> PackedBatch:
    """Documents x_t = (s + t * d) mod 60 with random s, d: the next tokens follow from the last two."""
    docs, masks = [], []
    for _ in range(num_docs):
        length = int(torch.randint(24, 48, (1,), generator=gen))
        start, step = int(torch.randint(0, 60, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
        docs.append((start + step * torch.arange(length)) % 60)
        mask = torch.ones(length, dtype=torch.uint8)
        mask[:3] = 0  # a "prompt"
        masks.append(mask)
    input_ids = torch.cat(docs).to(torch.int32)
    cu = torch.tensor([0] + torch.tensor([len(d) for d in docs]).cumsum(0).tolist(), dtype=torch.int32)
    aux, last = target_features(target, input_ids, cu, layer_ids)
    return PackedBatch(
        input_ids=input_ids,
        loss_mask=torch.cat(masks),
        cu_seqlens=cu,
        sample_ids=torch.arange(num_docs),
        aux_hidden=aux,
        last_hidden=last,
    )


def test_acceptance_length_rises(tmp_path):
    torch.manual_seed(0)
    target = tiny_qwen3_target(tmp_path, vocab_size=VOCAB, num_layers=6, hidden=32)
    config = DraftConfig.from_target(target.config, num_draft_layers=2, mask_token_id=MASK, block_size=4)
    assert config.target_layer_ids == [1, 3]
    drafter = DFlashDrafter(config, load_target_head(tmp_path), LossConfig(chunk_rows=64))
    assert torch.equal(drafter.target_head.lm_head_weight, target.lm_head.weight)

    data_gen = torch.Generator().manual_seed(1)
    batches = [arithmetic_batch(target, config.target_layer_ids, data_gen) for _ in range(12)]
    held_out = arithmetic_batch(target, config.target_layer_ids, data_gen)

    def eval_tau() -> float:
        drafter.eval()
        with torch.no_grad():
            _, metrics = drafter.forward_train(held_out, 64, torch.Generator().manual_seed(0))
        drafter.train()
        return float(metrics["tau"])

    tau_before = eval_tau()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3, weight_decay=0.0)
    sample_gen = torch.Generator().manual_seed(2)
    steps = 300
    for step in range(steps):
        loss, _ = drafter.forward_train(batches[step % len(batches)], 48, sample_gen, step / steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
    tau_after = eval_tau()
    assert tau_before < 1.3
    assert tau_after > 2.5, f"tau {tau_before:.2f} -> {tau_after:.2f}"

"""What a block may and may not see, checked on the model's outputs; no NaN in edge cases."""

import pytest
import torch

from common.drafter.blocks import build_blocks
from common.drafter.masks import build_masks
from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import random_batch, random_head, tiny_config

LENGTHS = [30, 41, 25]  # documents [0, 30), [30, 71), [71, 96)


def setup(layer_types, window=None, seed=0):
    config = tiny_config(layer_types=layer_types, sliding_window=window, num_hidden_layers=len(layer_types))
    torch.manual_seed(seed)
    drafter = DFlashDrafter(config, random_head(config)).eval()
    batch = random_batch(LENGTHS, config, seed=seed, supervised_fraction=1.0)
    blocks = build_blocks(batch, 12, config.block_size, config.mask_token_id, torch.Generator().manual_seed(seed))
    # Put block 0 at anchor 50 in document 1 so it has context on both sides and other documents around it.
    blocks.anchors[0], blocks.doc_start[0], blocks.valid[0] = 50, 30, True
    blocks.block_positions[0] = 20 + torch.arange(config.block_size)
    blocks.block_ids[0, 0] = batch.input_ids[50]
    return drafter, batch, blocks


def run(drafter, aux, blocks, backend):
    masks = build_masks(blocks, drafter.config, dense=backend == "sdpa")
    with torch.no_grad():
        return drafter(aux, blocks, masks)


def perturb_rows(aux, rows):
    out = aux.clone()
    out[rows] += 3.0 * torch.randn(len(rows), aux.shape[1], generator=torch.Generator().manual_seed(1))
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_block_sees_only_earlier_context_of_its_document(backend):
    drafter, batch, blocks = setup(["full_attention", "full_attention"])
    base = run(drafter, batch.aux_hidden, blocks, backend)[0]
    unseen = {
        "other documents": list(range(0, 30)) + list(range(71, 96)),
        "the anchor's own feature": [50],
        "later tokens": list(range(51, 71)),
    }
    for what, rows in unseen.items():
        out = run(drafter, perturb_rows(batch.aux_hidden, rows), blocks, backend)[0]
        torch.testing.assert_close(out, base, rtol=0, atol=1e-6, msg=f"block 0 saw {what}")
    for row in (30, 49):  # first token of the document, the token before the anchor
        out = run(drafter, perturb_rows(batch.aux_hidden, [row]), blocks, backend)[0]
        assert (out - base).abs().max() > 1e-3, f"block 0 does not see context token {row}"


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_blocks_do_not_see_each_other(backend):
    drafter, batch, blocks = setup(["full_attention", "full_attention"])
    base = run(drafter, batch.aux_hidden, blocks, backend)
    changed = blocks.block_ids.clone()
    changed[1:, 0] = (changed[1:, 0] + 1) % 60
    other = type(blocks)(**{**blocks.__dict__, "block_ids": changed})
    torch.testing.assert_close(run(drafter, batch.aux_hidden, other, backend)[0], base[0], rtol=0, atol=1e-6)
    assert (run(drafter, batch.aux_hidden, other, backend)[1:] - base[1:]).abs().amax(dim=(1, 2)).min() > 1e-3
    # Its own given token reaches every slot of the block (bidirectional inside the block).
    own = blocks.block_ids.clone()
    own[0, 0] = (own[0, 0] + 1) % 60
    out = run(drafter, batch.aux_hidden, type(blocks)(**{**blocks.__dict__, "block_ids": own}), backend)[0]
    assert (out - base[0]).abs().amax(dim=1).min() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_sliding_window_bounds_the_context(backend):
    window = 8
    drafter, batch, blocks = setup(["sliding_attention", "sliding_attention"], window=window)
    base = run(drafter, batch.aux_hidden, blocks, backend)[0]
    outside = list(range(30, 50 - window + 1))  # a - kv >= window for every slot
    out = run(drafter, perturb_rows(batch.aux_hidden, outside), blocks, backend)[0]
    torch.testing.assert_close(out, base, rtol=0, atol=1e-6)
    out = run(drafter, perturb_rows(batch.aux_hidden, [50 - window + 1]), blocks, backend)[0]
    assert (out[0] - base[0]).abs().max() > 1e-3, "slot 0 must see the oldest token of its window"
    # A full-attention layer in the stack sees past the window.
    drafter_mixed, _, _ = setup(["sliding_attention", "full_attention"], window=window)
    base = run(drafter_mixed, batch.aux_hidden, blocks, backend)[0]
    out = run(drafter_mixed, perturb_rows(batch.aux_hidden, outside), blocks, backend)[0]
    assert (out - base).abs().max() > 1e-3


def test_no_nan_with_padding_blocks_and_anchorless_documents():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    drafter = DFlashDrafter(config, random_head(config))
    gen = torch.Generator().manual_seed(0)
    # Documents of 1 and 2 tokens, one with no supervised token: few anchors, most blocks padding.
    batch = random_batch([1, 2, 5, 1], config, supervised_fraction=1.0)
    batch.loss_mask[3:8] = 0
    batch.loss_mask[4] = 1
    loss, metrics = drafter.forward_train(batch, 16, gen)
    assert 0 < int(metrics["num_blocks"]) < 16
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    # No valid anchor at all: a zero loss, finite everywhere.
    drafter.zero_grad()
    batch.loss_mask.zero_()
    loss, metrics = drafter.forward_train(batch, 16, gen)
    loss.backward()
    assert float(loss) == 0.0 and float(metrics["tau"]) == 1.0 and int(metrics["num_blocks"]) == 0
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    assert all(torch.isfinite(v).all() for v in metrics.values())

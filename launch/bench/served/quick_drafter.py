"""A drafter trained in minutes on one process, for served checks: the target answers prompts greedily once, and the
drafter trains on those answers and the target's features of them, all in one packed batch.

    python -m launch.bench.served.quick_drafter --target HF_DIR_OR_GGUF --kind dflash|dflash2 --prompts FILE.jsonl \\
        --out CKPT [--num-prompts 48] [--new-tokens 128] [--steps 200] [--layers 2] [--block-size 16] [--num-anchors 96]

It writes ``CKPT/drafter/`` as a run's checkpoint holds it (z-lab format, fp32), so ``trainer.export`` and
``launch.bench.served`` take it as they take a checkpoint. No ring, no producer, no optimizer recipe: a served check
needs a drafter that accepts blocks many positions deep on the target's own text, not a good one; a real drafter is
trained with ``launch/run_all.sh``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from common.batch import PackedBatch


def train_on_transcripts(drafter, transcripts, steps: int, num_anchors: int = 96, lr: float = 3e-3):
    """Train ``drafter`` for ``steps`` AdamW steps on the target's own transcripts (``evaluate.Transcript``: tokens and
    their features), packed in one batch, the answers supervised: a drafter that accepts whole blocks on them. In
    eval mode on return."""
    lengths = [len(t.tokens) - 1 for t in transcripts]
    loss_mask = torch.cat([torch.arange(n) > t.prompt_len for n, t in zip(lengths, transcripts)]).to(torch.uint8)
    batch = PackedBatch(
        input_ids=torch.cat([torch.tensor(t.tokens[:-1]) for t in transcripts]).to(torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        sample_ids=torch.arange(len(transcripts)),
        aux_hidden=torch.cat([t.features for t in transcripts]),
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    drafter.train()
    for step in range(steps):
        loss, _ = drafter.forward_train(batch, num_anchors, generator, step / steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return drafter.eval()


def quick_drafter(
    target_dir: Path,
    kind: str,
    prompts: list[list[int]],
    out: Path,
    new_tokens: int = 128,
    steps: int = 200,
    layers: int = 2,
    block_size: int = 16,
    mask_token_id: int | None = None,
    num_anchors: int = 96,
    log=print,
    **options,
) -> Path:
    """Train a drafter of ``kind`` (``options``: the kind's own options) on the target's greedy answers to
    ``prompts``; write ``out/drafter``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.drafter.draft_config import DraftConfig
    from common.drafter.export import export_zlab
    from common.drafter.kinds import build_drafter
    from producer.verify import GreedyTarget, greedy_transcripts, target_head_of

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    text = model.config
    # Two layers over a shallow target would be spread over [1, 1] by the default rule: name them.
    layer_ids = {"target_layer_ids": [1, text.num_hidden_layers // 2]} if text.num_hidden_layers < 8 else {}
    overrides = {"kind": kind, "block_size": block_size, **layer_ids, "options": options}
    tokenizer = AutoTokenizer.from_pretrained(target_dir) if mask_token_id is None else None
    # the mask token as the trainer picks it (drafter.mask_token_id unset)
    config = DraftConfig.from_target(text, layers, tokenizer, mask_token_id, **overrides)
    torch.manual_seed(0)
    drafter = build_drafter(config, target_head_of(model))
    target = GreedyTarget(model, list(config.target_layer_ids))
    started = time.perf_counter()
    transcripts = greedy_transcripts(target, [torch.tensor(ids) for ids in prompts], new_tokens, 8)
    target.detach()
    log(f"{len(transcripts)} greedy answers of {new_tokens} tokens in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    train_on_transcripts(drafter, transcripts, steps, num_anchors)
    log(f"{kind}: {steps} steps in {time.perf_counter() - started:.0f} s")
    return export_zlab(drafter, Path(out) / "drafter", dtype=torch.float32).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="Hugging Face folder or GGUF file")
    parser.add_argument("--kind", default="dflash", help="drafter.kind")
    parser.add_argument("--prompts", required=True, type=Path, help="JSON lines of prompts (launch.bench.served)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--out", required=True, type=Path, help="the checkpoint folder to write (its drafter/)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-anchors", type=int, default=96, help="blocks per step")
    parser.add_argument("--mask-token-id", type=int, help="default: the tokenizer's, as drafter.mask_token_id")
    args = parser.parse_args(argv)
    from launch.bench.served.check import resolve_target
    from launch.bench.served.prompts import read_prompts

    torch.set_num_threads(1)
    target_dir = resolve_target(args.target)
    prompts = read_prompts(args.prompts, target_dir, args.num_prompts)
    print(quick_drafter(target_dir, args.kind, prompts, args.out, args.new_tokens, args.steps, args.layers,
                        args.block_size, args.mask_token_id, args.num_anchors))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

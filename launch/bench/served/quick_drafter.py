"""A drafter trained in minutes on one process, for served checks: the target answers prompts greedily once, and the
drafter trains on those answers and the target's features of them, all in one packed batch.

    python -m launch.bench.served.quick_drafter --target HF_DIR_OR_GGUF --kind dflash|dflash2|dspark \\
        --prompts FILE.jsonl --out CKPT [--num-prompts 48] [--new-tokens 128] [--steps 200] [--layers 2] \\
        [--block-size 16] [--num-anchors 96] [--option NAME=VALUE ...]

``--option`` sets one of the kind's own options (``[drafter.<kind>]``, e.g. ``--option markov_rank=32``). A kind
whose objective reads the target's distribution (DSpark) gets the target's final hidden state with the features, as
the producers ship it. ``--confidence-spread S`` rescales a trained confidence head (``spread_confidence``) so that a
served check's cut at 0.5 cuts about half of the slots. It writes ``CKPT/drafter/`` as a run's checkpoint holds it (z-lab format, fp32), so ``trainer.export`` and
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
    # the target's last layer at the same tokens, where it was captured (a kind that reads the target's distribution)
    last = [t.last_hidden for t in transcripts]
    batch = PackedBatch(
        input_ids=torch.cat([torch.tensor(t.tokens[:-1]) for t in transcripts]).to(torch.int32),
        loss_mask=loss_mask,
        cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        sample_ids=torch.arange(len(transcripts)),
        aux_hidden=torch.cat([t.features for t in transcripts]),
        last_hidden=None if any(h is None for h in last) else torch.cat(last),
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


@torch.no_grad()
def spread_confidence(drafter, transcripts, spread: float, every: int = 4, rows_at_once: int = 32) -> tuple:
    """Rescale a drafter's confidence head so that its logit, over the blocks anchored at every ``every``-th token of
    the answers, has its median at 0 and a standard deviation of ``spread``: the same order of the slots as trained,
    but a cut at 0.5 then cuts about half of them. A head trained for minutes predicts nearly one value (0.84 to 0.88
    on the small target after 100 steps), which a served check of the cut would barely exercise. Returns the logit's
    (median, standard deviation) before."""
    from producer.acceptance.decoder import context_rows, draft_rows

    head = getattr(drafter, "confidence_head", None)
    if head is None:
        raise ValueError(f"a {drafter.kind} drafter has no confidence head to spread")
    block_size = drafter.config.block_size
    rows = []
    for t in transcripts:
        fused = drafter.fuse_context(t.features)
        rows += [(fused[:a], t.tokens[a], a) for a in range(t.prompt_len, len(t.tokens) - block_size, every)]
    logits = []
    for i in range(0, len(rows), rows_at_once):
        contexts, anchors, positions = zip(*rows[i : i + rows_at_once])
        anchors = torch.tensor(anchors)
        hidden = draft_rows(drafter, list(contexts), anchors, torch.tensor(positions))
        proposal = drafter.propose(hidden, anchors, context=context_rows(drafter, list(contexts)))
        logits.append(torch.logit(proposal.confidence.double()).flatten())
    logit = torch.cat(logits)
    median, std = float(logit.median()), float(logit.std())
    scale = spread / std
    head.proj.weight.mul_(scale)
    head.proj.bias.sub_(median).mul_(scale)
    return median, std


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
    chunk_rows: int | None = None,
    confidence_spread: float | None = None,
    init_from: Path | None = None,
    lr: float = 3e-3,
    **options,
) -> Path:
    """Train a drafter of ``kind`` (``options``: the kind's own options) on the target's greedy answers to
    ``prompts``; write ``out/drafter``. ``chunk_rows``: the loss's rows at once (``LossConfig.chunk_rows``; DSpark's
    full-vocabulary rows run about a third faster at 128 than at the default on two cores). ``confidence_spread``:
    the trained confidence head rescaled by ``spread_confidence``. ``init_from``: a checkpoint or export whose
    weights start the drafter (``Drafter.warm_start``: its own kind, or one it extends, e.g. a DFlash drafter for
    DSpark, its additions at their no-op values), of the same shape; ``lr``: AdamW's (a warm start keeps more of
    what it starts from at a tenth of the default)."""
    from transformers import AutoModelForCausalLM

    from common.drafter.export import export_zlab
    from common.drafter.kinds import kind_of
    from producer.acceptance.transcripts import greedy_transcripts
    from producer.target_model.greedy import GreedyTarget

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    drafter = new_drafter(model, target_dir, kind, layers, block_size, mask_token_id, chunk_rows, init_from, options)
    config = drafter.config
    # the final hidden state too where the kind's objective reads the target's distribution (DSpark)
    target = GreedyTarget(model, list(config.target_layer_ids), capture_last=kind_of(kind).needs_final_hidden)
    started = time.perf_counter()
    transcripts = greedy_transcripts(target, [torch.tensor(ids) for ids in prompts], new_tokens, 8)
    target.detach()
    log(f"{len(transcripts)} greedy answers of {new_tokens} tokens in {time.perf_counter() - started:.0f} s")
    started = time.perf_counter()
    train_on_transcripts(drafter, transcripts, steps, num_anchors, lr)
    log(f"{kind}: {steps} steps in {time.perf_counter() - started:.0f} s")
    if confidence_spread is not None:
        median, std = spread_confidence(drafter, transcripts, confidence_spread)
        log(f"confidence logit: median {median:.4f}, std {std:.4f} rescaled to 0 and {confidence_spread}")
    return export_zlab(drafter, Path(out) / "drafter", dtype=torch.float32).parent


def new_drafter(
    model,
    target_dir: Path,
    kind: str,
    layers: int,
    block_size: int,
    mask_token_id: int | None,
    chunk_rows: int | None,
    init_from: Path | None,
    options: dict,
):
    """The drafter ``quick_drafter`` trains over ``model``: seeded, or warm-started from ``init_from``."""
    from transformers import AutoTokenizer

    from common.drafter.draft_config import DraftConfig
    from common.drafter.loss import LossConfig
    from common.drafter.model import build_drafter
    from producer.target_model.load import target_head_of

    text = model.config
    # Two layers over a shallow target would be spread over [1, 1] by the default rule: name them.
    layer_ids = {"target_layer_ids": [1, text.num_hidden_layers // 2]} if text.num_hidden_layers < 8 else {}
    overrides = {"kind": kind, "block_size": block_size, **layer_ids, "options": options}
    tokenizer = AutoTokenizer.from_pretrained(target_dir) if mask_token_id is None else None
    # the mask token as the trainer picks it (drafter.mask_token_id unset)
    config = DraftConfig.from_target(text, layers, tokenizer, mask_token_id, **overrides)
    torch.manual_seed(0)
    loss_config = LossConfig() if chunk_rows is None else LossConfig(chunk_rows=chunk_rows)
    drafter = build_drafter(config, target_head_of(model), loss_config)
    if init_from is not None:
        from safetensors.torch import load_file

        from common.drafter.export import WEIGHTS_FILE, drafter_folder

        drafter.warm_start(load_file(str(drafter_folder(Path(init_from))[0] / WEIGHTS_FILE)))
    return drafter


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
    parser.add_argument("--chunk-rows", type=int, help="the loss's rows at once (default: LossConfig's)")
    parser.add_argument("--init-from", type=Path, help="start from this checkpoint's or export's drafter (warm start)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument(
        "--confidence-spread",
        type=float,
        metavar="S",
        help="rescale the trained confidence head: its logit over the answers' blocks to median 0, deviation S (a "
        "cut at 0.5 then cuts about half of the slots; for served checks of a confidence cut)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one of the kind's own options ([drafter.<kind>]), a JSON value or a string: markov_rank=32",
    )
    args = parser.parse_args(argv)
    try:
        options = dict(option_value(text) for text in args.option)
    except ValueError as error:
        parser.error(str(error))
    from launch.bench.served.check import resolve_target
    from launch.bench.served.prompts import read_prompts

    torch.set_num_threads(1)
    target_dir = resolve_target(args.target)
    prompts = read_prompts(args.prompts, target_dir, args.num_prompts)
    print(quick_drafter(target_dir, args.kind, prompts, args.out, args.new_tokens, args.steps, args.layers,
                        args.block_size, args.mask_token_id, args.num_anchors, chunk_rows=args.chunk_rows,
                        confidence_spread=args.confidence_spread, init_from=args.init_from, lr=args.lr,
                        **options))  # fmt: skip
    return 0


def option_value(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` as (name, the value read as JSON, else the string itself)."""
    import json

    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--option {text!r}: NAME=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


if __name__ == "__main__":
    sys.exit(main())

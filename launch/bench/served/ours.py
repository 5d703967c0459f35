"""The sides of a served check that run in this process: our evaluator, our live decoder and z-lab's ``dflash_generate``
(PyPI's ``dflash``, the authors' own decoder), each on the same prompts, target, drafter and stop tokens.

  evaluator  ``Evaluator.reference_for`` + ``Evaluator.decode`` (launch.evaluate's): the target's greedy text, replayed
             with the drafter's proposals;
  live       ``speculative_decode``: draft, verify with the target's KV cache, accept, as a server does;
  z-lab      our export loaded by z-lab's own model class and decoded by its ``dflash_generate``, ``B - 1`` tokens
             further than the answer (it drafts a short block where fewer are left).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.bench.served.schedule import PromptRun, Side


@dataclass
class Loaded:
    """The target and the drafter as every in-process side uses them."""

    model: object
    drafter: object
    draft_dir: Path
    block_size: int
    seconds: float


def load(target_dir: Path, draft: Path, dtype: str) -> Loaded:
    """The target (``dtype``) and the drafter of an export or a checkpoint, cast to ``dtype`` as servers run it."""
    from common.config import TargetConfig
    from common.drafter.export import drafter_folder, load_drafter
    from common.drafter.loss import LossConfig
    from producer.target import load_target_model
    from producer.verify import target_head_of

    torch.set_num_threads(1)
    started = time.perf_counter()
    model = load_target_model(TargetConfig(path=str(target_dir), dtype=dtype, device="cpu"))
    folder, own_checkpoint = drafter_folder(draft)
    drafter = load_drafter(folder, target_head_of(model), LossConfig(), own_checkpoint=own_checkpoint, device="cpu")
    drafter.to(
        getattr(torch, dtype)
    )  # as servers run it (their dtype applies to the draft too); the head is the target's
    drafter.eval()
    return Loaded(model, drafter, folder, drafter.config.block_size, time.perf_counter() - started)


def evaluator_and_live(
    loaded: Loaded, prompts: list[list[int]], max_new_tokens: int, stops: list[int], live: bool
) -> tuple[Side, Side | None, object]:
    """(our evaluator's side, the live decoder's or None, the evaluator: its reference gives the target's margins)."""
    import numpy as np

    from common.batch import Document
    from common.config import EvalConfig
    from common.drafter.evaluate import DraftContext
    from producer.verify import Evaluator, GreedyTarget, speculative_decode

    block_size, drafter = loaded.block_size, loaded.drafter
    # Each prompt is a document whose one supervised token follows it (prompt_len 0 reads the prompt back).
    documents = [
        Document(i, np.asarray(ids + [ids[-1]], dtype=np.int32), np.asarray([0] * len(ids) + [1], dtype=np.uint8))
        for i, ids in enumerate(prompts)
    ]
    config = EvalConfig(num_prompts=len(prompts), max_new_tokens=max_new_tokens, prompt_len=0)
    layer_ids = list(drafter.config.target_layer_ids)
    evaluator = Evaluator(loaded.model, documents, config, layer_ids, num_anchors=0, stop_token_ids=frozenset(stops))
    started = time.perf_counter()
    with evaluator.evaluation_context():
        reference, _ = evaluator.reference_for(block_size)
        decoded = evaluator.decode(drafter, reference)
    ours = Side("evaluator", [PromptRun(d.tokens, list(d.accepted)) for d in decoded], block_size)
    ours.seconds = time.perf_counter() - started
    live_side = None
    if live:
        started = time.perf_counter()
        target = GreedyTarget(loaded.model, layer_ids)
        with evaluator.evaluation_context():
            runs = [
                speculative_decode(DraftContext(drafter), target, torch.tensor(ids), max_new_tokens, frozenset(stops))
                for ids in prompts
            ]
        target.detach()
        live_side = Side("live", [PromptRun(d.tokens, list(d.accepted)) for d in runs], block_size)
        live_side.seconds = time.perf_counter() - started
    return ours, live_side, evaluator


def zlab_side(loaded: Loaded, prompts: list[list[int]], max_new_tokens: int, stops: list[int], dtype: str) -> Side:
    """z-lab's ``dflash_generate`` with our drafter loaded by its own class from the export's folder."""
    import dflash.model
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

    from common.drafter.evaluate import cut_answer

    if not torch.cuda.is_available():
        dflash.model._cuda_time = time.perf_counter  # its statistics time through CUDA otherwise
    architectures = json.loads((loaded.draft_dir / "config.json").read_text()).get("architectures") or []
    model_class = DFlash2DraftModel if "DFlash2DraftModel" in architectures else DFlashDraftModel
    reference = model_class.from_pretrained(loaded.draft_dir, torch_dtype=getattr(torch, dtype)).eval()
    block_size = loaded.block_size
    started = time.perf_counter()
    runs = []
    with torch.no_grad():
        for ids in prompts:
            prompt = torch.tensor(ids)[None]
            out = dflash_generate(
                reference, loaded.model, prompt, max_new_tokens + block_size - 1, sorted(stops) or None,
                return_stats=True,
            )  # fmt: skip
            tokens = cut_answer(out.output_ids[0, len(ids) :].tolist(), max_new_tokens, frozenset(stops))
            runs.append(PromptRun(tokens, [int(n) - 1 for n in out.acceptance_lengths]))
    side = Side("z-lab", runs, block_size)
    side.seconds = time.perf_counter() - started
    return side


def margin_function(loaded: Loaded, prompts: list[list[int]], reference: Side):
    """``margin_at(prompt, position)``: our target's top-two logit margin before answer token ``position`` of the
    reference side (where two implementations of the target may choose differently)."""

    @torch.no_grad()
    def margin_at(prompt: int, position: int) -> float:
        ids = prompts[prompt] + reference.runs[prompt].tokens[:position]
        logits = loaded.model(torch.tensor(ids)[None]).logits[0, -1].float()
        top = torch.topk(logits, 2).values
        return float(top[0] - top[1])

    return margin_at

"""The sides of a served check that run in this process: our evaluator, our live decoder and z-lab's ``dflash_generate``
(PyPI's ``dflash``, the authors' own decoder), each on the same prompts, target, drafter and stop tokens.

  evaluator  ``AcceptanceEvaluator.reference_for`` + ``AcceptanceEvaluator.decode`` (launch.evaluate's): the target's greedy text, replayed
             with the drafter's proposals;
  live       ``speculative_decode``: draft, verify with the target's KV cache, accept, as a server does;
  z-lab      our export loaded by z-lab's own model class and decoded by its ``dflash_generate``, ``B - 1`` tokens
             further than the answer (it drafts a short block where fewer are left); for the kinds PyPI's ``dflash``
             has a class of (DFlash, DFlash 2: not DSpark).

A confidence cut (``confidence_min``, a drafter with a confidence head) cuts every block of our evaluator and live
decoder as llama.cpp's ``--spec-draft-p-min`` does; both then say how many drafts each verify forward verified.
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
    from producer.target_model.load import load_target_model, target_head_of

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


def has_confidence(loaded: Loaded) -> bool:
    """Whether the drafter proposes with a per-slot confidence (a confidence head), from one proposal over a context
    of one token of zero features."""
    from producer.acceptance.decoder import DraftContext

    weight = loaded.drafter.fc.weight
    context = DraftContext(loaded.drafter)
    with torch.no_grad():
        context.extend(torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device))
        return context.proposal(0, 1).confidence is not None


class CutMargin:
    """While active with a cut (``confidence_min`` > 0), reads every proposal's confidences and keeps the smallest distance between the cut and a
    confidence that decided a block (the slots up to the first below the cut, that one included): how near the cut
    came to a tie, where another arithmetic of the same head may cut one slot earlier or later."""

    def __init__(self, drafter, confidence_min: float) -> None:
        self.drafter, self.confidence_min = drafter, confidence_min
        self.margin: float | None = None

    def __enter__(self) -> CutMargin:
        self._before = self.drafter.__dict__.get("propose")  # a wrapper already there (none: the class's method)
        if self.confidence_min <= 0:
            return self
        propose = self.drafter.propose

        def recorded(*args, **kwargs):
            proposal = propose(*args, **kwargs)
            if proposal.confidence is not None:
                kept = proposal.kept_drafts(self.confidence_min)
                slots = torch.arange(proposal.confidence.shape[1], device=kept.device)
                deciding = slots[None, :] <= kept[:, None]
                distance = (proposal.confidence.double() - self.confidence_min).abs()[deciding]
                if distance.numel():
                    nearest = float(distance.min())
                    self.margin = nearest if self.margin is None else min(self.margin, nearest)
            return proposal

        self.drafter.propose = recorded
        return self

    def __exit__(self, *exc) -> None:
        if self.confidence_min <= 0:
            return
        if self._before is None:
            del self.drafter.propose
        else:
            self.drafter.propose = self._before


def zlab_serves(loaded: Loaded) -> bool:
    """Whether PyPI's ``dflash`` has a model class of the drafter's kind (DFlash, DFlash 2; not DSpark)."""
    import dflash.model

    from common.drafter.kinds import kind_of

    return hasattr(dflash.model, kind_of(loaded.drafter.config.kind).zlab_architecture)


def evaluator_and_live(
    loaded: Loaded,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: list[int],
    live: bool,
    confidence_min: float = 0.0,
) -> tuple[Side, Side | None, object]:
    """(our evaluator's side, the live decoder's or None, the evaluator: its reference gives the target's margins);
    ``confidence_min`` cuts each block as ``eval.confidence_min`` does."""
    import numpy as np

    from common.batch import Document
    from common.config import EvalConfig
    from producer.acceptance.decoder import DraftContext, speculative_decode
    from producer.acceptance.evaluator import AcceptanceEvaluator
    from producer.target_model.greedy import GreedyTarget

    block_size, drafter = loaded.block_size, loaded.drafter
    # Each prompt is a document whose one supervised token follows it (prompt_len 0 reads the prompt back).
    documents = [
        Document(i, np.asarray(ids + [ids[-1]], dtype=np.int32), np.asarray([0] * len(ids) + [1], dtype=np.uint8))
        for i, ids in enumerate(prompts)
    ]
    config = EvalConfig(num_prompts=len(prompts), max_new_tokens=max_new_tokens, prompt_len=0)
    layer_ids = list(drafter.config.target_layer_ids)
    evaluator = AcceptanceEvaluator(
        loaded.model, documents, config, layer_ids, num_anchors=0, stop_token_ids=frozenset(stops)
    )
    started = time.perf_counter()
    with evaluator.evaluation_context(), CutMargin(drafter, confidence_min) as cut:
        reference, _ = evaluator.reference_for(block_size)
        decoded = evaluator.decode(drafter, reference, confidence_min)
    ours = Side("evaluator", [PromptRun(d.tokens, list(d.accepted), list(d.drafted)) for d in decoded], block_size)
    ours.seconds = time.perf_counter() - started
    if confidence_min > 0:
        ours.notes["cut_margin"] = cut.margin
    live_side = None
    if live:
        started = time.perf_counter()
        target = GreedyTarget(loaded.model, layer_ids)
        with evaluator.evaluation_context():
            runs = [
                speculative_decode(
                    DraftContext(drafter, confidence_min), target, torch.tensor(ids), max_new_tokens, frozenset(stops)
                )
                for ids in prompts
            ]
        target.detach()
        live_side = Side("live", [PromptRun(d.tokens, list(d.accepted), list(d.drafted)) for d in runs], block_size)
        live_side.seconds = time.perf_counter() - started
    return ours, live_side, evaluator


def zlab_side(loaded: Loaded, prompts: list[list[int]], max_new_tokens: int, stops: list[int], dtype: str) -> Side:
    """z-lab's ``dflash_generate`` with our drafter loaded by its own class from the export's folder."""
    import dflash.model
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate

    from common.acceptance.arithmetic import cut_answer

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


def cut_margin_function(loaded: Loaded, prompts: list[list[int]], reference: Side, confidence_min: float):
    """``cut_margin_at(prompt, position, draft)``: the distance from the cut of the confidence of draft ``draft``
    (0-based) of the block anchored at answer token ``position - 1`` of the reference side, that block proposed alone
    (the live decoder's arithmetic) over the target's features of the text before it."""
    from producer.acceptance.decoder import DraftContext
    from producer.target_model.greedy import GreedyTarget

    layer_ids = list(loaded.drafter.config.target_layer_ids)

    @torch.no_grad()
    def cut_margin_at(prompt: int, position: int, draft: int) -> float:
        answer = reference.runs[prompt].tokens
        ids = prompts[prompt] + answer[: position - 1]  # the anchor's own features are never context
        target = GreedyTarget(loaded.model, layer_ids)
        try:
            target.reset()
            _, features = target.forward(torch.tensor(ids), 0, logits=False)
            context = DraftContext(loaded.drafter)  # no cut: every draft's confidence
            context.extend(features)
            confidence = context.proposal(answer[position - 1], len(ids)).confidence[0]
        finally:
            target.detach()
        return abs(float(confidence[draft]) - confidence_min)

    return cut_margin_at

"""What a decoding round costs, timed as a server runs it, for the break-even tau of each context length: the
drafter's round (``time_draft_round``) and the target's verify and decode forwards (``time_target_round``), each the
fastest of a few runs after a warm-up, on the device's own clock (``ForwardTimer``)."""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from common.drafter.base import Drafter
from producer.acceptance.decoder import context_rows, draft_rows
from producer.target_model.greedy import GreedyTarget


class ForwardTimer:
    """Seconds of work on ``device``: on a GPU the wall clock after the queued kernels are done; on a CPU the calling
    thread's CPU time, which is what a forward costs there whatever else the cores run (the evaluation runs the models
    on one thread, ``AcceptanceEvaluator.evaluation_context``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.clock()


class _CachedProjection(nn.Module):
    """A draft attention's key or value projection whose context rows are projected once, as a server's draft KV cache
    holds them: a call on the context's rows returns them; any other (the block's slots) projects."""

    def __init__(self, projection: nn.Module, context: torch.Tensor) -> None:
        super().__init__()
        self.projection = projection
        self.context_rows = context.shape[0]
        self.projected = projection(context)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projected if x.shape[0] == self.context_rows else self.projection(x)


@contextlib.contextmanager
def _context_kv_cached(drafter: Drafter, context: torch.Tensor):
    """The drafter's layers with their context keys and values projected once (``_CachedProjection``); the layers
    as they were afterwards."""
    attentions = [layer.self_attn for layer in drafter.layers]
    originals = [(attention.k_proj, attention.v_proj) for attention in attentions]
    try:
        for attention, (k_proj, v_proj) in zip(attentions, originals):
            attention.k_proj = _CachedProjection(k_proj, context)
            attention.v_proj = _CachedProjection(v_proj, context)
        yield
    finally:
        for attention, (k_proj, v_proj) in zip(attentions, originals):
            attention.k_proj, attention.v_proj = k_proj, v_proj


@torch.no_grad()
def time_draft_round(drafter: Drafter, context: int, repeats: int) -> float:
    """Seconds of the drafter's part of one decoding round at ``context`` tokens of context, as a server runs it (the
    fastest of ``repeats`` timed runs after a warm-up): the newly kept tokens' features fused and their keys and values
    projected (B of them, the most a round keeps), then one forward of the block over the context's cached keys and
    values, and its draft tokens through the target's head. Random features: the cost does not depend on them.

    The evaluator's own decoding (``draft_rows``) projects the whole context again at every round, which a server
    never does; here each layer's context projections are made once beforehand (``_context_kv_cached``). Their
    per-head norm and rotary embedding still run per round: a slight overstatement, linear in the context."""
    config = drafter.config
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    generator = torch.Generator(device=device).manual_seed(0)
    features = torch.randn(
        context + config.block_size, config.fused_feature_size, generator=generator, device=device, dtype=dtype
    )
    fused = drafter.fuse_context(features[:context])
    anchor = torch.zeros(1, dtype=torch.long, device=device)
    position = torch.tensor([context], device=device)
    # A context no longer than a block cannot be told from the block's slots by its rows; projecting it costs nothing.
    cached = _context_kv_cached(drafter, fused) if context > config.block_size else contextlib.nullcontext()
    timer = ForwardTimer(device)
    times = []
    with cached:
        for repeat in range(repeats + 1):
            started = timer.now()
            new = drafter.fuse_context(features[context:])
            for layer in drafter.layers:
                layer.self_attn.k_proj(new)
                layer.self_attn.v_proj(new)
            drafter.propose(
                draft_rows(drafter, [fused], anchor, position), anchor, context=context_rows(drafter, [fused])
            )
            if repeat:
                times.append(timer.now() - started)
    return min(times)


@torch.no_grad()
def time_target_round(
    target: GreedyTarget, tokens: torch.Tensor, context: int, block_size: int, repeats: int
) -> tuple[float, float]:
    """Seconds of the target's verify forward of one block (``block_size`` tokens, every one's logits) and of its
    one-token decode forward, both after a prefill of ``context`` tokens of ``tokens`` (so its KV cache holds what
    decoding holds there): the fastest of ``repeats`` timed runs after a warm-up (other work on the machine only adds
    time). The cache is put back between runs."""
    target.reset()
    target.forward(tokens[:context], 0, logits=False)
    target.save_state()
    block = tokens[context : context + block_size]
    timer = ForwardTimer(target.device)
    verify, decode = [], []
    for repeat in range(repeats + 1):
        for fed, times in ((block, verify), (block[:1], decode)):
            started = timer.now()
            target.forward(fed, context)
            if repeat:  # the first is the warm-up
                times.append(timer.now() - started)
            target.restore_state()
            target.crop(context)
    return min(verify), min(decode)

"""The target's side of acceptance evaluation: greedy verification against the target's KV cache (``GreedyTarget``),
its greedy transcripts, real speculative decoding (``speculative_decode``, ``greedy_decode``), the target's forwards
timed, and the ``Evaluator`` that runs them against a drafter on held-out prompts (producer 0's evaluations,
producer/evaluation.py, and ``launch.evaluate``). The drafter's acceptance arithmetic (what a block accepts,
simulated acceptance, tau in both conventions, the report) is common/drafter/evaluate.py's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from common.acceptance.arithmetic import (
    AcceptanceReport,
    Decoded,
    DocumentFeatures,
    DraftContext,
    DraftRows,
    ForwardTimer,
    RoundCosts,
    Transcript,
    acceptance_by_length,
    answer_finished,
    cut_answer,
    decoded_span,
    decoding_anchors,
    drafts_per_accepted,
    greedy_text,
    prompt_of,
    reference_length,
    replay_rows,
    sampling_seed,
    simulated_acceptance,
    streak_figures,
    teacher_forced,
    time_draft_round,
    timing_contexts,
    turn_documents,
    zlab_tau,
)
from common.batch import Document
from common.config import EvalConfig
from common.drafter.base import Drafter
from common.drafter.sampling import Sampling, rejection_sample, sample_from, sampling_probs
from common.drafter.target_head import TargetHead

log = logging.getLogger(__name__)


class GreedyTarget:
    """The target as a greedy verifier: forwards through its KV cache that return its argmax tokens and
    the drafter's features of the same tokens.

    Features are the outputs of decoder layers ``layer_ids`` read by forward hooks, i.e. exactly what the
    producers capture (before the final norm, even for the last layer; HF's ``hidden_states[-1]`` is after
    it). With ``capture_last`` the last decoder layer's output is kept too (target label modes).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], capture_last: bool = False) -> None:
        self.model = model
        layers = model.get_decoder().layers
        self.layer_ids = list(layer_ids)
        self.last_layer = len(layers) - 1 if capture_last else None
        self.device = next(model.parameters()).device
        # transformers 5 renamed the forward's past_key_values to cache.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._outputs: dict[int, torch.Tensor] = {}
        self._layers = layers
        self._hooks: list[Any] = []
        # Gated-DeltaNet layers: their cache holds a state, not one entry per token (see save_state).
        self.recurrent = any(hasattr(layer, "linear_attn") for layer in layers)
        self.cache = None
        self._saved_states: list[tuple[Any, dict, dict]] = []
        self._keep_logits = False
        self._logits: torch.Tensor | None = None

    def _keep_output(self, layer_id: int, _module: nn.Module, _args: Any, output: Any) -> None:
        self._outputs[layer_id] = output[0] if isinstance(output, tuple) else output

    def attach(self) -> None:
        """Hook the captured layers (done by ``forward`` when needed)."""
        if not self._hooks:
            wanted = {*self.layer_ids, *([self.last_layer] if self.last_layer is not None else [])}
            self._hooks = [self._layers[k].register_forward_hook(partial(self._keep_output, k)) for k in sorted(wanted)]

    def detach(self) -> None:
        """Remove the hooks and what they kept: a producer evaluating between batches captures with the same
        modules (its compiled layers must see them as they were, and no feature may stay referenced)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._outputs = [], {}
        self.cache = None
        self._saved_states = []

    def reset(self) -> None:
        """Empty the KV cache (a new prompt)."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        for layer in self.cache.layers:  # sliding-window layers can then be cropped
            if hasattr(layer, "activate_past_recording") and not _is_state_layer(layer):
                layer.activate_past_recording()

    @torch.no_grad()
    def forward(
        self, token_ids: torch.Tensor, start: int, logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Tokens ``[L]`` at positions ``start ..`` through the cache: (the target's greedy next token after
        each ``[L]``, or None without ``logits``; the drafter's features ``[L, n * H]``)."""
        self.attach()
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)[None]
        # In its own dtype as the producers run it, whatever autocast the drafter runs under; logits_to_keep=1
        # skips the vocabulary-wide head where no token is needed (a long prefill).
        with torch.autocast(self.device.type, enabled=False):
            out = self.model(
                input_ids=token_ids[None].to(self.device),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=0 if logits else 1,
                **{self._cache_arg: self.cache},
            )
        features = torch.cat([self._outputs[k][0] for k in self.layer_ids], dim=-1)
        if self._keep_logits:
            self._logits = out.logits[0]
        return (out.logits[0].argmax(-1) if logits else None), features

    def forward_logits(self, token_ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for sampled decoding: (the target's logits ``[L, V]`` after each token, the features). Through
        ``forward`` itself, so that a subclass that mirrors it (a tensor-parallel target) mirrors this too."""
        self._keep_logits = True
        try:
            _, features = self.forward(token_ids, start)
        finally:
            self._keep_logits = False
        logits, self._logits = self._logits, None
        return logits, features

    @property
    def batchable(self) -> bool:
        """Whether prompts can be decoded together (``forward_rows``, left-padded rows). Not for a hybrid target
        (a recurrent state cannot skip a row's padding) nor for sliding-window layers (their cache keeps the last
        slots, which padding would push out of the window): those decode one prompt at a time."""
        types = getattr(self.model.config, "layer_types", None) or []
        sliding = any(t != "full_attention" for t in types) or (
            not types
            and getattr(self.model.config, "sliding_window", None) is not None
            and getattr(self.model.config, "use_sliding_window", True)
        )
        return not self.recurrent and not sliding

    @torch.no_grad()
    def forward_rows(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv_valid: torch.Tensor, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of tokens ``[R, L]`` at their own ``positions`` ``[R, L]`` through one cache of ``R`` rows:
        (each row's greedy next tokens ``[R, L]``, or ``[R, 1]`` with ``last_logits_only``; features ``[R, L, n * H]``).

        ``kv_valid`` ``[R, S + L]`` says which cache slots (the ``S`` already there, then the new ones) each row
        sees: a shorter row's left padding stays in the cache as holes no query attends to. Attention follows
        the positions, not the slots (``_row_masks``), so every row's tokens get what a forward of that row
        alone would give.
        """
        self.attach()
        with torch.autocast(self.device.type, enabled=False):
            out = self.model(
                input_ids=token_ids.to(self.device),
                position_ids=positions,
                use_cache=True,
                attention_mask=self._row_masks(positions.shape[1], kv_valid),
                logits_to_keep=1 if last_logits_only else 0,
                **{self._cache_arg: self.cache},
            )
        features = torch.cat([self._outputs[k] for k in self.layer_ids], dim=-1)
        return out.logits.argmax(-1), features

    def _row_masks(self, num_new: int, kv_valid: torch.Tensor) -> torch.Tensor:
        """4D boolean mask ``[R, 1, L, S + L]``: a query sees the valid slots up to its own, a padding query only
        itself (so that no row of the attention is empty). Causality by slot is causality by position, since
        each row's valid slots are in position order."""
        total = kv_valid.shape[1]
        slot = torch.arange(total, device=self.device)
        query_slot = total - num_new + torch.arange(num_new, device=self.device)
        itself = slot[None, :] == query_slot[:, None]
        return ((kv_valid[:, None, :] & (slot[None, :] <= query_slot[:, None])[None]) | itself[None])[:, None]

    def last_rows(self) -> torch.Tensor | None:
        """``[R, L, H]`` output of the last decoder layer of every row in the latest forward (None: not captured)."""
        return self._outputs[self.last_layer] if self.last_layer is not None else None

    def last_hidden(self) -> torch.Tensor:
        """``[L, H]`` output of the last decoder layer in the latest forward (needs ``capture_last``)."""
        return self._outputs[self.last_layer][0]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the KV cache (recurrent states stay as they are: put them
        back with ``restore_state`` first where they ran past ``length``)."""
        for layer in self.cache.layers:
            # Each key-value layer by its own length: the cache's length is its first layer's, a linear layer's count
            # in a hybrid target (transformers 5.25 on), which save_state and restore_state keep apart.
            extra = layer.get_seq_length() - length if not _is_state_layer(layer) else 0
            if extra > 0:
                layer.crop(-extra)  # negative: tokens to remove, the meaning every transformers version shares

    def save_state(self) -> None:
        """Copy the recurrent and convolution states of the Gated-DeltaNet layers, and the length they have seen
        where the cache keeps one (transformers 5.25 on: the cache's sequence length, and so the next positions,
        is a linear layer's count); nothing for other targets."""
        if not self.recurrent:
            return
        self._saved_states = [
            (
                layer,
                {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
                {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
                _seen_length(layer).clone() if _seen_length(layer) is not None else None,
            )
            for layer in self.cache.layers
            if _is_state_layer(layer)
        ]

    def restore_state(self) -> None:
        """Put back the states of the last ``save_state``, in place."""
        for layer, conv, recurrent, seen in self._saved_states:
            for i, saved in conv.items():
                layer.conv_states[i].copy_(saved)
            for i, saved in recurrent.items():
                layer.recurrent_states[i].copy_(saved)
            if seen is not None:
                _seen_length(layer).copy_(seen)


def _seen_length(layer: Any) -> torch.Tensor | None:
    """The tokens a linear-attention cache layer has seen, where its transformers version counts them."""
    return getattr(layer, "cumulative_length_linear", None)


def _is_state_layer(layer: Any) -> bool:
    """A cache layer that holds a fixed-size state (linear attention, convolution) instead of per-token keys."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


def _kept_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` to keep between evaluations: page-locked when it comes from a GPU, so that the
    next evaluation's upload is one fast copy; a CPU tensor is kept as it is."""
    if tensor.device.type == "cpu":
        return tensor
    kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    kept.copy_(tensor)
    return kept


@torch.no_grad()
def greedy_transcripts(
    target: GreedyTarget, prompts: Sequence[torch.Tensor], length: int, rows_at_once: int
) -> list[Transcript]:
    """Each prompt's greedy continuation of ``length`` tokens with the features of every token: ``rows_at_once``
    prompts per forward where the target allows (``target.batchable``), else one at a time."""
    if target.batchable and rows_at_once > 1:
        return [
            t
            for i in range(0, len(prompts), rows_at_once)
            for t in _greedy_rows(target, prompts[i : i + rows_at_once], length)
        ]
    return [_greedy_one(target, prompt, length) for prompt in prompts]


def _greedy_one(target: GreedyTarget, prompt: torch.Tensor, length: int) -> Transcript:
    target.reset()
    greedy, features = target.forward(prompt, 0)
    tokens, parts, lasts = [greedy[-1:]], [features], [target.last_rows()]
    for step in range(length - 1):  # each token fed back gives its own features; the last is never fed
        greedy, features = target.forward(tokens[-1], prompt.numel() + step)
        tokens.append(greedy[-1:])
        parts.append(features)
        lasts.append(target.last_rows())
    last = _kept_on_host(torch.cat([rows[0] for rows in lasts])) if lasts[0] is not None else None
    return Transcript(
        prompt.numel(), prompt.tolist() + torch.cat(tokens).tolist(), _kept_on_host(torch.cat(parts)), last
    )


def _greedy_rows(target: GreedyTarget, prompts: Sequence[torch.Tensor], length: int) -> list[Transcript]:
    """``_greedy_one`` of several prompts at once, left-padded in one cache (every row gets what it gets alone)."""
    device = target.device
    lengths = [int(p.numel()) for p in prompts]
    width, rows = max(lengths), len(prompts)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    kv_valid = torch.zeros_like(ids, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, width - lengths[r] :] = prompt.to(device)
        positions[r, width - lengths[r] :] = torch.arange(lengths[r], device=device)
        kv_valid[r, width - lengths[r] :] = True
    target.reset()
    greedy, prefill = target.forward_rows(ids, positions, kv_valid, last_logits_only=True)
    prefill_last, fed_last = target.last_rows(), []
    tokens, fed = [greedy[:, -1:]], []
    next_position = torch.tensor(lengths, device=device)[:, None]
    for step in range(length - 1):
        kv_valid = torch.cat([kv_valid, torch.ones(rows, 1, dtype=torch.bool, device=device)], dim=1)
        greedy, features = target.forward_rows(tokens[-1], next_position + step, kv_valid, last_logits_only=True)
        tokens.append(greedy[:, -1:])
        fed.append(features)
        fed_last.append(target.last_rows())
    continuation = torch.cat(tokens, dim=1).tolist()
    fed_features = torch.cat(fed, dim=1) if fed else prefill[:, :0]

    def last_of(r: int, n: int) -> torch.Tensor | None:
        if prefill_last is None:
            return None
        later = [rows[r] for rows in fed_last]
        return _kept_on_host(torch.cat([prefill_last[r, width - n :], *later]))

    return [
        Transcript(
            n,
            prompt.tolist() + continuation[r],
            _kept_on_host(torch.cat([prefill[r, width - n :], fed_features[r]])),
            last_of(r, n),
        )
        for r, (prompt, n) in enumerate(zip(prompts, lengths))
    ]


def document_features(target: GreedyTarget, document: Document) -> DocumentFeatures:
    """One forward of the whole document: its features, and its last layer's output when the target captures it."""
    target.reset()
    _, features = target.forward(torch.as_tensor(document.input_ids, dtype=torch.long), 0, logits=False)
    return DocumentFeatures(features, target.last_hidden() if target.last_layer is not None else None)


@dataclass
class TargetReference:
    """The target's half of every evaluation on one held-out set: made once, by target forwards, and reused for
    every drafter with the same target layers."""

    transcripts: list[Transcript]
    """One per evaluated prompt."""
    records: list[DocumentFeatures | None]
    """One per held-out record: the features of all its turns."""
    seconds: float
    """How long making it took."""

    @property
    def continuation_length(self) -> int:
        """The shortest greedy continuation (0 without transcripts: a sampled evaluation makes none)."""
        return min((len(t.continuation) for t in self.transcripts), default=0)


@torch.no_grad()
def speculative_decode(
    context: DraftContext,
    target: GreedyTarget,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: frozenset[int] = frozenset(),
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Live greedy speculative decoding of ``prompt`` ``[P]`` with a fresh drafter ``context``, as a server runs it
    (one prompt; the reference ``replay_rows`` must equal): the target's greedy text, and what was accepted.
    With ``sampling`` at a temperature above 0, sampled speculative decoding instead (``generator`` draws every
    token): the prefill's token is drawn from the target, the drafter's kind draws the block from its proposal q,
    and ``rejection_sample`` verifies it against the target's distribution p of the same forward, so the text is
    distributed as the target's own sampling.

      1. the target prefills the prompt into its KV cache: the first new token, and the features of every
         prompt token;
      2. the drafter fills the block from the features of every kept token before it;
      3. the target verifies the block in one forward;
      4. the KV cache is cropped to the kept tokens, and the drafter's context is extended with the kept
         tokens' features from that same forward. Back to 2.
    A hybrid target's Gated-DeltaNet layers hold a recurrent state and a convolution window that cannot be
    cropped: their state before the block is kept, and when a draft token was rejected it is put back and the
    kept tokens are run again (``Decoded.replayed``).
    """
    sampled = sampling is not None and not sampling.greedy
    target.reset()
    if sampled:
        logits, features = target.forward_logits(prompt, 0)
        first = int(sample_from(sampling_probs(logits[-1], sampling), generator))
    else:
        greedy, features = target.forward(prompt, 0)
        first = int(greedy[-1])
    context.extend(features)
    tokens, accepted, drafted_counts, replayed = [first], [], [], []
    while not answer_finished(tokens, max_new_tokens, stop_token_ids):
        anchor = prompt.shape[0] + len(tokens) - 1  # position of the last kept token
        if sampled:
            proposal = context.proposal(tokens[-1], anchor, sampling, generator)
            drafted = proposal.tokens[0]
            block = torch.cat([drafted.new_tensor([tokens[-1]]), drafted])
            target.save_state()
            logits, features = target.forward_logits(block, anchor)
            target_probs = sampling_probs(logits, sampling)
            draft_probs = proposal.dense(target_probs.shape[-1]).probs
            kept_drafts, after = rejection_sample(drafted[None], target_probs[None], draft_probs, generator)
            num_accepted, next_token = int(kept_drafts[0]), int(after[0])
        else:
            drafted = context.propose(tokens[-1], anchor)
            block = torch.cat([drafted.new_tensor([tokens[-1]]), drafted])
            target.save_state()  # a hybrid target's recurrent state before the block
            verified, features = target.forward(block, anchor)  # verified[i]: the target's token after block[:i + 1]
            num_accepted = int((drafted == verified[:-1]).long().cumprod(0).sum())
            next_token = int(verified[num_accepted])
        accepted.append(num_accepted)
        drafted_counts.append(int(drafted.shape[0]))
        tokens += drafted[:num_accepted].tolist() + [next_token]
        kept = num_accepted + 1  # the anchor and the accepted drafts; the correction is the next anchor
        if target.recurrent and kept < block.shape[0]:
            # The state ran over rejected tokens and cannot be cropped: back to before the block, run the kept again.
            target.restore_state()
            target.crop(anchor)
            _, features = target.forward(block[:kept], anchor, logits=False)
            replayed.append(kept)
        else:
            target.crop(anchor + kept)
        context.extend(features[:kept])
    return Decoded(cut_answer(tokens, max_new_tokens, stop_token_ids), accepted, drafted_counts, replayed)


@torch.no_grad()
def greedy_decode(
    target: GreedyTarget, prompt: torch.Tensor, max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset()
) -> list[int]:
    """Plain greedy decoding, one target forward per token: the reference speculative decoding must equal."""
    target.reset()
    greedy, _ = target.forward(prompt, 0)
    tokens = [int(greedy[-1])]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
        greedy, _ = target.forward(greedy[-1:], prompt.shape[0] + len(tokens) - 1)
        tokens.append(int(greedy[-1]))
    return tokens


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


class Evaluator:
    """Real and simulated acceptance of drafters against one loaded target, on fixed held-out documents.

    The first evaluation makes the target's reference (``TargetReference``); later ones reuse it and run the drafter
    only, until a drafter with a larger block needs longer continuations.
    """

    def __init__(
        self,
        target_model: nn.Module,
        documents: list[Document],
        config: EvalConfig,
        layer_ids: list[int],
        num_anchors: int,
        capture_last: bool = False,
        stop_token_ids: frozenset[int] = frozenset(),
        make_target: Callable[..., GreedyTarget] = GreedyTarget,
        skipped_records: Sequence[str] = (),
    ) -> None:
        """``documents`` are the held-out records; with ``eval.every_turn`` each of their assistant turns is a prompt
        (``turn_documents``). ``make_target(model, layer_ids, capture_last)`` makes the greedy target (a
        tensor-parallel producer's mirrors its calls to the other ranks). ``skipped_records`` (``file:line reason``)
        are the held-out records left out before, which the report counts."""
        self.target = make_target(target_model, layer_ids, capture_last)
        per_turn = config.every_turn and config.prompt_len == 0
        self.records: list[Document] = []
        self.documents: list[Document] = []
        """The evaluated prompts' documents, one per prompt (``prompt_of`` gives its prompt)."""
        self.record_of: list[int] = []
        """Per prompt, the index of its record in ``records`` (whose features serve all its turns)."""
        for record in documents:
            turns = turn_documents(record, config.max_turns) if per_turn else [record]
            turns = [turn for turn in turns if prompt_of(turn, config.prompt_len).numel()]
            if turns:
                self.record_of += [len(self.records)] * len(turns)
                self.records.append(record)
                self.documents += turns
        if not self.documents:
            raise ValueError(
                "no held-out document has a prompt (tokens before its first supervised token); set eval.prompt_len"
            )
        self.prompt_lengths = [int(prompt_of(d, config.prompt_len).numel()) for d in self.documents]
        self.config = config
        self.sampling = Sampling(config.temperature, config.top_p, config.top_k)
        self.num_anchors = num_anchors
        self.stop_token_ids = frozenset(stop_token_ids)
        self.skipped_records = list(skipped_records)
        self.reference: TargetReference | None = None
        self.timing_contexts = timing_contexts(self.prompt_lengths, config.max_new_tokens, config.length_buckets)
        """Per context-length bucket, the context its round costs are timed at."""
        self._target_costs: dict[tuple[int, int], tuple[float, float]] = {}
        """(context, block size) -> the target's (verify, decode) seconds there: the target is timed once."""
        self._draft_costs: dict[tuple[str, int], float] = {}
        """(drafter architecture, context) -> a draft round's seconds there."""

    @contextlib.contextmanager
    def evaluation_context(self):
        """Around what runs the target or the drafter here: no autograd, eager (layers compiled for the trainer's
        fixed shapes would recompile for every context length), one thread on a CPU (forwards of a few tokens:
        OpenMP threads cost more than they give), and the target's hooks removed afterwards."""
        threads = torch.get_num_threads()
        if self.target.device.type == "cpu":
            torch.set_num_threads(1)
        try:
            with torch.no_grad(), torch.compiler.set_stance("force_eager"), _drafter_autocast(self.target.device):
                yield
        finally:
            self.target.detach()
            torch.set_num_threads(threads)

    def prepare(self, block_size: int) -> TargetReference:
        """Make the target's reference for drafters of ``block_size`` now, and time its forwards at each bucket's
        context, ahead of the first evaluation (producer 0 does it while its ring is full and nothing is asked; the
        coupled loop before its first step)."""
        with self.evaluation_context():
            reference = self.reference_for(block_size)[0]
            self.target_costs(block_size)
            return reference

    def target_costs(self, block_size: int) -> dict[int, tuple[float, float]]:
        """Per bucket, the target's (verify, decode) seconds at its timing context: timed the first time (inside
        ``evaluation_context``), then kept."""
        if not self.config.timing_repeats:
            return {}
        longest = max(self.records, key=len).input_ids
        costs = {}
        for bucket, context in self.timing_contexts.items():
            if (context, block_size) not in self._target_costs:
                # Any tokens do: a forward's cost does not depend on them. Those of the longest record, repeated.
                tokens = torch.as_tensor(np.resize(longest, context + block_size), dtype=torch.long)
                self._target_costs[context, block_size] = time_target_round(
                    self.target, tokens, context, block_size, self.config.timing_repeats
                )
            costs[bucket] = self._target_costs[context, block_size]
        return costs

    def round_costs(self, drafter: Drafter) -> dict[int, RoundCosts]:
        """Per bucket, what a decoding round and a plain decoding step cost at its timing context (``RoundCosts``):
        the target's forwards timed once, the drafter's once per architecture (inside ``evaluation_context``)."""
        architecture = repr(drafter.config)
        costs = {}
        for bucket, (verify, decode) in self.target_costs(drafter.config.block_size).items():
            context = self.timing_contexts[bucket]
            if (architecture, context) not in self._draft_costs:
                self._draft_costs[architecture, context] = time_draft_round(
                    drafter, context, self.config.timing_repeats
                )
            costs[bucket] = RoundCosts(context, self._draft_costs[architecture, context], verify, decode)
        return costs

    def evaluate(self, drafter: Drafter) -> AcceptanceReport:
        if list(drafter.config.target_layer_ids) != self.target.layer_ids:
            raise ValueError(
                f"drafter reads target layers {drafter.config.target_layer_ids}, "
                f"this evaluator captures {self.target.layer_ids}"
            )
        started = time.perf_counter()
        was_training = drafter.training
        drafter.eval()
        try:
            with self.evaluation_context():
                reference, made = self.reference_for(drafter.config.block_size)
                decode_started = time.perf_counter()
                cut = self.config.confidence_min
                decoded = self.decode_all(drafter, reference, cut)  # its results are on the host: nothing queued
                decode_seconds = time.perf_counter() - decode_started
                # a confidence cut is reported beside the same decoding without it
                uncut = self.decode_all(drafter, reference, 0.0) if cut > 0 else None
                features = self.record_features(reference)
                spans, anchors = zip(
                    *(
                        decoded_span(d, self.config.prompt_len, self.config.max_new_tokens, drafter.config.block_size)
                        for d in self.documents
                    )
                )
                sim_tau, sim_acc = simulated_acceptance(drafter, spans, features, self.num_anchors, anchors=anchors)
                sim_tau_greedy, sim_tau_walk = (
                    self.on_greedy_text(drafter, reference.transcripts, decoded)
                    if self.sampling.greedy
                    else (None, None)
                )
                timing_started = time.perf_counter()
                costs = self.round_costs(drafter)
                timing_seconds = time.perf_counter() - timing_started
        finally:
            drafter.train(was_training)
        block_size = drafter.config.block_size
        tau, accept_pos = streak_figures([n for d in decoded for n in d.accepted], block_size)
        return AcceptanceReport(
            block_size=block_size,
            num_prompts=len(decoded),
            tau=tau if tau is not None else 1.0,
            accept_pos=accept_pos or [0.0] * (block_size - 1),
            sim_tau=sim_tau,
            sim_acc=sim_acc,
            sim_tau_greedy=sim_tau_greedy,
            sim_tau_walk=sim_tau_walk,
            generated_tokens=sum(len(d.tokens) for d in decoded),
            target_forwards=len(decoded) + sum(len(d.accepted) for d in decoded),
            seconds=time.perf_counter() - started,
            reference_seconds=reference.seconds if made else 0.0,
            decode_seconds=decode_seconds,
            zlab_tau=zlab_tau(decoded),
            sampling=self.sampling,
            seed=self.config.seed,
            by_length=acceptance_by_length(decoded, self.prompt_lengths, self.config.length_buckets, block_size, costs),
            num_records=len(self.records),
            skipped_records=self.skipped_records,
            timing_seconds=timing_seconds,
            confidence_min=self.config.confidence_min,
            drafts_per_accepted=drafts_per_accepted(decoded, block_size),
            uncut_tau=None if uncut is None else streak_figures([n for d in uncut for n in d.accepted], block_size)[0],
            uncut_drafts_per_accepted=None if uncut is None else drafts_per_accepted(uncut, block_size),
        )

    def decode_all(self, drafter: Drafter, reference: TargetReference, confidence_min: float) -> list[Decoded]:
        """Every held-out prompt decoded as the evaluation's sampling says, with the confidence cut given."""
        if self.sampling.greedy:
            return self.decode(drafter, reference, confidence_min)
        return self.decode_sampled(drafter, confidence_min)

    def record_features(self, reference: TargetReference) -> Iterable[DocumentFeatures]:
        """Each prompt's target features for its simulated acceptance: its record's (a turn's document is a prefix of
        it, and features are causal). A record whose features were not kept runs through the target once for its
        consecutive turns: only one record's features are on the device at a time."""
        made: tuple[int, DocumentFeatures] | None = None
        for r in self.record_of:
            kept = reference.records[r]
            if kept is None:
                if made is None or made[0] != r:
                    made = (r, document_features(self.target, self.records[r]))
                kept = made[1]
            yield kept

    def on_greedy_text(
        self, drafter: Drafter, transcripts: Sequence[Transcript], decoded: Sequence[Decoded]
    ) -> tuple[float, float]:
        """The training metric on the text the decoding produced: at every anchor, and at the decoding's own anchors
        (``AcceptanceReport.sim_tau_greedy`` and ``sim_tau_walk``). Data labels: that text is the target's argmax.
        One forward per prompt serves both: the decoding's anchors are some of every anchor, and a block's result
        does not depend on the blocks beside it."""
        data_labels = replace(drafter.loss_config, label_mode="data")
        every_streaks = walk_streaks = 0.0
        every_blocks = walk_blocks = 0
        for r, (transcript, one) in enumerate(zip(transcripts, decoded)):
            # Every anchor whose first label is a token the decoding kept; its block reads on past the cut, as the
            # decoding's last block does, so the two sets of anchors differ in nothing else.
            first = transcript.prompt_len
            every = torch.arange(first, first + len(one.tokens) - 1)
            if not every.numel():
                continue  # a decoding that ended at its prefill started no block
            _, metrics = teacher_forced(
                drafter,
                data_labels,
                greedy_text(transcript, r),
                DocumentFeatures(transcript.features, transcript.last_hidden),
                0,
                None,
                every,
            )
            streaks = metrics["block_streaks"]
            walk = torch.as_tensor(decoding_anchors(transcript, one), device=streaks.device) - first
            every_streaks += float(streaks.sum())
            walk_streaks += float(streaks[walk].sum())
            every_blocks += every.numel()
            walk_blocks += walk.numel()
        return 1.0 + every_streaks / max(every_blocks, 1), 1.0 + walk_streaks / max(walk_blocks, 1)

    def reference_for(self, block_size: int) -> tuple[TargetReference, bool]:
        """The target's reference for drafters of ``block_size``: (it, whether it was made now). Made by target
        forwards the first time (and again for a larger block), inside ``evaluation_context``. A sampled evaluation
        decodes live and needs no greedy continuation: its reference holds the documents' features only."""
        length = reference_length(self.config.max_new_tokens, block_size) if self.sampling.greedy else 0
        if self.reference is not None and self.reference.continuation_length >= length:
            return self.reference, False
        started = time.perf_counter()
        prompts = [prompt_of(d, self.config.prompt_len) for d in self.documents]
        transcripts = greedy_transcripts(self.target, prompts, length, self.config.batch_prompts) if length else []
        budget = int(self.config.reference_cache_gb * 2**30) - sum(t.features.nbytes for t in transcripts)
        records: list[DocumentFeatures | None] = []
        bytes_per_token = self.target_feature_bytes()
        for record in self.records:
            # Past the budget a record's features are not kept: it runs through the target at every evaluation.
            needed = len(record) * bytes_per_token
            if needed > budget:
                records.append(None)
                continue
            features = document_features(self.target, record)
            records.append(
                DocumentFeatures(
                    _kept_on_host(features.aux_hidden),
                    None if features.last_hidden is None else _kept_on_host(features.last_hidden),
                )
            )
            budget -= needed
        self.reference = TargetReference(transcripts, records, time.perf_counter() - started)
        kept = sum(d is not None for d in records)
        log.info(
            "evaluation reference: %d greedy continuations of %d tokens and %d of %d records' features kept, "
            "made in %.1f s",
            len(transcripts),
            length,
            kept,
            len(records),
            self.reference.seconds,
        )
        return self.reference, True

    def target_feature_bytes(self) -> int:
        """Host bytes per token of a document's kept features."""
        config = self.target.model.config
        width = len(self.target.layer_ids) + (1 if self.target.last_layer is not None else 0)
        return width * int(config.hidden_size) * next(self.target.model.parameters()).element_size()

    def decode(self, drafter: Drafter, reference: TargetReference, confidence_min: float = 0.0) -> list[Decoded]:
        """Every held-out prompt's speculative decoding, replayed from the reference: ``eval.batch_prompts`` prompts
        per drafter forward."""
        size, transcripts = self.config.batch_prompts, reference.transcripts
        decoded = []
        for i in range(0, len(transcripts), size):
            group = transcripts[i : i + size]
            decoded += replay_rows(
                DraftRows(drafter, [t.features for t in group], confidence_min),
                group,
                self.config.max_new_tokens,
                self.stop_token_ids,
            )
        return decoded

    def decode_sampled(self, drafter: Drafter, confidence_min: float = 0.0) -> list[Decoded]:
        """Every held-out prompt's sampled speculative decoding, live (the target verifies each block), one prompt at
        a time, prompt i drawing from a generator seeded by ``eval.seed`` and i (``sampling_seed``)."""
        decoded = []
        for index, document in enumerate(self.documents):
            generator = torch.Generator(device=self.target.device).manual_seed(sampling_seed(self.config.seed, index))
            decoded.append(
                speculative_decode(
                    DraftContext(drafter, confidence_min),
                    self.target,
                    prompt_of(document, self.config.prompt_len),
                    self.config.max_new_tokens,
                    self.stop_token_ids,
                    self.sampling,
                    generator,
                )
            )
        return decoded


def _drafter_autocast(device: torch.device):
    """The trainer's autocast for the drafter (bf16 on CUDA); GreedyTarget turns it off for the target."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def stop_tokens_of(model: nn.Module) -> frozenset[int]:
    """The target's end-of-sequence ids (none for a config without them)."""
    eos = getattr(model.config, "eos_token_id", None)
    return frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])


def target_head_of(model: nn.Module) -> TargetHead:
    """The loaded target's own embedding, final norm and lm_head (bit-identical by construction)."""
    base = model.get_decoder()
    return TargetHead(
        base.embed_tokens.weight,
        model.get_output_embeddings().weight,
        base.norm.weight,
        float(getattr(model.config, "rms_norm_eps", 1e-6)),
    )

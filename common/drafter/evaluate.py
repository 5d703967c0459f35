"""Acceptance evaluation: real greedy speculative decoding of the target with the drafter.

    python -m launch.evaluate --checkpoint RUN/checkpoints/step-N     # offline: the run's target and held-out data

Producer 0 runs it for a training run (producer/evaluation.py builds it from the run's data).

Each held-out prompt is decoded as a server decodes one request:
  1. the target prefills the prompt into its KV cache: the first new token, and the drafter's features
     (outputs of the captured target layers) of every prompt token;
  2. the drafter fills the block ``[last kept token, MASK x (B-1)]`` from the features of every kept
     token before it;
  3. the target verifies the block in one forward: the drafted tokens that equal its own greedy tokens
     are kept, plus its token after them (the correction, or a bonus when all B-1 were right);
  4. the target's KV cache is cropped to the kept tokens, and the drafter's context is extended with the
     kept tokens' features from that same forward (rejected tokens never enter it). Back to 2.
     A hybrid target's Gated-DeltaNet layers (Qwen3.5 / Qwen3.6) hold a recurrent state and a convolution
     window that cannot be cropped: their state before the block is kept, and when a draft token was
     rejected it is put back and the kept tokens are run again (one more target forward of those tokens;
     the report counts them as ``replay_forwards`` / ``replayed_tokens``).
Every kept token is the target's greedy choice given the kept prefix, so the text is exactly plain
greedy decoding (lossless). ``eval.batch_prompts`` prompts are decoded together, one drafter forward and one
target forward per round for all of them (``speculative_decode_rows``): each keeps exactly what it keeps
alone, and 16 prompts take about the time of one (hybrid and sliding-window targets: one at a time). tau is the mean number of tokens kept per verify forward, correction
included (1 <= tau <= B).

Next to it the simulated tau: the training metric (teacher-forced blocks, ``common.drafter.loss.draft_metrics``)
on the same held-out documents with the same weights. Their gap is what teacher forcing hides: wrong
feature layers or positions, or a target whose own text differs from the training data.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from common.batch import Document, PackedBatch
from common.config import EvalConfig
from common.drafter.blocks import build_blocks
from common.drafter.loss import draft_loss
from common.drafter.masks import build_masks, in_block_mask
from common.drafter.model import DFlashDrafter
from common.drafter.target_head import TargetHead

log = logging.getLogger(__name__)


# -- the target side ------------------------------------------------------------------------------


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
    def forward(self, token_ids: torch.Tensor, start: int,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Tokens ``[L]`` at positions ``start ..`` through the cache: (the target's greedy next token after
        each ``[L]``, or None without ``logits``; the drafter's features ``[L, n * H]``)."""
        self.attach()
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)[None]
        # In its own dtype as the producers run it, whatever autocast the drafter runs under; logits_to_keep=1
        # skips the vocabulary-wide head where no token is needed (a long prefill).
        with torch.autocast(self.device.type, enabled=False):
            out = self.model(input_ids=token_ids[None].to(self.device), position_ids=positions, use_cache=True,
                             logits_to_keep=0 if logits else 1, **{self._cache_arg: self.cache})
        features = torch.cat([self._outputs[k][0] for k in self.layer_ids], dim=-1)
        return (out.logits[0].argmax(-1) if logits else None), features

    @property
    def batchable(self) -> bool:
        """Whether prompts can be decoded together (``forward_rows``). Not for a hybrid target (a recurrent state
        cannot skip one row's rejected tokens) nor for sliding-window layers (their cache keeps the last slots,
        which holes would push out of the window): those decode one prompt at a time."""
        types = getattr(self.model.config, "layer_types", None) or []
        sliding = any(t != "full_attention" for t in types) or (
            not types and getattr(self.model.config, "sliding_window", None) is not None
            and getattr(self.model.config, "use_sliding_window", True))
        return not self.recurrent and not sliding

    @torch.no_grad()
    def forward_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, kv_valid: torch.Tensor,
                     last_logits_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of tokens ``[R, L]`` at their own ``positions`` ``[R, L]`` through one cache of ``R`` rows:
        (each row's greedy next tokens ``[R, L]``, or ``[R, 1]`` with ``last_logits_only``; features ``[R, L, n * H]``).

        ``kv_valid`` ``[R, S + L]`` says which cache slots (the ``S`` already there, then the new ones) each row
        sees: a row's rejected drafts and its left padding stay in the cache as holes no query attends to.
        Attention follows the positions, not the slots (``_row_masks``), so every row's tokens get what a
        forward of that row alone would give.
        """
        self.attach()
        with torch.autocast(self.device.type, enabled=False):
            out = self.model(input_ids=token_ids.to(self.device), position_ids=positions, use_cache=True,
                             attention_mask=self._row_masks(positions.shape[1], kv_valid), logits_to_keep=1 if last_logits_only else 0,
                             **{self._cache_arg: self.cache})
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

    def compact(self, kv_valid: torch.Tensor) -> torch.Tensor:
        """Drop the cache slots no row sees any more (a row's rejected drafts), keeping each row's valid slots
        in order and left-padding the shorter rows with holes. Returns the new ``kv_valid``."""
        counts = kv_valid.sum(1)
        width = int(counts.max())
        # Per row: the valid slots last (stable order), the holes first; keep the last ``width``.
        order = torch.sort(kv_valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        return kv_valid.gather(1, order)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the cache (finished prompts leave the batch)."""
        self.cache.batch_select_indices(rows)

    def last_hidden(self) -> torch.Tensor:
        """``[L, H]`` output of the last decoder layer in the latest forward (needs ``capture_last``)."""
        return self._outputs[self.last_layer][0]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of the KV cache (recurrent states stay as they are: put them
        back with ``restore_state`` first where they ran past ``length``)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            for layer in self.cache.layers:
                if not _is_state_layer(layer):
                    layer.crop(-extra)  # negative: tokens to remove, the meaning every transformers version shares

    def save_state(self) -> None:
        """Copy the recurrent and convolution states of the Gated-DeltaNet layers (nothing for other targets)."""
        if not self.recurrent:
            return
        self._saved_states = [
            (layer, {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
             {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None})
            for layer in self.cache.layers if _is_state_layer(layer)
        ]

    def restore_state(self) -> None:
        """Put back the states of the last ``save_state``, in place."""
        for layer, conv, recurrent in self._saved_states:
            for i, saved in conv.items():
                layer.conv_states[i].copy_(saved)
            for i, saved in recurrent.items():
                layer.recurrent_states[i].copy_(saved)


def _is_state_layer(layer: Any) -> bool:
    """A cache layer that holds a fixed-size state (linear attention, convolution) instead of per-token keys."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")


# -- the drafter side -----------------------------------------------------------------------------


class DraftContext:
    """The drafter during decoding: the fused context of every kept token before the block, and proposals.

    The context is cached fused (``hidden_norm(fc(features))``, one row per kept token); each proposal runs
    the drafter's own layers on it, so decoding exercises exactly the trained forward.
    """

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        config = drafter.config
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.ctx = torch.empty(0, config.hidden_size, device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)

    def extend(self, features: torch.Tensor) -> None:
        """Append the target features ``[n, n_layers * H]`` of newly kept tokens."""
        self.ctx = torch.cat([self.ctx, self.drafter.fuse_context(features)])

    def propose(self, token: int, position: int) -> torch.Tensor:
        """Greedy draft tokens ``[B - 1]`` for slots 1.. of the block anchored at ``token``, at ``position``
        (equal to the number of context tokens: the anchor's own features are never context)."""
        device = self.ctx.device
        return propose_rows(self.drafter, [self.ctx], torch.tensor([token], device=device),
                            torch.tensor([position], device=device))[0]


class DraftRows:
    """``DraftContext`` for prompts decoded together: one context per prompt, one drafter forward for all."""

    def __init__(self, drafter: DFlashDrafter, num_rows: int) -> None:
        self.drafter = drafter
        empty = torch.empty(0, drafter.config.hidden_size, device=drafter.fc.weight.device, dtype=drafter.fc.weight.dtype)
        self.contexts = [empty] * num_rows

    def extend(self, row: int, features: torch.Tensor) -> None:
        """Append the target features ``[n, n_layers * H]`` of row ``row``'s newly kept tokens."""
        self.contexts[row] = torch.cat([self.contexts[row], self.drafter.fuse_context(features)])

    def extend_rows(self, rows: list[int], features: torch.Tensor, kept: list[int]) -> None:
        """Append to each row ``rows[i]`` the first ``kept[i]`` of its features ``features[i]`` ``[L, n_layers * H]``:
        one fusion for all rows (a round's verify forward), not one per row."""
        fused = self.drafter.fuse_context(features.flatten(0, 1)).view(*features.shape[:2], -1)
        for i, (row, n) in enumerate(zip(rows, kept)):
            self.contexts[row] = torch.cat([self.contexts[row], fused[i, :n]])

    def propose(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Greedy drafts ``[len(rows), B - 1]`` of the blocks anchored at ``tokens`` at ``positions``."""
        return propose_rows(self.drafter, [self.contexts[r] for r in rows], tokens, positions)


@torch.no_grad()
def propose_rows(drafter: DFlashDrafter, contexts: list[torch.Tensor], tokens: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """Greedy draft tokens ``[R, B - 1]`` of one block per row in one drafter forward: row r's block is anchored
    at ``tokens[r]``, at ``positions[r]``, over its fused context ``contexts[r]`` ``[C_r, H]``. The rows are
    packed as in training (every block sees only its own row's context), with the training masks."""
    config = drafter.config
    block_size, device = config.block_size, contexts[0].device
    num_rows = len(contexts)
    ctx = torch.cat(contexts)
    lengths = torch.tensor([c.shape[0] for c in contexts], device=device)
    context_rows = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)
    context_positions = torch.arange(ctx.shape[0], device=device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    block_ids = torch.full((num_rows, block_size), config.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = tokens
    block_positions = (positions[:, None] + torch.arange(block_size, device=device)).reshape(-1)
    block_rows = torch.arange(num_rows, device=device).repeat_interleave(block_size)
    slot = torch.arange(block_size, device=device).repeat(num_rows)
    x = drafter.target_head.embed(block_ids.reshape(-1)).to(ctx.dtype)
    block_rope = drafter.rotary(block_positions, ctx.dtype)
    context_rope = drafter.rotary(context_positions, ctx.dtype)
    masks = {}
    for layer_type in dict.fromkeys(config.layer_types):
        # The training mask of common.drafter.masks for one block per document: the row's whole context (a windowed
        # layer only the window before each slot), and its own block as the layer type trained it.
        window = config.window_of(layer_type)
        context = block_rows[:, None] == context_rows[None, :]
        if window is not None:
            context &= (block_positions[:, None] - context_positions[None, :]) < window
        own = in_block_mask(block_size, config.causal_in_block(layer_type), window, device)[slot[:, None], slot[None, :]]
        masks[layer_type] = torch.cat([context, own & (block_rows[:, None] == block_rows[None, :])], dim=1)
    for layer in drafter.layers:
        x = layer(x, ctx, block_rope, context_rope, masks[layer.layer_type])
    head = drafter.target_head.lm_head_weight
    # Contiguous rows: a strided 3-d product runs as a batched matmul, several times slower at a vocabulary's width.
    drafts = drafter.norm(x).view(num_rows, block_size, -1)[:, 1:].reshape(num_rows * (block_size - 1), -1)
    return (drafts.to(head.dtype) @ head.T).argmax(-1).view(num_rows, block_size - 1)


# -- decoding -------------------------------------------------------------------------------------


@dataclass
class Decoded:
    """One prompt's speculative decoding."""

    tokens: list[int]
    """The generated tokens (prompt excluded), cut at max_new_tokens or after the first stop token."""
    accepted: list[int]
    """Per verify forward: how many drafted tokens the target accepted (0 .. B-1)."""
    replayed: list[int] = field(default_factory=list)
    """Per replay (hybrid targets, after a rejection): how many kept tokens were run through the target again."""


def _cut(tokens: list[int], max_new_tokens: int, stop_token_ids: frozenset[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, token in enumerate(tokens):
        if token in stop_token_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def speculative_decode(context: DraftContext, target: GreedyTarget, prompt: torch.Tensor, max_new_tokens: int,
                       stop_token_ids: frozenset[int] = frozenset()) -> Decoded:
    """Greedy speculative decoding of ``prompt`` ``[P]`` with a fresh drafter ``context``: the target's greedy
    text, and what was accepted.

    Blocks are always full; the last one may run past ``max_new_tokens`` or a stop token, and the text is
    cut there while its acceptance still counts, so tau measures the drafter and not where the text ends.
    """
    target.reset()
    greedy, features = target.forward(prompt, 0)
    context.extend(features)
    tokens, accepted, replayed = [int(greedy[-1])], [], []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
        anchor = prompt.shape[0] + len(tokens) - 1  # position of the last kept token
        drafted = context.propose(tokens[-1], anchor)
        block = torch.cat([drafted.new_tensor([tokens[-1]]), drafted])
        target.save_state()  # a hybrid target's recurrent state before the block
        verified, features = target.forward(block, anchor)  # verified[i]: the target's token after block[:i + 1]
        num_accepted = int((drafted == verified[:-1]).long().cumprod(0).sum())
        accepted.append(num_accepted)
        tokens += drafted[:num_accepted].tolist() + [int(verified[num_accepted])]
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
    return Decoded(_cut(tokens, max_new_tokens, stop_token_ids), accepted, replayed)


@torch.no_grad()
def speculative_decode_rows(drafts: DraftRows, target: GreedyTarget, prompts: list[torch.Tensor],
                            max_new_tokens: int, stop_token_ids: frozenset[int] = frozenset(),
                            compact_at: float = 0.5) -> list[Decoded]:
    """``speculative_decode`` of several prompts at once: one drafter forward and one target verify forward per
    round for all unfinished prompts (``target.batchable`` only). Each row keeps exactly what it would keep
    alone: its rejected drafts stay in the shared cache as holes it never attends to (compacted away once
    they are ``compact_at`` of the longest row's slots), and a finished prompt leaves the batch.
    """
    device = target.device
    lengths = [int(p.numel()) for p in prompts]
    width = max(lengths)
    # Prefill, left-padded: every row's last prompt token in the last slot.
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    kv_valid = torch.zeros_like(ids, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, width - lengths[r]:] = prompt.to(device)
        positions[r, width - lengths[r]:] = torch.arange(lengths[r], device=device)
        kv_valid[r, width - lengths[r]:] = True
    target.reset()
    greedy, features = target.forward_rows(ids, positions, kv_valid, last_logits_only=True)
    for r, n in enumerate(lengths):
        drafts.extend(r, features[r, width - n:])
    tokens = [[t] for t in greedy[:, -1].tolist()]
    accepted: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # the prompts still decoding, in the cache's row order

    def unfinished(r: int) -> bool:
        return len(tokens[r]) < max_new_tokens and tokens[r][-1] not in stop_token_ids

    while True:
        keep = [i for i, r in enumerate(rows) if unfinished(r)]
        if not keep:
            break
        if len(keep) < len(rows):
            index = torch.tensor(keep, device=device)
            target.select_rows(index)
            kv_valid = kv_valid[index]
            rows = [rows[i] for i in keep]
        anchors = torch.tensor([lengths[r] + len(tokens[r]) - 1 for r in rows], device=device)
        last = torch.tensor([tokens[r][-1] for r in rows], device=device)
        drafted = drafts.propose(rows, last, anchors)
        block = torch.cat([last[:, None], drafted], dim=1)
        block_size = block.shape[1]
        kv_valid = torch.cat([kv_valid, torch.ones(len(rows), block_size, dtype=torch.bool, device=device)], dim=1)
        verified, features = target.forward_rows(block, anchors[:, None] + torch.arange(block_size, device=device), kv_valid)
        num_accepted = (drafted == verified[:, :-1]).long().cumprod(1).sum(1)
        # The rejected drafts become holes: only the anchor and the accepted drafts stay visible.
        kv_valid[:, -block_size:] = torch.arange(block_size, device=device)[None] <= num_accepted[:, None]
        # One copy to the host per round, not one per row: each is a synchronisation with the GPU.
        counts, drafted_ids, verified_ids = num_accepted.tolist(), drafted.tolist(), verified.tolist()
        for i, (r, n) in enumerate(zip(rows, counts)):
            accepted[r].append(n)
            tokens[r] += drafted_ids[i][:n] + [verified_ids[i][n]]
        drafts.extend_rows(rows, features, [n + 1 for n in counts])
        if kv_valid.shape[1] - int(kv_valid.sum(1).max()) > compact_at * kv_valid.shape[1]:
            kv_valid = target.compact(kv_valid)
    return [Decoded(_cut(t, max_new_tokens, stop_token_ids), a) for t, a in zip(tokens, accepted)]


@torch.no_grad()
def greedy_decode(target: GreedyTarget, prompt: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """Plain greedy decoding, one target forward per token: the reference speculative decoding must equal."""
    target.reset()
    greedy, _ = target.forward(prompt, 0)
    tokens = [int(greedy[-1])]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_token_ids:
        greedy, _ = target.forward(greedy[-1:], prompt.shape[0] + len(tokens) - 1)
        tokens.append(int(greedy[-1]))
    return tokens


# -- simulated acceptance ------------------------------------------------------------------------


@torch.no_grad()
def simulated_acceptance(drafter: DFlashDrafter, target: GreedyTarget, documents: list[Document], num_anchors: int,
                         seed: int = 0) -> tuple[float, list[float]]:
    """The training metric on ``documents``: (tau, acc_k) of teacher-forced blocks at up to ``num_anchors``
    anchors per document, labelled as ``drafter.loss_config`` says. Dense masks, one document at a time."""
    config, device = drafter.config, target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    streaks = blocks_seen = 0.0
    correct = torch.zeros(config.block_size - 1, device=device)
    supervised = torch.zeros(config.block_size - 1, device=device)
    for document in documents:
        input_ids = torch.as_tensor(document.input_ids, device=device)
        target.reset()
        _, features = target.forward(input_ids, 0, logits=False)
        batch = PackedBatch(input_ids=input_ids, loss_mask=torch.as_tensor(document.loss_mask, device=device),
                            cu_seqlens=torch.tensor([0, len(document)], dtype=torch.int32, device=device),
                            sample_ids=torch.tensor([document.sample_id], device=device), aux_hidden=features)
        blocks = build_blocks(batch, num_anchors, config.block_size, config.mask_token_id, generator)
        masks = build_masks(blocks, config, dense=True)
        hidden = drafter(features, blocks, masks)
        target_hidden = None
        if drafter.loss_config.label_mode != "data":
            head = drafter.target_head
            target_hidden = head.final_norm(target.last_hidden().to(head.norm_weight.dtype))
        _, metrics = draft_loss(hidden, blocks, drafter.target_head.lm_head_weight, drafter.loss_config, target_hidden)
        streaks += float((metrics["tau"] - 1) * metrics["num_blocks"])
        blocks_seen += float(metrics["num_blocks"])
        per_slot = blocks.label_mask.float().sum(0)
        correct += metrics["acc"] * per_slot
        supervised += per_slot
    return 1.0 + streaks / max(blocks_seen, 1.0), (correct / supervised.clamp_min(1.0)).tolist()


# -- the report ----------------------------------------------------------------------------------


@dataclass
class AcceptanceReport:
    """Real and simulated acceptance of one drafter on a set of held-out prompts."""

    block_size: int
    num_prompts: int
    tau: float
    """Mean tokens kept per verify forward, the correction token included (1 .. B)."""
    accept_pos: list[float]
    """k = 1..B-1: fraction of verify forwards whose accepted streak reaches slot k (tau = 1 + their sum)."""
    sim_tau: float
    """The training metric (teacher-forced tau) on the same held-out documents."""
    sim_acc: list[float]
    """Teacher-forced per-slot accuracy acc_k, k = 1..B-1."""
    generated_tokens: int
    target_forwards: int
    """Prefills plus verify forwards."""
    seconds: float
    replay_forwards: int = 0
    """Hybrid targets: extra forwards that ran the kept tokens again after a rejection (not in target_forwards)."""
    replayed_tokens: int = 0
    """Tokens those replays ran."""

    @property
    def tau_gap(self) -> float:
        """Real minus simulated tau."""
        return self.tau - self.sim_tau

    def gap_within(self, tolerance: float) -> bool:
        """Whether |real - simulated tau| is at most ``tolerance`` of the most a block can gain (B - 1)."""
        return abs(self.tau_gap) <= tolerance * (self.block_size - 1)

    @property
    def greedy_forwards(self) -> int:
        """Target forwards plain greedy decoding needs for the same text: one per generated token."""
        return self.generated_tokens

    @property
    def forwards_saved(self) -> float:
        """Fraction of the plain-greedy target forwards that speculative decoding saved."""
        return 1.0 - self.target_forwards / max(self.greedy_forwards, 1)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        out = {"tau": self.tau, "sim_tau": self.sim_tau, "tau_gap": self.tau_gap, "forwards_saved": self.forwards_saved,
               "target_forwards": self.target_forwards, "greedy_forwards": self.greedy_forwards,
               "generated_tokens": self.generated_tokens, "num_prompts": self.num_prompts, "seconds": self.seconds,
               "replay_forwards": self.replay_forwards, "replayed_tokens": self.replayed_tokens}
        out.update({f"accept_pos_{k}": p for k, p in enumerate(self.accept_pos, start=1)})
        out.update({f"sim_acc_{k}": a for k, a in enumerate(self.sim_acc, start=1)})
        return {prefix + key: value for key, value in out.items()}

    def table(self) -> str:
        lines = [
            f"{self.num_prompts} prompts, {self.generated_tokens} tokens generated, block size {self.block_size}",
            f"tau (real)       {self.tau:6.3f}   mean tokens per target verify forward (max {self.block_size})",
            f"tau (simulated)  {self.sim_tau:6.3f}   teacher-forced on the same documents; gap {self.tau_gap:+.3f}",
            f"target forwards  {self.target_forwards:6d}   vs {self.greedy_forwards} for plain greedy: "
            f"{self.forwards_saved:.1%} saved",
        ]
        if self.replay_forwards:
            lines.append(f"replays          {self.replay_forwards:6d}   forwards that ran {self.replayed_tokens} kept tokens again "
                         "(a hybrid target's state is not cropped)")
        lines += [
            "slot k    accepted (real, streak reaches k)    acc_k (simulated)",
        ]
        lines += [f"{k:6d}    {p:10.3f}                           {a:10.3f}"
                  for k, (p, a) in enumerate(zip(self.accept_pos, self.sim_acc), start=1)]
        return "\n".join(lines)


def prompt_of(document: Document, prompt_len: int) -> torch.Tensor:
    """The document's first ``prompt_len`` tokens, or with 0 those before its first supervised token."""
    if prompt_len == 0:
        supervised = document.loss_mask.nonzero()[0]
        prompt_len = int(supervised[0]) if supervised.size else len(document)
    return torch.as_tensor(document.input_ids[:prompt_len], dtype=torch.long)


class Evaluator:
    """Real and simulated acceptance of drafters against one loaded target, on fixed held-out documents."""

    def __init__(self, target_model: nn.Module, documents: list[Document], config: EvalConfig,
                 layer_ids: list[int], num_anchors: int, capture_last: bool = False,
                 stop_token_ids: frozenset[int] = frozenset(), make_target: Callable[..., GreedyTarget] = GreedyTarget) -> None:
        """``make_target(model, layer_ids, capture_last)`` makes the greedy target (a tensor-parallel producer's
        mirrors its calls to the other ranks)."""
        self.target = make_target(target_model, layer_ids, capture_last)
        self.documents = [d for d in documents if prompt_of(d, config.prompt_len).numel()]
        if not self.documents:
            raise ValueError("no held-out document has a prompt (tokens before its first supervised token); "
                             "set eval.prompt_len")
        self.config = config
        self.num_anchors = num_anchors
        self.stop_token_ids = frozenset(stop_token_ids)

    @torch.no_grad()
    def evaluate(self, drafter: DFlashDrafter) -> AcceptanceReport:
        if list(drafter.config.target_layer_ids) != self.target.layer_ids:
            raise ValueError(f"drafter reads target layers {drafter.config.target_layer_ids}, "
                             f"this evaluator captures {self.target.layer_ids}")
        started = time.perf_counter()
        was_training, threads = drafter.training, torch.get_num_threads()
        drafter.eval()
        if self.target.device.type == "cpu":
            # Forwards of a few tokens: OpenMP threads cost more than they give (far more on a busy CPU).
            torch.set_num_threads(1)
        try:
            # Eager: layers compiled for the trainer's fixed shapes would recompile for every context length.
            with torch.compiler.set_stance("force_eager"), _drafter_autocast(self.target.device):
                decoded = self._decode(drafter)
                sim_tau, sim_acc = simulated_acceptance(drafter, self.target, self.documents, self.num_anchors)
        finally:
            self.target.detach()
            drafter.train(was_training)
            torch.set_num_threads(threads)
        accepted = torch.tensor([n for d in decoded for n in d.accepted], dtype=torch.float64)
        slots = torch.arange(1, drafter.config.block_size, dtype=torch.float64)
        accept_pos = ((accepted[:, None] >= slots[None, :]).double().mean(0) if accepted.numel()
                      else torch.zeros_like(slots))
        return AcceptanceReport(
            block_size=drafter.config.block_size, num_prompts=len(decoded),
            tau=1.0 + (float(accepted.mean()) if accepted.numel() else 0.0), accept_pos=accept_pos.tolist(),
            sim_tau=sim_tau, sim_acc=sim_acc, generated_tokens=sum(len(d.tokens) for d in decoded),
            target_forwards=len(decoded) + int(accepted.numel()), seconds=time.perf_counter() - started,
            replay_forwards=sum(len(d.replayed) for d in decoded), replayed_tokens=sum(sum(d.replayed) for d in decoded),
        )


    def _decode(self, drafter: DFlashDrafter) -> list[Decoded]:
        """Every held-out prompt's speculative decoding: ``eval.batch_prompts`` at a time where the target allows."""
        prompts = [prompt_of(d, self.config.prompt_len) for d in self.documents]
        if not self.target.batchable or self.config.batch_prompts == 1:
            return [speculative_decode(DraftContext(drafter), self.target, p, self.config.max_new_tokens, self.stop_token_ids)
                    for p in prompts]
        size = self.config.batch_prompts
        return [decoded for i in range(0, len(prompts), size)
                for decoded in speculative_decode_rows(DraftRows(drafter, len(prompts[i:i + size])), self.target,
                                                       prompts[i:i + size], self.config.max_new_tokens, self.stop_token_ids)]


def _drafter_autocast(device: torch.device):
    """The trainer's autocast for the drafter (bf16 on CUDA); GreedyTarget turns it off for the target."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


# -- from a loaded target ------------------------------------------------------------------------


def stop_tokens_of(model: nn.Module) -> frozenset[int]:
    """The target's end-of-sequence ids (none for a config without them)."""
    eos = getattr(model.config, "eos_token_id", None)
    return frozenset() if eos is None else frozenset(eos if isinstance(eos, list) else [eos])


def target_head_of(model: nn.Module) -> TargetHead:
    """The loaded target's own embedding, final norm and lm_head (bit-identical by construction)."""
    base = model.get_decoder()
    return TargetHead(base.embed_tokens.weight, model.get_output_embeddings().weight, base.norm.weight,
                      float(getattr(model.config, "rms_norm_eps", 1e-6)))


def warn_if_gap(tau_gap: float, block_size: int, tolerance: float) -> None:
    """The warning of a real tau far from the simulated one (more than ``tolerance`` of B - 1)."""
    if abs(tau_gap) > tolerance * (block_size - 1):
        log.warning("real and simulated tau differ by more than eval.gap_tolerance (%.2f of B - 1): check the "
                    "target layer ids, the rope settings, the loss mask and whether the data is the target's "
                    "own text", tolerance)

"""The target as a greedy verifier: forwards through its KV cache that return its tokens and the drafter's features
of the same tokens (``GreedyTarget``), what acceptance evaluation runs the target with. On a tensor-parallel leader
every call that runs the model or changes its cache is told to the followers first (producer/target_model/operations.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from producer.target_model.operations import ALONE, Followers, Op


class GreedyTarget:
    """The target as a greedy verifier: forwards through its KV cache that return its argmax tokens and
    the drafter's features of the same tokens.

    Features are the outputs of decoder layers ``layer_ids`` read by forward hooks, i.e. exactly what the
    producers capture (before the final norm, even for the last layer; HF's ``hidden_states[-1]`` is after
    it). With ``capture_last`` the last decoder layer's output is kept too (target label modes).

    ``followers``: a tensor-parallel leader's, when its model is sharded: each call that runs the model or changes the
    cache is told to them first, so that every rank makes it on its own shards and its own cache.
    """

    def __init__(
        self, model: nn.Module, layer_ids: list[int], capture_last: bool = False, followers: Followers | None = None
    ) -> None:
        self.model = model
        self.followers = followers if followers is not None else ALONE
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
        self.followers.send(Op.DETACH, ())
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._outputs = [], {}
        self.cache = None
        self._saved_states = []

    def reset(self) -> None:
        """Empty the KV cache (a new prompt)."""
        from transformers import DynamicCache

        self.followers.send(Op.RESET, ())
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
        self.followers.send(Op.FORWARD, (token_ids, start, logits))
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
        ``forward`` itself, so that the followers of a tensor-parallel target run it as a ``forward`` too."""
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
        self.followers.send(Op.FORWARD_ROWS, (token_ids, positions, kv_valid, last_logits_only))
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
        if self._keep_logits:
            self._logits = out.logits
        return out.logits.argmax(-1), features

    def forward_rows_logits(
        self, token_ids: torch.Tensor, positions: torch.Tensor, kv_valid: torch.Tensor, last_logits_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_rows`` for sampled decoding: (the rows' logits ``[R, L, V]``, or ``[R, 1, V]``, the features);
        through ``forward_rows`` itself, as ``forward_logits`` goes through ``forward``."""
        self._keep_logits = True
        try:
            _, features = self.forward_rows(token_ids, positions, kv_valid, last_logits_only)
        finally:
            self._keep_logits = False
        logits, self._logits = self._logits, None
        return logits, features

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
        self.followers.send(Op.CROP, (length,))
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
        self.followers.send(Op.SAVE_STATE, ())
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
        self.followers.send(Op.RESTORE_STATE, ())
        for layer, conv, recurrent, seen in self._saved_states:
            for i, saved in conv.items():
                layer.conv_states[i].copy_(saved)
            for i, saved in recurrent.items():
                layer.recurrent_states[i].copy_(saved)
            if seen is not None:
                _seen_length(layer).copy_(seen)


def left_padded(prompts: Sequence[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Prompts as rows of one cache for ``GreedyTarget.forward_rows``, left-padded to the longest: (token ids,
    positions, which slots are real), ``[R, longest]`` each."""
    lengths = [int(p.numel()) for p in prompts]
    width, rows = max(lengths), len(prompts)
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    kv_valid = torch.zeros_like(ids, dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, width - lengths[r] :] = prompt.to(device)
        positions[r, width - lengths[r] :] = torch.arange(lengths[r], device=device)
        kv_valid[r, width - lengths[r] :] = True
    return ids, positions, kv_valid


def _seen_length(layer: Any) -> torch.Tensor | None:
    """The tokens a linear-attention cache layer has seen, where its transformers version counts them."""
    return getattr(layer, "cumulative_length_linear", None)


def _is_state_layer(layer: Any) -> bool:
    """A cache layer that holds a fixed-size state (linear attention, convolution) instead of per-token keys."""
    return hasattr(layer, "recurrent_states") and hasattr(layer, "conv_states")

"""What acceptance evaluation computes once per held-out set with the target's greedy verifier
(producer/target_model/greedy.py): each prompt's greedy continuation with the features of every token
(``greedy_transcripts``) and each document's features (``document_features``), kept on the host between evaluations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.acceptance.arithmetic import Transcript
from common.batch import Document
from producer.target_model.greedy import GreedyTarget, left_padded


def kept_on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` to keep between evaluations: page-locked when it comes from a GPU, so that the
    next evaluation's upload is one fast copy; a CPU tensor is kept as it is."""
    if tensor.device.type == "cpu":
        return tensor
    kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    kept.copy_(tensor)
    return kept


@dataclass
class DocumentFeatures:
    """A held-out document's target features for the simulated acceptance, kept on the host (or, past the cache's
    budget, None: that document runs through the target at every evaluation)."""

    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor | None = None


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
    last = kept_on_host(torch.cat([rows[0] for rows in lasts])) if lasts[0] is not None else None
    return Transcript(
        prompt.numel(), prompt.tolist() + torch.cat(tokens).tolist(), kept_on_host(torch.cat(parts)), last
    )


def _greedy_rows(target: GreedyTarget, prompts: Sequence[torch.Tensor], length: int) -> list[Transcript]:
    """``_greedy_one`` of several prompts at once, left-padded in one cache (every row gets what it gets alone)."""
    device = target.device
    lengths = [int(p.numel()) for p in prompts]
    width, rows = max(lengths), len(prompts)
    ids, positions, kv_valid = left_padded(prompts, device)
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
        return kept_on_host(torch.cat([prefill_last[r, width - n :], *later]))

    return [
        Transcript(
            n,
            prompt.tolist() + continuation[r],
            kept_on_host(torch.cat([prefill[r, width - n :], fed_features[r]])),
            last_of(r, n),
        )
        for r, (prompt, n) in enumerate(zip(prompts, lengths))
    ]


def document_features(target: GreedyTarget, document: Document) -> DocumentFeatures:
    """One forward of the whole document: its features, and its last layer's output when the target captures it."""
    target.reset()
    _, features = target.forward(torch.as_tensor(document.input_ids, dtype=torch.long), 0, logits=False)
    return DocumentFeatures(features, target.last_hidden() if target.last_layer is not None else None)


def feature_bytes_per_token(target: GreedyTarget) -> int:
    """Host bytes per token of a document's kept features."""
    config = target.model.config
    width = len(target.layer_ids) + (1 if target.last_layer is not None else 0)
    return width * int(config.hidden_size) * next(target.model.parameters()).element_size()


def kept_record_features(
    target: GreedyTarget, records: Sequence[Document], budget: int
) -> list[DocumentFeatures | None]:
    """Each record's features, kept on the host while they fit in ``budget`` bytes; past it a record's are not kept
    (None): it runs through the target at every evaluation."""
    kept: list[DocumentFeatures | None] = []
    bytes_per_token = feature_bytes_per_token(target)
    for record in records:
        needed = len(record) * bytes_per_token
        if needed > budget:
            kept.append(None)
            continue
        features = document_features(target, record)
        kept.append(
            DocumentFeatures(
                kept_on_host(features.aux_hidden),
                None if features.last_hidden is None else kept_on_host(features.last_hidden),
            )
        )
        budget -= needed
    return kept

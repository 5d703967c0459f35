"""Producer 0's evaluator for a training run: the drafter decoded against this producer's target on the
held-out split of the run's data (the decoding itself: common/drafter/evaluate.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from common.batch import Document
from common.config import ConfigError, RunConfig
from common.drafter.evaluate import Evaluator, GreedyTarget, stop_tokens_of
from producer.data import build_data_source


def held_out_documents(cfg: RunConfig, vocab_size: int) -> list[Document]:
    """The first ``eval.num_prompts`` good documents of the held-out split.

    ``eval.paths`` when given (files in ``data.format``); else, for synthetic data, the documents with ids
    ``data.num_samples ..``: generated exactly like the training ones, which are ids ``0 .. num_samples - 1``,
    so never trained on.
    """
    data = cfg.data
    if data.format == "synthetic" and data.vocab_size is None:
        data = dataclasses.replace(data, vocab_size=vocab_size - 1)  # as the producers: the last id stays free
    tokenizer = None
    if data.format == "chat" and data.tokenizer is None and cfg.target.path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.target.path)  # as the producers: the target's own
    if cfg.eval.paths:
        source, first = build_data_source(dataclasses.replace(data, paths=list(cfg.eval.paths)), tokenizer), 0
    elif data.format == "synthetic":
        extended = dataclasses.replace(data, num_samples=data.num_samples + cfg.eval.num_prompts)
        source, first = build_data_source(extended), data.num_samples
    else:
        raise ConfigError(f"eval.paths: needs held-out files for data.format={data.format!r}")
    documents = []
    for sample_id in range(first, len(source)):
        document = source.get(sample_id)
        if document is not None:
            documents.append(document)
        if len(documents) == cfg.eval.num_prompts:
            break
    return documents


def build_evaluator(cfg: RunConfig, target_model: nn.Module, layer_ids: list[int],
                    make_target: Callable[..., GreedyTarget] = GreedyTarget) -> Evaluator:
    """An evaluator of the run's drafters (reading target layers ``layer_ids``) on the held-out split of ``cfg``'s
    data (``make_target``: see Evaluator)."""
    documents = held_out_documents(cfg, int(target_model.config.vocab_size))
    return Evaluator(target_model, documents, cfg.eval, list(layer_ids), num_anchors=cfg.drafter.num_anchors,
                     capture_last=cfg.training.label_mode != "data", stop_token_ids=stop_tokens_of(target_model),
                     make_target=make_target)

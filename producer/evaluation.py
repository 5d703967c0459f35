"""Producer 0's evaluator for a training run: the drafter decoded against this producer's target on the
held-out split of the run's data (the decoding itself: common/drafter/evaluate.py)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from common.batch import Document
from common.config import RunConfig
from common.drafter.evaluate import Evaluator, GreedyTarget, stop_tokens_of
from producer.data import DataError, run_sources


def held_out_documents(cfg: RunConfig, vocab_size: int) -> list[Document]:
    """The first ``eval.num_prompts`` good documents of the run's held-out split (producer/data.py run_sources:
    ``eval.paths``, the synthetic documents after ``data.num_samples``, or records of the data never trained on)."""
    _, source = run_sources(cfg, vocab_size)
    documents = []
    for sample_id in range(len(source)):
        document = source.get(sample_id)
        if document is not None:
            documents.append(document)
        if len(documents) == cfg.eval.num_prompts:
            break
    if not documents:
        raise DataError(f"eval: no held-out document to evaluate on ({len(source)} held-out records, none usable); "
                        "a data set of fewer than 10 records holds none out: give eval.paths")
    return documents


def build_evaluator(cfg: RunConfig, target_model: nn.Module, layer_ids: list[int],
                    make_target: Callable[..., GreedyTarget] = GreedyTarget) -> Evaluator:
    """An evaluator of the run's drafters (reading target layers ``layer_ids``) on the held-out split of ``cfg``'s
    data (``make_target``: see Evaluator)."""
    documents = held_out_documents(cfg, int(target_model.config.vocab_size))
    return Evaluator(target_model, documents, cfg.eval, list(layer_ids), num_anchors=cfg.drafter.num_anchors,
                     capture_last=cfg.training.label_mode != "data", stop_token_ids=stop_tokens_of(target_model),
                     make_target=make_target)

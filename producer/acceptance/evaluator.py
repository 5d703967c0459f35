"""The ``AcceptanceEvaluator``: real and simulated acceptance of drafters against one loaded target, on fixed held-out prompts,
as an ``AcceptanceReport`` (``build_evaluator`` makes it for a run's data and settings).

The target's half of the decoding does not depend on the drafter: the text is the target's greedy text whatever is
drafted, and the features of the kept tokens are the features of that text. So the evaluator computes once, per
held-out prompt, the target's greedy continuation and the features of every token (``TargetReference``: the same
forward hooks and KV-cached forwards as live decoding), and each evaluation runs only the drafter (``replay_rows``):
every round it drafts from the features of the kept tokens, the target's greedy text decides how many drafts are
kept, and the next round starts after them. The acceptance is exactly live decoding's (``speculative_decode`` is the
live decoder, one prompt at a time; the tests hold the two together, for plain, sliding-window and hybrid
Gated-DeltaNet targets). An evaluation after the first runs no target forward at all, and prompts are drafted
together whatever the target's layers. The documents' target features are kept too (within
``eval.reference_cache_gb``), for the simulated acceptance beside it.

At ``eval.temperature`` > 0 the decoding is sampled: lossless rejection sampling (``common.drafter.sampling.
rejection_sample``) of the drafter kind's proposal against the target's sampling distribution. Its text depends on
the draws, so nothing is replayed: the decoding runs live, each prompt with its own generator seeded by ``eval.seed``,
``eval.batch_prompts`` prompts at once where the target allows (``speculative_decode_rows``: each draws what it draws
alone), else one at a time (``speculative_decode``); the figures on the greedy text (``sim_tau_greedy``,
``sim_tau_walk``) are left out.

By context length: a multi-turn held-out record is a prompt per assistant turn (``turn_documents``: the conversation
before the turn), and per bucket of context length the target's verify and decode forwards and the drafter's round
are timed at one context (``time_target_round``, ``time_draft_round``) for the bucket's break-even tau.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.acceptance.arithmetic import (
    Decoded,
    RoundCosts,
    Transcript,
    acceptance_by_length,
    drafts_per_accepted,
    reference_length,
    replay_rows,
    sampling_seed,
    streak_figures,
    timing_contexts,
    zlab_tau,
)
from common.acceptance.report import AcceptanceReport
from common.batch import Document
from common.config import EvalConfig, RunConfig
from common.drafter.base import Drafter
from common.drafter.sampling import Sampling
from producer.acceptance.decoder import DraftContext, DraftRows, speculative_decode, speculative_decode_rows
from producer.acceptance.held_out import held_out_records, prompt_of, turn_documents
from producer.acceptance.simulated import decoded_span, on_greedy_text, simulated_acceptance
from producer.acceptance.timing import time_draft_round, time_target_round
from producer.acceptance.transcripts import (
    DocumentFeatures,
    document_features,
    greedy_transcripts,
    kept_record_features,
)
from producer.target_model.greedy import GreedyTarget
from producer.target_model.load import stop_tokens_of

log = logging.getLogger(__name__)


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


@dataclass
class Measured:
    """What one evaluation measured, before ``AcceptanceEvaluator.report`` sums it up."""

    decoded: list[Decoded]
    """Every prompt's decoding, with the confidence cut."""
    uncut: list[Decoded] | None
    """The same decoding without the cut (None: no cut)."""
    reference_seconds: float
    """How long making the target's reference took for this evaluation (0: it was made before)."""
    decode_seconds: float
    """How long the decoding took."""
    simulated: tuple[float, list[float]]
    """The simulated acceptance on the documents: (tau, acc_k)."""
    on_greedy_text: tuple[float | None, float | None]
    """The training metric on the decoding's text, at every anchor and at the decoding's own (None: sampled)."""
    costs: dict[int, RoundCosts]
    """Per context-length bucket, what a round costs."""
    timing_seconds: float
    """How long timing the forwards took."""


class AcceptanceEvaluator:
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
        self.doing: str | None = None
        """What it is doing now, for the producer's status (another thread reads it): an evaluation's phase."""

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
            self.doing = None

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
        """Real and simulated acceptance of ``drafter`` (left in the training mode it came in)."""
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
                measured = self.measure(drafter)
        finally:
            drafter.train(was_training)
        return self.report(measured, drafter.config.block_size, time.perf_counter() - started)

    def measure(self, drafter: Drafter) -> Measured:
        """The decoding, the simulated acceptance and the round costs of ``drafter`` (inside ``evaluation_context``)."""
        reference, made = self.reference_for(drafter.config.block_size)
        decode_started = time.perf_counter()
        cut = self.config.confidence_min
        decoded = self.decode_all(drafter, reference, cut)  # its results are on the host: nothing queued
        decode_seconds = time.perf_counter() - decode_started
        # a confidence cut is reported beside the same decoding without it
        uncut = self.decode_all(drafter, reference, 0.0) if cut > 0 else None
        self.doing = "the simulated acceptance"
        spans, anchors = zip(
            *(
                decoded_span(d, self.config.prompt_len, self.config.max_new_tokens, drafter.config.block_size)
                for d in self.documents
            )
        )
        features = self.record_features(reference)
        simulated = simulated_acceptance(drafter, spans, features, self.num_anchors, anchors=anchors)
        greedy = on_greedy_text(drafter, reference.transcripts, decoded) if self.sampling.greedy else (None, None)
        timing_started = time.perf_counter()
        self.doing = "timing the forwards"
        costs = self.round_costs(drafter)
        return Measured(
            decoded=decoded,
            uncut=uncut,
            reference_seconds=reference.seconds if made else 0.0,
            decode_seconds=decode_seconds,
            simulated=simulated,
            on_greedy_text=greedy,
            costs=costs,
            timing_seconds=time.perf_counter() - timing_started,
        )

    def report(self, measured: Measured, block_size: int, seconds: float) -> AcceptanceReport:
        """The figures of one evaluation that took ``seconds``, from what it measured."""
        decoded, uncut = measured.decoded, measured.uncut
        tau, accept_pos = streak_figures([n for d in decoded for n in d.accepted], block_size)
        costs = measured.costs
        return AcceptanceReport(
            block_size=block_size,
            num_prompts=len(decoded),
            tau=tau if tau is not None else 1.0,
            accept_pos=accept_pos or [0.0] * (block_size - 1),
            sim_tau=measured.simulated[0],
            sim_acc=measured.simulated[1],
            sim_tau_greedy=measured.on_greedy_text[0],
            sim_tau_walk=measured.on_greedy_text[1],
            generated_tokens=sum(len(d.tokens) for d in decoded),
            target_forwards=len(decoded) + sum(len(d.accepted) for d in decoded),
            seconds=seconds,
            reference_seconds=measured.reference_seconds,
            decode_seconds=measured.decode_seconds,
            zlab_tau=zlab_tau(decoded),
            sampling=self.sampling,
            seed=self.config.seed,
            by_length=acceptance_by_length(decoded, self.prompt_lengths, self.config.length_buckets, block_size, costs),
            num_records=len(self.records),
            skipped_records=self.skipped_records,
            timing_seconds=measured.timing_seconds,
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

    def reference_for(self, block_size: int) -> tuple[TargetReference, bool]:
        """The target's reference for drafters of ``block_size``: (it, whether it was made now). Made by target
        forwards the first time (and again for a larger block), inside ``evaluation_context``. A sampled evaluation
        decodes live and needs no greedy continuation: its reference holds the documents' features only."""
        length = reference_length(self.config.max_new_tokens, block_size) if self.sampling.greedy else 0
        if self.reference is not None and self.reference.continuation_length >= length:
            return self.reference, False
        started = time.perf_counter()
        self.doing = f"making the target's reference ({len(self.documents)} prompts, {length} tokens each)"
        prompts = [prompt_of(d, self.config.prompt_len) for d in self.documents]
        transcripts = greedy_transcripts(self.target, prompts, length, self.config.batch_prompts) if length else []
        budget = int(self.config.reference_cache_gb * 2**30) - sum(t.features.nbytes for t in transcripts)
        records = kept_record_features(self.target, self.records, budget)
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

    def decode(self, drafter: Drafter, reference: TargetReference, confidence_min: float = 0.0) -> list[Decoded]:
        """Every held-out prompt's speculative decoding, replayed from the reference: ``eval.batch_prompts`` prompts
        per drafter forward."""
        size, transcripts = self.config.batch_prompts, reference.transcripts
        decoded = []
        for i in range(0, len(transcripts), size):
            self.doing = f"decoding, {len(decoded)}/{len(transcripts)} prompts done"
            group = transcripts[i : i + size]
            decoded += replay_rows(
                DraftRows(drafter, [t.features for t in group], confidence_min),
                group,
                self.config.max_new_tokens,
                self.stop_token_ids,
            )
        return decoded

    def decode_sampled(self, drafter: Drafter, confidence_min: float = 0.0) -> list[Decoded]:
        """Every held-out prompt's sampled speculative decoding, live (the target verifies each block), prompt i
        drawing from a generator seeded by ``eval.seed`` and i (``sampling_seed``): ``eval.batch_prompts`` prompts
        at once where the target allows (``speculative_decode_rows``: each draws what it draws alone), else one
        at a time."""
        size = self.config.batch_prompts if self.target.batchable else 1
        decoded: list[Decoded] = []
        for start in range(0, len(self.documents), size):
            self.doing = f"decoding, {start}/{len(self.documents)} prompts done"
            indices = range(start, min(start + size, len(self.documents)))
            generators = [
                torch.Generator(device=self.target.device).manual_seed(sampling_seed(self.config.seed, i))
                for i in indices
            ]
            contexts = [DraftContext(drafter, confidence_min) for _ in indices]
            prompts = [prompt_of(self.documents[i], self.config.prompt_len) for i in indices]
            common = (self.config.max_new_tokens, self.stop_token_ids, self.sampling)
            if size > 1:
                decoded += speculative_decode_rows(contexts, self.target, prompts, *common, generators)
            else:
                decoded.append(speculative_decode(contexts[0], self.target, prompts[0], *common, generators[0]))
        return decoded


def _drafter_autocast(device: torch.device):
    """The trainer's autocast for the drafter (bf16 on CUDA); GreedyTarget turns it off for the target."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def build_evaluator(
    cfg: RunConfig,
    target_model: nn.Module,
    layer_ids: list[int],
    make_target: Callable[..., GreedyTarget] = GreedyTarget,
    held_out_file: Path | None = None,
) -> AcceptanceEvaluator:
    """An evaluator of the run's drafters (reading target layers ``layer_ids``) on the held-out split of ``cfg``'s
    data (``make_target``: see AcceptanceEvaluator), greedy or sampled as ``cfg.eval`` says (temperature, top_p, top_k, seed)."""
    held = held_out_records(cfg, int(target_model.config.vocab_size), held_out_file)
    if len(held.documents) < cfg.eval.num_prompts:
        log.warning(
            "eval.num_prompts is %d, the run's held-out split has %d usable documents: evaluating on those",
            cfg.eval.num_prompts,
            len(held.documents),
        )
    if held.skipped:
        log.warning("%d held-out records skipped, the first: %s", len(held.skipped), "; ".join(held.skipped[:3]))
    return AcceptanceEvaluator(
        target_model,
        held.documents,
        cfg.eval,
        list(layer_ids),
        num_anchors=cfg.drafter.num_anchors,
        capture_last=cfg.ships_final_hidden,
        stop_token_ids=stop_tokens_of(target_model),
        make_target=make_target,
        skipped_records=held.skipped,
    )

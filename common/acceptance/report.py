"""The acceptance report: real and simulated acceptance of one drafter on held-out prompts (``AcceptanceReport``), its
figures by name (``metrics``: the ``eval/*`` keys a result carries to the trainer) and its tables; and what the
trainer makes of those figures (``by_length_summary``, ``warn_if_gap``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.acceptance.arithmetic import LengthBucket
from common.drafter.sampling import Sampling

log = logging.getLogger(__name__)


def _cell(value: float | None, width: int, spec: str) -> str:
    """A table cell: the value in ``spec``, or a dash where there is none."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


@dataclass
class AcceptanceReport:
    """Real and simulated acceptance of one drafter on a set of held-out prompts."""

    block_size: int
    num_prompts: int
    tau: float
    """Mean tokens kept per verify forward, the correction token included (1 .. B), pooled over every prompt's verify
    forwards, the last block counted whole (as vLLM counts its acceptance length)."""
    accept_pos: list[float]
    """k = 1..B-1: fraction of verify forwards whose accepted streak reaches slot k (tau = 1 + their sum)."""
    sim_tau: float
    """The training metric (teacher-forced tau) on the same held-out documents, each cut to what decoding its prompt
    produces: the prompt and ``max_new_tokens`` tokens."""
    sim_acc: list[float]
    """Teacher-forced per-slot accuracy acc_k, k = 1..B-1."""
    sim_tau_greedy: float | None
    """The training metric on the text the decoding produced (the target's greedy text of the same prompts), at
    every anchor: beside ``sim_tau``, how far the documents are from the target's own text."""
    sim_tau_walk: float | None
    """The training metric on that text at the anchors the decoding started its blocks at: the training forward
    where the server ran its own, so it equals ``tau`` unless the two differ (masks, positions, features). Beside
    ``sim_tau_greedy``, what those anchors cost: a block starts after each rejection, where the text is harder
    than on average. None for a sampled evaluation (as ``sim_tau_greedy``): its text is not the greedy text."""
    generated_tokens: int
    target_forwards: int
    """Prefills plus verify forwards: what live decoding runs for this text and these acceptances."""
    seconds: float
    reference_seconds: float = 0.0
    """Of ``seconds``: making the target's reference (greedy continuations and features by target forwards);
    0 when an earlier evaluation made it."""
    decode_seconds: float = 0.0
    """Of ``seconds``: decoding the prompts. The rest, past the reference, is the simulated acceptance."""
    zlab_tau: float = 0.0
    """tau as z-lab's benchmark gives it from ``dflash_generate``'s acceptance lengths: tokens each verify forward
    added to the output, cut at the stop token and at max_new_tokens, averaged per prompt and then over prompts
    (``zlab_tau``). Below ``tau`` where last blocks are cut, and it weighs short answers as much as long ones."""
    sampling: Sampling = field(default_factory=Sampling)
    """How the target's tokens were chosen (temperature 0: greedy)."""
    seed: int = 0
    """The sampled decoding's seed (``eval.seed``)."""
    by_length: list[LengthBucket] = field(default_factory=list)
    """The same acceptance per bucket of context length (``eval.length_buckets``), with each bucket's timed costs
    and break-even tau."""
    num_records: int = 0
    """Held-out records the prompts come from (with ``eval.every_turn``, one prompt per assistant turn)."""
    skipped_records: list[str] = field(default_factory=list)
    """``file:line reason`` of each held-out record left out (bad, or turns that do not alternate)."""
    timing_seconds: float = 0.0
    """Of ``seconds``: timing the forwards for the break-even tau (the target's only at the first evaluation)."""
    confidence_min: float = 0.0
    """``eval.confidence_min``: a confidence head's cut of each block (0: none)."""
    drafts_per_accepted: float | None = None
    """Drafted tokens the target verified per drafted token it accepted (1: no draft verified in vain)."""
    uncut_tau: float | None = None
    """With a confidence cut: ``tau`` of the same decoding without it."""
    uncut_drafts_per_accepted: float | None = None
    """With a confidence cut: ``drafts_per_accepted`` of the same decoding without it."""

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
        """The figures by name; a sampled evaluation's adds its sampling settings and has no ``sim_tau_greedy`` nor
        ``sim_tau_walk``."""
        out = {
            "tau": self.tau,
            "zlab_tau": self.zlab_tau,
            "sim_tau": self.sim_tau,
            "tau_gap": self.tau_gap,
            "sim_tau_greedy": self.sim_tau_greedy,
            "sim_tau_walk": self.sim_tau_walk,
            "forwards_saved": self.forwards_saved,
            "target_forwards": self.target_forwards,
            "greedy_forwards": self.greedy_forwards,
            "generated_tokens": self.generated_tokens,
            "num_prompts": self.num_prompts,
            "seconds": self.seconds,
            "reference_seconds": self.reference_seconds,
            "decode_seconds": self.decode_seconds,
            "timing_seconds": self.timing_seconds,
            "num_records": self.num_records,
            "skipped_records": len(self.skipped_records),
            "drafts_per_accepted": self.drafts_per_accepted,
        }
        if self.confidence_min > 0:
            out.update(
                confidence_min=self.confidence_min,
                uncut_tau=self.uncut_tau,
                uncut_drafts_per_accepted=self.uncut_drafts_per_accepted,
            )
        out = {key: value for key, value in out.items() if value is not None}
        if not self.sampling.greedy:
            out.update(
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                seed=self.seed,
            )
        out.update({f"accept_pos_{k}": p for k, p in enumerate(self.accept_pos, start=1)})
        out.update({f"sim_acc_{k}": a for k, a in enumerate(self.sim_acc, start=1)})
        for bucket in self.by_length:
            if not bucket.blocks:
                continue  # no point rather than a made-up one: the bucket's curve has a gap
            figures = bucket.as_dict()
            for name in ("bucket", "low", "high", "accept_pos"):  # in the names, or a series of their own below
                figures.pop(name)
            out.update({f"{name}_by_length/{bucket.label}": v for name, v in figures.items() if v is not None})
            out.update(
                {f"accept_pos_by_length/{bucket.label}/{k}": p for k, p in enumerate(bucket.accept_pos, start=1)}
            )
        return {prefix + key: value for key, value in out.items()}

    def by_length_table(self, positions: int = 4) -> str:
        """The acceptance per bucket of context length beside the break-even tau there, as ``launch.evaluate
        --by-length`` prints it (the first ``positions`` slots' acceptance)."""
        shown = min(positions, self.block_size - 1)
        slots = " ".join(f"{f'k={k}':>5}" for k in range(1, shown + 1))
        lines = [
            "acceptance by context length (a verify forward counts at its context: the prompt and the tokens generated "
            "before its block)",
            f"{'bucket':<10} {'prompts':>7} {'blocks':>7} {'tau':>6} {'zlab':>6}  {slots}  {'context':>8} "
            f"{'draft ms':>9} {'verify ms':>9} {'decode ms':>9} {'break-even':>10} {'speedup':>7}",
        ]
        for bucket in self.by_length:
            costs = bucket.costs
            cells = [
                f"{bucket.label:<10}",
                f"{bucket.prompts:>7}",
                f"{bucket.blocks:>7}",
                _cell(bucket.tau, 6, ".3f"),
                _cell(bucket.zlab_tau, 6, ".3f"),
                " " + " ".join(_cell(p, 5, ".3f") for p in (bucket.accept_pos or [None] * shown)[:shown]),
                " " + _cell(costs and costs.context, 8, "d"),
                _cell(costs and 1e3 * costs.draft_seconds, 9, ".3f"),
                _cell(costs and 1e3 * costs.verify_seconds, 9, ".3f"),
                _cell(costs and 1e3 * costs.decode_seconds, 9, ".3f"),
                _cell(costs and costs.break_even_tau, 10, ".3f"),
                _cell(bucket.speedup, 6, ".2f") + ("x" if bucket.speedup is not None else " "),
            ]
            row = " ".join(cells)
            lines.append(row)
        lines.append(
            "break-even: (draft + verify) / decode, timed at the bucket's context (batch of one prompt); speculation "
            "pays where tau exceeds it, and speedup = tau / break-even"
        )
        if self.skipped_records:
            lines.append(
                f"{len(self.skipped_records)} held-out records skipped: "
                + "; ".join(self.skipped_records[:3])
                + (" ..." if len(self.skipped_records) > 3 else "")
            )
        return "\n".join(lines)

    def table(self) -> str:
        sampling = self.sampling
        how = (
            "greedy"
            if sampling.greedy
            else f"sampled at temperature {sampling.temperature:g}, top_p "
            f"{sampling.top_p:g}, top_k {sampling.top_k}, seed {self.seed}"
        )
        prompts = f"{self.num_prompts} prompts"
        if self.num_records and self.num_records != self.num_prompts:
            prompts += f" (assistant turns of {self.num_records} records)"
        lines = [
            f"{prompts}, {self.generated_tokens} tokens generated, block size {self.block_size}, {how}",
            f"tau (real)       {self.tau:6.3f}   mean tokens per target verify forward (max {self.block_size}), "
            "pooled, last blocks whole",
            f"tau (z-lab)      {self.zlab_tau:6.3f}   tokens added per step, cut at the stop token and max_new_tokens, "
            "mean per prompt, then over prompts",
            f"tau (simulated)  {self.sim_tau:6.3f}   teacher-forced on the same documents; gap {self.tau_gap:+.3f}",
        ]
        if self.sim_tau_greedy is not None and self.sim_tau_walk is not None:
            lines += [
                f"  on the target's text       {self.sim_tau_greedy:6.3f}   teacher-forced on what the decoding produced "
                f"(documents {self.sim_tau - self.sim_tau_greedy:+.3f} from it)",
                f"  at the decoding's anchors  {self.sim_tau_walk:6.3f}   the blocks the decoding ran, in the training "
                f"forward (anchors {self.sim_tau_walk - self.sim_tau_greedy:+.3f}, serving {self.tau - self.sim_tau_walk:+.3f})",
            ]
        if self.confidence_min > 0 and self.uncut_tau is not None:
            lines.append(
                f"confidence cut   {self.confidence_min:6.3f}   tau {self.tau:.3f} against {self.uncut_tau:.3f} without it; "
                f"drafts verified per accepted {_cell(self.drafts_per_accepted, 5, '.3f').strip()} against "
                f"{_cell(self.uncut_drafts_per_accepted, 5, '.3f').strip()}"
            )
        lines += [
            f"target forwards  {self.target_forwards:6d}   vs {self.greedy_forwards} for plain "
            f"{'greedy' if sampling.greedy else 'sampled'} decoding: {self.forwards_saved:.1%} saved",
        ]
        lines += ["slot k    accepted (real, streak reaches k)    acc_k (simulated)"]
        lines += [
            f"{k:6d}    {p:10.3f}                           {a:10.3f}"
            for k, (p, a) in enumerate(zip(self.accept_pos, self.sim_acc), start=1)
        ]
        return "\n".join(lines)


def by_length_summary(metrics: Mapping[str, float]) -> str:
    """The tau of each context-length bucket in an evaluation's ``metrics`` (``AcceptanceReport.metrics()``), with its
    break-even tau where timed, in one line for a log; empty without them."""
    parts = []
    for key, tau in metrics.items():
        if key.startswith("eval/tau_by_length/"):
            bucket = key.removeprefix("eval/tau_by_length/")
            break_even = metrics.get(f"eval/break_even_tau_by_length/{bucket}")
            parts.append(f"{bucket} {tau:.3f}" + (f" (break-even {break_even:.3f})" if break_even is not None else ""))
    return ", ".join(parts)


def warn_if_gap(metrics: Mapping[str, float], block_size: int, tolerance: float) -> None:
    """The warning of a real tau far from the simulated one (more than ``tolerance`` of B - 1) in an evaluation's
    ``metrics`` (``AcceptanceReport.metrics()``), with the three steps the gap is made of."""
    gap = metrics.get("eval/tau_gap", 0.0)
    if abs(gap) <= tolerance * (block_size - 1):
        return
    if "eval/sim_tau_walk" not in metrics:
        log.warning(
            "real and simulated tau differ by more than eval.gap_tolerance (%.2f of B - 1): check the "
            "target layer ids, the rope settings, the loss mask and whether the data is the target's "
            "own text",
            tolerance,
        )
        return
    greedy, walk = metrics["eval/sim_tau_greedy"], metrics["eval/sim_tau_walk"]
    log.warning(
        "real and simulated tau differ by more than eval.gap_tolerance (%.2f of B - 1): %+.3f in all, of it "
        "%+.3f the documents against the target's own text (data it did not write), %+.3f the anchors decoding "
        "starts its blocks at (after each rejection), %+.3f serving against training (not about 0: check the "
        "target layer ids, the rope settings and the masks)",
        tolerance,
        gap,
        greedy - metrics["eval/sim_tau"],
        walk - greedy,
        metrics["eval/tau"] - walk,
    )

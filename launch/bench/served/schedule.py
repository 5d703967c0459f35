"""One schedule for every side of a served check: what each decoder did per prompt, counted two ways, and compared.

Every side (a real server, our evaluator, our live decoder, z-lab's ``dflash_generate``) reports per prompt the
generated tokens (cut at ``max_new_tokens`` and after the first stop token, the stop token kept) and, where it can, the
drafts each verify forward accepted. The sides count those steps differently at the end of an answer:

- ours, the live decoder and vLLM count the last block whole, even past the stop token or ``max_new_tokens``
  ("as run": vLLM's counters, our tau);
- llama.cpp stops accepting after an end-of-generation token and drafts shorter blocks as ``n_predict`` nears; z-lab's
  decoder cuts its last step at the stop token and drafts short blocks as ``max_new_tokens`` nears.

So each side runs ``B - 1`` tokens further than the answer where it can (no block inside the answer is shortened) and
the comparison reads every side on one schedule: the tokens each verify forward added to the answer, cut at its end
(z-lab's ``acceptance_lengths``, ``lengths_of``). Two sides agree when their tokens and these lengths are equal for
every prompt, and, where both say how many drafts each verify forward verified (llama.cpp's trace, ours; fewer than
B - 1 where a confidence head cut the block), those counts too. Where the tokens differ, the target itself chose another token (a greedy target's text does not depend on
the drafter); when its top two logits there lie within ``tie_margin``, that is the target's arithmetic (a near-tie of
two float implementations), a documented cause that is named but not counted as a difference. Likewise where two sides
cut a block at different drafts while the confidence of the first draft they disagree on lies within ``cut_tie`` of the
cut (a near-tie of the cut: one arithmetic put it just above, the other just below).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptRun:
    """One prompt decoded by one side."""

    tokens: list[int]
    """Generated tokens, cut at max_new_tokens and after the first stop token (kept)."""
    accepted: list[int] | None
    """Per verify forward, the drafts the target accepted as this side counts them; None where the side gives no
    per-step figures (vLLM: pooled counters only)."""
    drafted: list[int] | None = None
    """Per verify forward, the drafts it verified (B - 1 but where a confidence cut the block; 0: a forward of the
    given token alone); None where the side does not say (z-lab's decoder, vLLM)."""


@dataclass
class Side:
    """One decoder's runs of every prompt, and its pooled counters as it reports them itself."""

    name: str
    runs: list[PromptRun]
    block_size: int
    reported: dict | None = None
    """Pooled counters as the side counts them (``counts_of``'s keys), where it reports its own (vLLM)."""
    seconds: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def has_steps(self) -> bool:
        return all(run.accepted is not None for run in self.runs)

    def as_run(self) -> dict:
        """Pooled counters as the side counts them: its own report, else its steps that begin inside the answer,
        each counted as the side counted it (the last block whole where it does)."""
        if self.reported is not None:
            return self.reported
        steps = [steps_in_answer(run) for run in self.runs]
        drafted = None
        if all(run.drafted is not None for run in self.runs):
            drafted = [n for run, kept in zip(self.runs, steps) for n in run.drafted[: len(kept)]]
        return counts_of([n for kept in steps for n in kept], self.block_size, drafted)

    def on_schedule(self) -> list[list[int]] | None:
        """Per prompt, the tokens each verify forward added to the answer (``lengths_of``); None without steps."""
        return [lengths_of(run) for run in self.runs] if self.has_steps else None


def steps_in_answer(run: PromptRun) -> list[int]:
    """The run's steps that begin inside its answer (a side that ran further left the rest out), as counted."""
    kept, generated = [], 1
    for num_accepted in run.accepted or []:
        if generated >= len(run.tokens):
            break
        kept.append(num_accepted)
        generated += num_accepted + 1
    return kept


def lengths_of(run: PromptRun) -> list[int]:
    """Tokens each verify forward added to the answer, cut at its end (the prefill's token is no step): z-lab's
    ``acceptance_lengths``. Steps past the answer's end (a side that ran further) are left out."""
    from common.acceptance.arithmetic import Decoded, zlab_acceptance_lengths

    return zlab_acceptance_lengths(Decoded(run.tokens, list(run.accepted or [])))


def counts_of(accepted: list[int], block_size: int, drafted: list[int] | None = None) -> dict:
    """Verify forwards' acceptances as vLLM and llama.cpp count them: drafts (verify forwards), drafted tokens (B - 1
    a forward unless ``drafted`` says how many each verified) and, per position k = 1 .. B - 1, the forwards that
    accepted at least k drafts."""
    per_pos = [sum(n >= k for n in accepted) for k in range(1, block_size)]
    draft_tokens = len(accepted) * (block_size - 1) if drafted is None else sum(drafted)
    return {"drafts": len(accepted), "draft_tokens": draft_tokens, "accepted_per_pos": per_pos}


def tau_of(counts: dict) -> float:
    """Our tau: 1 + accepted drafts per verify forward."""
    return 1.0 + sum(counts["accepted_per_pos"]) / max(counts["drafts"], 1)


def zlab_tau_of(lengths: list[list[int]]) -> float:
    """z-lab's tau: each prompt's mean acceptance length, then the mean over prompts (prompts with no step left out)."""
    means = [sum(per) / len(per) for per in lengths if per]
    return sum(means) / len(means) if means else 0.0


def scheduled_counts(side: Side) -> dict | None:
    """Pooled counters on the common schedule (each forward's accepted drafts = tokens added - 1)."""
    lengths = side.on_schedule()
    if lengths is None:
        return None
    drafted = None
    if all(run.drafted is not None for run in side.runs):
        drafted = [n for run, per in zip(side.runs, lengths) for n in run.drafted[: len(per)]]
    return counts_of([n - 1 for per in lengths for n in per], side.block_size, drafted)


@dataclass
class Difference:
    """The first place where a side differs from the reference side."""

    side: str
    prompt: int
    what: str
    """"tokens", "steps" (accepted or verified drafts) or "counters"."""
    step: int | None = None
    position: int | None = None
    """Token index in the answer where the first differing step begins (steps) or the first differing token."""
    detail: str = ""
    margin: float | None = None
    """For differing tokens: the target's top-two logit margin there (ours), when it was measured."""
    target_split: bool = False
    """Differing tokens at a near-tie of the target (margin <= tie_margin): the target's arithmetic, not the drafter."""
    cut_margin: float | None = None
    """For blocks cut at different drafts: the distance of the confidence of the first draft they disagree on from the
    cut (ours, that block alone), when it was measured."""
    cut_tie: bool = False
    """Blocks cut differently at a near-tie of the cut (cut_margin <= cut_tie): the heads' arithmetic."""

    def describe(self) -> str:
        where = f"prompt {self.prompt}"
        if self.step is not None:
            where += f", step {self.step}"
        if self.position is not None:
            where += f", token {self.position}"
        text = f"{self.side}: {self.what} differ at {where}: {self.detail}"
        if self.margin is not None:
            kind = "a near-tie of the target (its arithmetic, not the drafter's)" if self.target_split else "no tie"
            text += f"; the target's top-two logit margin there is {self.margin:.5f}: {kind}"
        if self.cut_margin is not None:
            kind = "a near-tie of the cut (the head's arithmetic, not its decision)" if self.cut_tie else "no tie"
            text += f"; the confidence there lies {self.cut_margin:.2e} from the cut: {kind}"
        return text


def first_token_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two answers differ (one a strict prefix of the other: its length), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    reference: Side,
    other: Side,
    margin_at=None,
    tie_margin: float = 1e-3,
    cut_margin_at=None,
    cut_tie: float = 1e-4,
) -> list[Difference]:
    """Where ``other`` differs from ``reference``, per prompt, on the common schedule: tokens first (then the steps
    before the first differing token still must agree), then the steps; sides without steps by their counters.
    ``margin_at(prompt, position)`` gives the target's top-two logit margin before answer token ``position``;
    ``cut_margin_at(prompt, position, draft)`` the distance from the cut of the confidence of draft ``draft`` (0-based)
    of the block anchored at answer token ``position - 1``."""
    found: list[Difference] = []
    for p, (ref, run) in enumerate(zip(reference.runs, other.runs)):
        split = first_token_difference(ref.tokens, run.tokens)
        if split is not None:
            margin = margin_at(p, split) if margin_at is not None and split < len(ref.tokens) else None
            found.append(
                Difference(
                    other.name,
                    p,
                    "tokens",
                    position=split,
                    detail=f"{reference.name} {ref.tokens[split : split + 3]}, {other.name} "
                    f"{run.tokens[split : split + 3]}",
                    margin=margin,
                    target_split=margin is not None and margin <= tie_margin,
                )
            )
        if ref.accepted is not None and run.accepted is not None:
            names = (reference.name, other.name)
            cut_at = None if cut_margin_at is None else lambda position, draft: cut_margin_at(p, position, draft)
            difference = step_difference(names, p, ref, run, split, cut_at, cut_tie)
            found += [difference] if difference is not None else []
    if not other.has_steps or not reference.has_steps:
        found += counter_differences(reference, other, tokens_differ=any(d.what == "tokens" for d in found))
    return found


def step_difference(
    names: tuple[str, str], p: int, ref: PromptRun, run: PromptRun, split: int | None, cut_margin_at, cut_tie: float
) -> Difference | None:
    """The first verify forward of prompt ``p`` where ``run`` (of ``names[1]``) accepts or verifies otherwise than
    ``ref`` (of ``names[0]``), before the tokens ``split``; or a different count of forwards."""
    ref_lengths, lengths = lengths_of(ref), lengths_of(run)
    generated = 1
    for step, (x, y) in enumerate(zip(ref_lengths, lengths)):
        if split is not None and generated + max(x, y) > split:
            return None  # past the target's split the two decode different texts
        if x != y:
            detail = f"{names[0]} accepted {x - 1} drafts, {names[1]} {y - 1}"
            return Difference(names[1], p, "steps", step=step, position=generated, detail=detail)
        verified = drafted_at(ref, step), drafted_at(run, step)
        if None not in verified and verified[0] != verified[1]:  # the same acceptance of a differently cut block
            cut = cut_margin_at(generated, min(verified)) if cut_margin_at is not None else None
            detail = f"{names[0]} verified {verified[0]} drafts, {names[1]} {verified[1]}"
            return Difference(
                names[1],
                p,
                "steps",
                step=step,
                position=generated,
                detail=detail,
                cut_margin=cut,
                cut_tie=cut is not None and cut <= cut_tie,
            )
        generated += x
    if split is None and len(ref_lengths) != len(lengths):
        detail = f"{names[0]} took {len(ref_lengths)} verify forwards, {names[1]} {len(lengths)}"
        return Difference(names[1], p, "steps", step=min(len(ref_lengths), len(lengths)), detail=detail)
    return None


def counter_differences(reference: Side, other: Side, tokens_differ: bool) -> list[Difference]:
    """Where a side without steps differs by its counters (none when the tokens differ already)."""
    found = []
    mine, theirs = reference.as_run(), other.as_run()
    for key in ("drafts", "draft_tokens", "accepted_per_pos"):
        if mine[key] != theirs[key] and not tokens_differ:
            detail = f"{key}: {reference.name} {mine[key]}, {other.name} {theirs[key]}"
            found.append(Difference(other.name, -1, "counters", detail=detail))
    return found


def drafted_at(run: PromptRun, step: int) -> int | None:
    """The drafts verify forward ``step`` verified, where the side says."""
    return run.drafted[step] if run.drafted is not None and step < len(run.drafted) else None


def failures(found: list[Difference]) -> list[Difference]:
    """The differences not explained by a documented cause (a target split, a near-tie of the cut)."""
    return [d for d in found if not d.target_split and not d.cut_tie]


def summary_of(side: Side) -> dict:
    """One side's figures for the JSON and the table: as run, on the schedule, both taus, tokens."""
    as_run = side.as_run()
    scheduled = scheduled_counts(side)
    lengths = side.on_schedule()
    return {
        "as_run": as_run,
        "tau": tau_of(as_run),
        "on_schedule": scheduled,
        "zlab_tau": zlab_tau_of(lengths) if lengths is not None else None,
        "generated_tokens": sum(len(run.tokens) for run in side.runs),
        "seconds": side.seconds,
        **side.notes,
    }


def table(sides: list[Side], reference: Side, differences: dict[str, list[Difference]]) -> str:
    """The sides side by side: each side's counters as it counts them ("as run": vLLM's and ours count the last block
    whole, llama.cpp stops at the end token), then on the common schedule (cut at the answer's end; "-" for a side
    with counters only), both taus, the share of prompts whose tokens equal the reference's and whether the side
    agrees with it."""
    width = 13
    lines = ["".ljust(34) + "".join(s.name.rjust(width) for s in sides)]

    def row(label: str, values: list) -> None:
        lines.append(label.ljust(34) + "".join(str(v).rjust(width) for v in values))

    summaries = [summary_of(s) for s in sides]
    row("verify forwards", [s["as_run"]["drafts"] for s in summaries])
    row("accepted drafts, as run", [sum(s["as_run"]["accepted_per_pos"]) for s in summaries])
    row("drafted tokens, as run", [s["as_run"]["draft_tokens"] for s in summaries])
    row("tau, ours (as run)", [f"{s['tau']:.4f}" for s in summaries])
    row(
        "accepted drafts, schedule",
        ["-" if s["on_schedule"] is None else sum(s["on_schedule"]["accepted_per_pos"]) for s in summaries],
    )
    row("tau, z-lab's (schedule)", ["-" if s["zlab_tau"] is None else f"{s['zlab_tau']:.4f}" for s in summaries])
    row("generated tokens", [s["generated_tokens"] for s in summaries])
    row(
        f"same tokens as {reference.name}",
        [
            "-"
            if side is reference
            else f"{sum(a.tokens == b.tokens for a, b in zip(reference.runs, side.runs))}/{len(side.runs)}"
            for side in sides
        ],
    )
    row(
        "agrees",
        [
            "-" if side is reference else ("yes" if not failures(differences.get(side.name, [])) else "NO")
            for side in sides
        ],
    )
    for k in range(1, reference.block_size):
        row(f"accepted at position {k}, as run", [s["as_run"]["accepted_per_pos"][k - 1] for s in summaries])
    return "\n".join(lines)

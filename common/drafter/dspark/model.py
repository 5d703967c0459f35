"""The DSpark drafter: DFlash's backbone, a low-rank Markov head and a confidence head.

Per drafted slot k (1..B-1) with hidden state h_k (after the final norm) and previous token t (the block's given token
before slot 1, the token of slot k - 1 after it):

- Markov head: e = W1[t] (its own table, vocabulary x r) and a feature u of r values: ``vanilla`` u = e; ``gated``
  u = sigmoid(gate([h_k; e])) * e; ``rnn`` a gated recurrence over the block's slots (from the given token's, as speculators runs it), s_k = g s_{k-1} + (1 - g)
  tanh(c), u = tanh(o), with (g, c, o) from joint([s_{k-1}; e; h_k]). The slot's logits are the target head's plus
  W2 u (W2: vocabulary x r). W2 starts at zero, so a fresh head adds nothing and a drafter warm-started from DFlash
  proposes what that drafter did.
- Confidence head: sigmoid(proj([h_k; e])), the probability that slot k is accepted given that the earlier slots
  were.

Training (the objective of Model-Optimizer's DSpark recipe and Megatron-Bridge's design, with the previous tokens
teacher-forced from the data as speculators does): per slot ``ce_alpha`` CE to the label + ``tv_alpha`` TV(q, p), with
q the Markov-corrected draft distribution and p the target's, from its frozen head on its final hidden state; plus
``confidence_alpha`` BCE of the confidence logit to the slot's acceptance rate 1 - TV (detached). Every term is
weighted by the DFlash loss's slot weights (``training.weighting``) and normalised by their sum. The vocabulary-wide
rows are computed a few blocks at a time with their gradient written by hand (head_loss.py): three vocabulary-wide
products per row, and no N x B x vocabulary tensor kept for the backward.

Decoding walks the block from its given token, feeding each slot's token to the next slot's Markov head: the argmax
(greedy) or a draw from the corrected distribution at the sampling settings (kept for rejection sampling), with each
slot's confidence in the proposal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.drafter.draft_config import DraftConfig
from common.drafter.dspark.head_loss import MarkovTargets, markov_head_rows
from common.drafter.head import KindHead, ObjectiveInput, ProposalInput, walk_slots
from common.drafter.loss import draft_metrics
from common.drafter.sampling import Proposal


class MarkovHead(nn.Module):
    """The Markov head; tensor names as speculators saves them: ``markov_w1.weight`` [V, r], ``markov_w2.weight``
    [V, r], and ``gate_proj`` [r, H + r] (gated) or ``joint_proj`` [3r, 2r + H] (rnn) with biases."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        rank, hidden = config.options.markov_rank, config.hidden_size
        self.head_type = config.options.markov_head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random table and gates, zero W2: no bias until it learns."""
        with torch.no_grad():
            nn.init.normal_(self.markov_w1.weight, std=std)
            self.markov_w2.weight.zero_()
            for name in ("gate_proj", "joint_proj"):
                if name in self._modules:
                    nn.init.normal_(self._modules[name].weight, std=std)
                    nn.init.zeros_(self._modules[name].bias)

    def step(
        self, hidden: torch.Tensor, previous: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One slot: (feature u [R, r], e = W1[previous] [R, r], the next state) of hidden [R, H], previous [R]."""
        e = self.markov_w1(previous)
        if self.head_type == "vanilla":
            return e, e, None
        h = hidden.to(e.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e, e, None
        if state is None:
            state = e.new_zeros(e.shape)
        gate, candidate, out = self.joint_proj(torch.cat([state, e, h], -1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(out), e, state

    def features(self, hidden: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, e) [N, S, r] of the slots' hidden states [N, S, H] and previous tokens [N, S] (teacher-forced); the
        rnn's recurrence runs from the first slot given."""
        if self.head_type != "rnn":
            u, e, _ = self.step(hidden, previous, None)
            return u, e
        state, features, embeddings = None, [], []
        for slot in range(hidden.shape[1]):  # the recurrence runs over the block's slots, r wide: cheap
            u, e, state = self.step(hidden[:, slot], previous[:, slot], state)
            features.append(u)
            embeddings.append(e)
        return torch.stack(features, 1), torch.stack(embeddings, 1)


class ConfidenceHead(nn.Module):
    """``proj`` [1, H + r] with bias: the logit of a slot's acceptance from [h; W1[previous]]."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size + config.options.markov_rank, 1)

    def reset_parameters(self, std: float = 0.02) -> None:
        with torch.no_grad():
            nn.init.normal_(self.proj.weight, std=std)
            nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([hidden, embedding.to(hidden.dtype)], -1).to(self.proj.weight.dtype)).squeeze(-1)


class DSparkKindHead(KindHead):
    """DSpark's heads on the DFlash backbone (see the module's doc), added to DFlash's state dict as
    ``markov_head.*`` and ``confidence_head.*``."""

    title = "DSpark"
    logged_metrics = ("base_tau", "tv", "confidence/loss", "confidence/mean", "confidence/target")
    state_names = ("markov_head", "confidence_head")

    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config)
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config) if config.options.enable_confidence_head else None

    def parts(self) -> dict[str, nn.Module | None]:
        return {"markov_head": self.markov_head, "confidence_head": self.confidence_head}

    def reset(self, drafter: nn.Module, std: float = 0.02) -> None:
        """A no-op Markov head (W2 zero) and a fresh confidence head: the drafter proposes what its backbone would."""
        self.markov_head.reset_parameters(std)
        if self.confidence_head is not None:
            self.confidence_head.reset_parameters(std)

    # -- training -------------------------------------------------------------------------------

    def objective(self, slots: ObjectiveInput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if slots.target_hidden is None:
            raise ValueError("a dspark drafter's objective needs the target's final hidden state (batch.last_hidden)")
        config, options, blocks = slots.loss_config, self.config.options, slots.blocks
        # The previous token of each slot, teacher-forced: the given token before slot 1, the data token after (and
        # the given token at slot 0, where the rnn's recurrence starts).
        previous = torch.cat([blocks.block_ids[:, :1], blocks.block_ids[:, :1], blocks.label_ids[:, :-1]], dim=1)
        features, embeddings = self.markov_head.features(slots.hidden, previous)
        features, embeddings = features[:, 1:], embeddings[:, 1:]
        rows, features = slots.slot_rows, features.reshape(-1, features.shape[-1])
        targets = slots.target_hidden[(blocks.label_index - 1).reshape(-1)]  # the target predicts x_{a+k} at a + k - 1
        labels = None if config.labels_from_target else blocks.label_ids.reshape(-1)
        head = markov_head_rows(
            rows,
            features,
            self.markov_head.markov_w2.weight,
            MarkovTargets(
                slots.target_head.lm_head_weight,
                targets,
                labels,
                blocks.label_mask,
                config,
                options.ce_alpha,
                options.tv_alpha,
            ),
        )
        ce, tv, label, picked, base_picked, weights = head[1:]
        acceptance = 1.0 - tv
        total = weights.sum().clamp_min(1e-6)
        loss = head.weighted / total
        mask = blocks.label_mask.reshape(-1).float()
        supervised = mask.sum().clamp_min(1.0)
        if self.confidence_head is not None:
            logit = self.confidence_head(rows, embeddings.reshape(-1, embeddings.shape[-1])).float()
            bce = F.binary_cross_entropy_with_logits(logit, acceptance, reduction="none")
            confidence_loss = (weights * bce).sum() / total
            loss = loss + options.confidence_alpha * confidence_loss
            confidence_mean = (torch.sigmoid(logit.detach()) * mask).sum() / supervised
        else:
            confidence_loss, confidence_mean = torch.zeros((), device=rows.device), torch.ones((), device=rows.device)
        # Teacher-forced, a block's streak of right picks equals the free walk's: while every earlier pick was right,
        # the previous token it conditions on is the data token (exact for data labels).
        row_ce = ce.detach().view_as(blocks.label_mask)
        metrics = draft_metrics(blocks, row_ce, (picked == label).view_as(blocks.label_mask))
        base = draft_metrics(blocks, row_ce, (base_picked == label).view_as(blocks.label_mask))
        metrics.update(
            loss=loss.detach(),
            base_tau=base["tau"],
            tv=(tv.detach() * mask).sum() / supervised,
            **{
                "confidence/loss": confidence_loss.detach(),
                "confidence/mean": confidence_mean,
                "confidence/target": (acceptance * mask).sum() / supervised,
            },
        )
        return loss, metrics

    # -- decoding -------------------------------------------------------------------------------

    def propose(self, walk: ProposalInput) -> Proposal:
        """The Markov walk over slots 1..B-1 from each block's given token: the argmax of the corrected logits
        (greedy), or a draw from their sampling distribution (kept in the proposal), with each slot's confidence."""
        markov, w2 = self.markov_head, self.markov_head.markov_w2
        # the rnn's recurrence starts at the given token's slot, as speculators runs it
        _, _, state = markov.step(walk.hidden[:, 0], walk.anchor_ids.long(), None)
        hidden, confidence = walk.hidden[:, 1:], []

        def scores_of(slot: int, pick: torch.Tensor | None) -> torch.Tensor:
            nonlocal state
            previous = walk.anchor_ids.long() if pick is None else pick
            features, embedding, state = markov.step(hidden[:, slot], previous, state)
            if self.confidence_head is not None:
                confidence.append(torch.sigmoid(self.confidence_head(hidden[:, slot], embedding).float()))
            return walk.logits[:, slot] + w2(features.to(w2.weight.dtype))

        tokens, probs = walk_slots(scores_of, hidden.shape[1], walk, over_vocabulary=True)
        return Proposal(tokens=tokens, probs=probs, confidence=torch.stack(confidence, 1) if confidence else None)

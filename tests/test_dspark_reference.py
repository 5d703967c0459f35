"""Our DSpark drafter against speculators' own DSpark model (``speculators.models.dspark.DSparkDraftModel``, the
reference) loaded from our speculators export, in fp32. Set up by launch/setup_speculators.sh (speculators 0.9.0 in
./.speculators), run with ``pytest -m reference tests/test_dspark_reference.py``.

For each Markov head (vanilla, gated, rnn), with the weights as built (random backbone, no-op Markov head) and with
every weight moved away from its start (as after training), the test exports our drafter, loads the export into the
reference strictly (every tensor of ours used, nothing of the reference missing but the verifier's embedding /
lm_head / final norm, which it reads from the verifier folder: our random target head saved there), and compares:

(a) the backbone: the block hidden states after the final norm (every slot) and their draft logits, our training
    forward and our decoding path (``draft_rows``) against the reference's training forward on the same target
    features, tokens and anchors;
(b) the Markov-corrected logits of every drafted slot, teacher-forced (the previous token of slot 1 is the anchor,
    of slot k the data token at slot k - 1): what our objective computes against what the reference's forward hands
    its loss, and the previous tokens each side reads;
(c) the confidence logit of every drafted slot, the same way;
(d) the greedy walk: our ``propose`` over the decoding path's hidden states against the reference's Markov chain
    run step by step (its ``block_bias`` over the slots so far, previous tokens the walk's own) on the reference's
    hidden states, token for token, with each slot's confidence;
(e) the per-slot TV to the target and CE to the data label our objective trains with, against the reference's
    ``tv_loss`` of its logits and targets.

The reference is driven through its training forward (it has no decoding method): ``select_anchors`` draws the
anchors at random among the supervised positions, so the loss mask supervises exactly the anchors we pick and it
takes them all; its loss (``compute_metrics``) is replaced for the call by a function that keeps its inputs.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

import common.drafter.dspark.model as dspark_model
from common.batch import PackedBatch
from common.drafter.blocks import build_blocks
from common.drafter.export import export_speculators
from common.drafter.model import build_drafter
from producer.acceptance.decoder import draft_rows
from tests.drafter_fixtures import random_head, tiny_config

# launch/setup_speculators.sh installs it; a missing one names itself in the skip reason. speculators.utils.loading
# (loguru) is imported only when a model loads its verifier.
pytestmark = [pytest.mark.reference, pytest.mark.usefixtures("one_thread")]
pytest.importorskip("speculators")
pytest.importorskip("speculators.utils.loading")
import speculators.models.dspark.core as reference_core  # noqa: E402
from speculators.losses.eager import tv_loss  # noqa: E402  (the fused one needs Triton)
from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig  # noqa: E402

TOLERANCE = 1e-4
CONTEXT = 24
ANCHORS = [0, 5, 9, 14, 19]  # one document; an anchor at 0 drafts with no context at all
VERIFIER_KEYS = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
"""The reference's tensors that come from the verifier, not the export (our export leaves them out too)."""


def trained_like(drafter, seed: int = 1):
    """Every weight away from its start: the Markov head's W2 no longer zero, gates, recurrence and confidence head
    far from their init, the backbone's norms no longer ones."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            scale = 0.5 if name.startswith(("markov_head.", "confidence_head.")) else 0.05
            param.add_(scale * torch.randn(param.shape, generator=gen))
    return drafter


def verifier_folder(head, config, directory: Path) -> Path:
    """The target's embedding, lm_head and final norm, where the reference reads them (its verifier), and a Qwen3
    config.json (the reference picks the verifier's norm convention from its model_type)."""
    from transformers import Qwen3Config

    directory.mkdir(parents=True)
    tensors = {
        "model.embed_tokens.weight": head.embed_weight,
        "lm_head.weight": head.lm_head_weight,
        "model.norm.weight": head.norm_weight,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    Qwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.target_hidden_size,
        num_hidden_layers=config.num_target_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
    ).save_pretrained(directory)
    return directory


def reference_model(export: Path, head) -> DSparkDraftModel:
    """The reference loaded from our export, every tensor checked: all of ours used as written, and none of its own
    left out but the verifier's, which are our target head's."""
    config = DSparkSpeculatorConfig.from_pretrained(export)
    # Its default, flex attention with a torch.compile'd block mask, compiles for minutes on a CPU; eager attention
    # with its float mask is the same attention (its trainer's draft_attn_impl chooses between them).
    config.transformer_layer_config._attn_implementation = "eager"
    ref = DSparkDraftModel.from_pretrained(export, config=config, dtype=torch.float32).eval()
    assert ref.config.sample_from_anchor is False and ref.config.confidence_head_with_markov is True
    ours = load_file(str(export / "model.safetensors"))
    theirs = ref.state_dict()
    assert set(ours) <= set(theirs), f"tensors of our export the reference has no place for: {set(ours) - set(theirs)}"
    assert set(theirs) - set(ours) == VERIFIER_KEYS, f"the reference misses {set(theirs) - set(ours) - VERIFIER_KEYS}"
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    for name, tensor in (
        ("embed_tokens.weight", head.embed_weight),
        ("lm_head.weight", head.lm_head_weight),
        ("verifier_lm_head.weight", head.lm_head_weight),
        ("verifier_norm.weight", head.norm_weight),
    ):
        assert torch.equal(theirs[name], tensor), name
    return ref


def reference_forward(ref, ids, aux, last, anchors) -> dict[str, torch.Tensor]:
    """The reference's training forward on one document, anchored at ``anchors`` (its loss mask supervises exactly
    them, so select_anchors takes them all, sorted). What it computed, kept from its modules and its loss's inputs."""
    kept: dict[str, torch.Tensor] = {}
    previous: list[torch.Tensor] = []
    prev_embeddings = ref.markov_head.prev_embeddings

    def keep_previous(token_ids):
        previous.append(token_ids)
        return prev_embeddings(token_ids)

    def keep_loss_inputs(logits, targets, confidence_logits, *_args, **_kwargs):
        kept.update(logits=logits, targets=targets, confidence=confidence_logits)
        return torch.zeros(()), {}

    loss_mask = torch.zeros(1, ids.shape[0], dtype=torch.long)
    loss_mask[0, anchors] = 1
    hooks = [
        ref.norm.register_forward_hook(lambda _m, _i, out: kept.__setitem__("hidden", out)),
        ref.lm_head.register_forward_hook(lambda _m, _i, out: kept.__setitem__("base", out)),
    ]
    try:
        with (
            torch.no_grad(),
            mock.patch.object(reference_core, "compute_metrics", keep_loss_inputs),
            mock.patch.object(ref.markov_head, "prev_embeddings", keep_previous),
        ):
            ref(
                hidden_states=aux[None],
                input_ids=ids[None],
                loss_mask=loss_mask,
                verifier_last_hidden_states=last[None],
                document_ids=torch.zeros(1, ids.shape[0], dtype=torch.long),
                max_anchors=len(anchors),
            )
    finally:
        for hook in hooks:
            hook.remove()
    (kept["previous"],) = previous
    num_blocks = len(anchors)
    return {name: value.reshape(num_blocks, -1, *value.shape[2:]) for name, value in kept.items()}


def our_objective(drafter, hidden, blocks, last) -> dict[str, torch.Tensor]:
    """What our objective computes per drafted slot: its Markov features' previous tokens, the corrected logits of
    its features, the confidence logits, and its per-row CE / TV (kept from its own calls)."""
    kept: dict[str, object] = {}
    head = drafter.markov_head
    features, head_rows = head.features, dspark_model.markov_head_rows

    def keep_features(slots, previous):
        kept["previous"] = previous
        kept["features"] = features(slots, previous)
        return kept["features"]

    def keep_rows(*args):
        kept["rows"] = head_rows(*args)
        return kept["rows"]

    hook = drafter.confidence_head.register_forward_hook(lambda _m, _i, out: kept.__setitem__("confidence", out))
    try:
        with (
            torch.no_grad(),
            mock.patch.object(head, "features", keep_features),
            mock.patch.object(dspark_model, "markov_head_rows", keep_rows),
        ):
            drafter.objective(hidden, blocks, drafter.target_head.final_norm(last))
    finally:
        hook.remove()
    num_blocks, slots = blocks.label_ids.shape
    u = kept["features"][0][:, 1:]  # slot 0's runs the rnn's recurrence only
    with torch.no_grad():
        logits = drafter.logits(hidden[:, 1:].reshape(num_blocks * slots, -1)).view(num_blocks, slots, -1)
        logits = logits + head.markov_w2(u)
    ce, tv = kept["rows"].ce.view(num_blocks, slots), kept["rows"].tv.view(num_blocks, slots)
    confidence = kept["confidence"].view(num_blocks, slots)
    return {"previous": kept["previous"][:, 1:], "logits": logits, "confidence": confidence, "ce": ce, "tv": tv}


@torch.no_grad()
def reference_walk(ref, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's greedy Markov chain over a block's hidden states ``[N, B, H]`` (slot 0 the anchor's), one slot
    at a time: slot k's logits are its lm_head's plus block_bias over slots 0..k with the previous tokens its forward
    reads (slots 0 and 1: the anchor; slot k: the token drafted at k - 1), and its confidence is its confidence head
    on [h_k; W1[previous]]. Returns the tokens and confidences of slots 1..B-1."""
    base = ref.lm_head(hidden)
    previous = torch.stack([anchor_ids, anchor_ids], dim=1)
    tokens, confidence = [], []
    for slot in range(1, hidden.shape[1]):
        bias = ref.markov_head.block_bias(prev_token_ids=previous, hidden_states=hidden[:, : slot + 1])[:, -1]
        embedding = ref.markov_head.prev_embeddings(previous[:, -1])
        confidence.append(torch.sigmoid(ref.confidence_head(torch.cat([hidden[:, slot], embedding], dim=-1))))
        tokens.append((base[:, slot] + bias).argmax(-1))
        previous = torch.cat([previous, tokens[-1][:, None]], dim=1)
    return torch.stack(tokens, 1), torch.stack(confidence, 1)


def measure(head_type: str, trained: bool, directory: Path) -> dict[str, object]:
    """Both models on the same inputs: ``pairs`` maps each compared quantity to (ours, the reference's)."""
    config = tiny_config(kind="dspark", markov_rank=8, markov_head_type=head_type)
    head = random_head(config)
    torch.manual_seed(0)
    drafter = build_drafter(config, head).eval()
    drafter.reset_parameters(0.2)  # a backbone whose hidden states differ between slots and blocks
    if trained:
        trained_like(drafter)
    verifier = verifier_folder(head, config, directory / "verifier")
    export_speculators(drafter, directory / "draft", str(verifier), dtype=torch.float32)
    ref = reference_model(directory / "draft", head)

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, config.vocab_size - 1, (CONTEXT,), generator=gen)
    aux = torch.randn(CONTEXT, config.fused_feature_size, generator=gen)
    last = torch.randn(CONTEXT, config.target_hidden_size, generator=gen)
    anchors = torch.tensor(ANCHORS)
    num_blocks = len(ANCHORS)

    # ours: the training forward and objective on these anchors, and the decoding path's hidden states
    batch = PackedBatch(
        input_ids=ids.int(),
        loss_mask=torch.ones(CONTEXT, dtype=torch.uint8),
        cu_seqlens=torch.tensor([0, CONTEXT], dtype=torch.int32),
        sample_ids=torch.arange(1),
        aux_hidden=aux,
        last_hidden=last,
    )
    blocks = build_blocks(batch, num_blocks, config.block_size, config.mask_token_id, None, anchors=anchors)
    with torch.no_grad():
        hidden = drafter(aux, blocks, drafter.masks(blocks))
        base = drafter.logits(hidden.reshape(-1, config.hidden_size)).view(num_blocks, config.block_size, -1)
        fused = drafter.fuse_context(aux)
        decoding = draft_rows(drafter, [fused[:a] for a in ANCHORS], ids[anchors], anchors)
    objective = our_objective(drafter, hidden, blocks, last)
    proposal = drafter.propose(decoding, ids[anchors])

    theirs = reference_forward(ref, ids, aux, last, anchors)
    walk_tokens, walk_confidence = reference_walk(ref, theirs["hidden"], ids[anchors])
    logits, targets = theirs["logits"][:, 1:], theirs["targets"][:, 1:]
    labels = blocks.label_ids
    pairs = {
        "hidden": (hidden, theirs["hidden"]),
        "draft_logits": (base, theirs["base"]),
        "decoding_hidden": (decoding, theirs["hidden"]),
        "previous_tokens": (objective["previous"], theirs["previous"][:, 1:]),
        "confidence_logits": (objective["confidence"], theirs["confidence"][:, 1:]),
        "markov_logits": (objective["logits"], logits),
        "tv": (objective["tv"], tv_loss(logits, targets)),
        "ce": (objective["ce"], -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)),
        "walk_tokens": (proposal.tokens, walk_tokens),
        "walk_confidence": (proposal.confidence, walk_confidence),
    }
    return {
        "pairs": pairs,
        "walk_differs_from_draft_argmax": bool((proposal.tokens != base[:, 1:].argmax(-1)).any()),
    }


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours.double() - theirs.double()).abs().max().item()


def summary(measured: dict[str, object]) -> str:
    diffs = ", ".join(f"{name} {max_diff(*pair):.2e}" for name, pair in measured["pairs"].items())
    return f"max abs diff: {diffs}"


VARIANTS = [
    pytest.param(
        head_type,
        trained,
        id=f"{head_type}-{'trained' if trained else 'init'}",
    )
    for head_type in ("vanilla", "gated", "rnn")
    for trained in (False, True)
]


@pytest.mark.parametrize(("head_type", "trained"), VARIANTS)
def test_our_dspark_drafter_equals_speculators_dspark_loaded_from_our_export(tmp_path, head_type, trained):
    measured = measure(head_type, trained, tmp_path)
    pairs, diffs = measured["pairs"], summary(measured)
    if trained:
        assert measured["walk_differs_from_draft_argmax"], "the Markov head changes no greedy token: a weak comparison"
    # the backbone and the head-independent parts first
    order = ("hidden", "draft_logits", "decoding_hidden", "previous_tokens", "confidence_logits", "markov_logits")
    for name in (*order, "tv", "ce", "walk_tokens", "walk_confidence"):
        ours, theirs = pairs[name]
        if ours.dtype == torch.long:
            assert torch.equal(ours, theirs), f"{name}: ours {ours.tolist()}, reference {theirs.tolist()}; {diffs}"
        else:
            assert torch.allclose(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE), f"{name} differs: {diffs}"

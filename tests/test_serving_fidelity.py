"""Serving fidelity: each server runs a drafter with the in-block causality it trained with.

Every server decides each draft layer's causality inside the block from the exported config.json.
The rules below are written out from the servers' own code (where each comes from is named); the
exported config of both formats, resolved by each rule, must give per layer the causality the
drafter trained with, or the export must refuse. A forward with that served causality, written
here from the definition (one block over its document), must equal the training forward.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.drafter.blocks import build_blocks
from common.drafter.export import (
    CAUSALITY_KEY,
    ExportError,
    config_from_export,
    export_speculators,
    export_zlab,
    load_drafter,
    speculators_config,
    zlab_config,
)
from common.drafter.model import DFlashDrafter
from tests.drafter_fixtures import random_batch, random_head, tiny_config
from trainer.export import export_checkpoint

ROOT = Path(__file__).resolve().parents[1]
S, F = "sliding_attention", "full_attention"
MODES = ["sliding_causal", "bidirectional", "causal"]
LAYOUTS = {"mixed": [S, S, F], "all_sliding": [S, S, S], "all_full": [F, F, F]}


# -- the servers' rules, per layer i of an exported config.json ----------------------------------


def vllm_zlab(config: dict, i: int) -> bool:
    """vLLM vllm/model_executor/models/qwen3_dflash.py ``_dflash_layer_causal``: a top-level ``is_causal``
    (newer releases), else ``dflash_config.causal`` for every layer, else causal exactly when
    ``layer_types[i] == "sliding_attention"``."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    override = (config.get("dflash_config") or {}).get("causal")
    if override is not None:
        return bool(override)
    layer_types = config.get("layer_types")
    return bool(layer_types) and layer_types[i] == S


def sglang(config: dict, i: int) -> bool:
    """SGLang python/sglang/srt/models/dflash.py ``_get_dflash_layer_attention_params`` and
    ``_get_dflash_attention_type``: the text config's ``is_causal`` if set, else full layers
    bidirectional (ENCODER_ONLY) and sliding layers causal (DECODER)."""
    if config.get("is_causal") is not None:
        return bool(config["is_causal"])
    return config["layer_types"][i] == S


def vllm_speculators(config: dict, i: int) -> bool:
    """vLLM vllm/transformers_utils/configs/speculators/algos.py ``update_dflash`` turns a speculators
    config into the z-lab one with ``dflash_config.causal = not sliding_window_non_causal`` (absent: True),
    then qwen3_dflash's rule above runs on the transformer layer config."""
    translated = dict(config["transformer_layer_config"])
    translated["dflash_config"] = {"causal": not config.get("sliding_window_non_causal", True)}
    return vllm_zlab(translated, i)


def speculators(config: dict, i: int) -> bool:
    """speculators src/speculators/models/dflash: sliding layers causal inside the block unless
    ``sliding_window_non_causal`` (default False); full layers always bidirectional."""
    layer_type = config["transformer_layer_config"]["layer_types"][i]
    return layer_type == S and not config.get("sliding_window_non_causal", False)


ZLAB_SERVERS = {"vllm": vllm_zlab, "sglang": sglang}
SPECULATORS_SERVERS = {"vllm": vllm_speculators, "speculators": speculators}


def served(rule, config: dict, num_layers: int) -> list[bool]:
    return [rule(config, i) for i in range(num_layers)]


def draft_config(layout: str, mode: str, window: int = 6, block_size: int = 4):
    layer_types = LAYOUTS[layout]
    return tiny_config(
        layer_types=layer_types,
        num_hidden_layers=len(layer_types),
        block_size=block_size,
        sliding_window=window if S in layer_types else None,
        in_block_causality=mode,
    )


# -- what the export states -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_zlab_export_is_served_as_trained(layout, mode):
    config = draft_config(layout, mode)
    exported = zlab_config(config)
    for name, rule in ZLAB_SERVERS.items():
        assert served(rule, exported, 3) == config.causal_per_layer, name
    if mode == "sliding_causal":  # the servers' default: layer_types alone says it
        assert "is_causal" not in exported and "causal" not in exported["dflash_config"]
    exported.pop(CAUSALITY_KEY)  # read as a foreign export, by the format's own rule
    assert config_from_export(exported).causal_per_layer == config.causal_per_layer


# Where one sliding_window_non_causal flag cannot describe the drafter: vLLM applies it to every layer.
SPECULATORS_REFUSED = {("mixed", "sliding_causal"), ("mixed", "causal"), ("all_full", "causal")}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_speculators_export_is_served_as_trained_or_refused(layout, mode):
    config = draft_config(layout, mode)
    if (layout, mode) in SPECULATORS_REFUSED:
        with pytest.raises(ExportError, match="speculators format cannot describe"):
            speculators_config(config, "org/target")
        return
    exported = speculators_config(config, "org/target")
    assert "sliding_window_non_causal" in exported, "vLLM's default for a missing flag is non-causal: always state it"
    for name, rule in SPECULATORS_SERVERS.items():
        assert served(rule, exported, 3) == config.causal_per_layer, name
    exported.pop(CAUSALITY_KEY)
    assert config_from_export(exported).causal_per_layer == config.causal_per_layer


def test_refused_speculators_export_writes_nothing(tmp_path):
    config = draft_config("mixed", "sliding_causal")
    drafter = DFlashDrafter(config, random_head(config))
    with pytest.raises(ExportError, match="--format zlab"):
        export_speculators(drafter, tmp_path / "out", "org/target")
    assert not (tmp_path / "out").exists()


# -- the served forward equals the training forward -----------------------------------------------


def served_forward(
    drafter: DFlashDrafter, exported: dict, rule, aux: torch.Tensor, anchor: int, doc_start: int, doc_end: int
) -> torch.Tensor:
    """One block at ``anchor`` as a server runs it: the document's features before the anchor as context,
    per layer the causality ``rule`` reads from config.json and the window of ``exported``, every slot of
    the block seeing keys less than the window away (flash attention's symmetric window)."""
    block_size, window = exported["block_size"], exported["sliding_window"]
    num_layers = exported["num_hidden_layers"]
    layer_types = exported["layer_types"]
    ctx = drafter.fuse_context(aux[doc_start:anchor])
    context_pos = torch.arange(anchor - doc_start)
    block_pos = anchor - doc_start + torch.arange(block_size)
    ids = torch.full((block_size,), exported["dflash_config"]["mask_token_id"])
    ids[0] = int(served_forward.input_ids[anchor])
    x = drafter.target_head.embed(ids)
    rope = drafter.rope(block_pos, context_pos, x.dtype)
    for i in range(num_layers):
        distance_ctx = block_pos[:, None] - context_pos[None, :]
        distance_blk = block_pos[:, None] - block_pos[None, :]
        context = torch.ones_like(distance_ctx, dtype=torch.bool)
        own = distance_blk >= 0 if rule(exported, i) else torch.ones_like(distance_blk, dtype=torch.bool)
        if layer_types[i] == S:
            context &= distance_ctx < window
            own &= distance_blk.abs() < window
        x = drafter.layers[i](x, ctx, rope, torch.cat([context, own], dim=1))
    return drafter.norm(x)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("layout", ["mixed", "all_sliding"])
@pytest.mark.parametrize("window", [3, 40])  # smaller than the block (bounds its own keys), and larger
@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_served_forward_equals_training_forward(layout, window, fmt):
    # speculators can state only one causality for every layer: bidirectional for the mixed drafter.
    mode = "bidirectional" if (fmt, layout) == ("speculators", "mixed") else "sliding_causal"
    config = draft_config(layout, mode, window=window, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, random_head(config), attention_backend="sdpa").eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    lengths = [37, 60, 23]
    batch = random_batch(lengths, config, seed=1, supervised_fraction=1.0)
    blocks = build_blocks(batch, 12, config.block_size, config.mask_token_id, torch.Generator().manual_seed(0))
    exported = zlab_config(config) if fmt == "zlab" else speculators_config(config, "org/target")
    flat = (
        exported
        if fmt == "zlab"
        else {
            **exported["transformer_layer_config"],
            "block_size": exported["block_size"],
            "dflash_config": {"mask_token_id": exported["mask_token_id"]},
        }
    )
    servers = ZLAB_SERVERS if fmt == "zlab" else SPECULATORS_SERVERS
    served_forward.input_ids = batch.input_ids
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        trained = drafter(batch.aux_hidden, blocks, drafter.prepare(batch, 12, torch.Generator().manual_seed(0))[1])
        checked = 0
        for j in range(blocks.num_blocks):
            if not blocks.valid[j] or blocks.anchors[j] == blocks.doc_start[j]:
                continue  # a server always has context before the anchor
            anchor, start = int(blocks.anchors[j]), int(blocks.doc_start[j])
            end = next(e for e in cu[1:] if e > anchor)
            for name, rule in servers.items():
                layer_rule = lambda cfg, i, r=rule: r(exported, i)  # rules read the whole exported config
                out = served_forward(drafter, flat, layer_rule, batch.aux_hidden, anchor, start, end)
                assert relative(out, trained[j]) < 1e-4, (name, j)
            checked += 1
        assert checked >= 6
        if layout == "mixed" and fmt == "zlab":
            # What a pre-change export got: trained bidirectional, served with the layer-type default.
            bidirectional = draft_config(layout, "bidirectional", window=window, block_size=8)
            drafter.config = bidirectional
            trained_bidirectional = drafter(
                batch.aux_hidden, blocks, drafter.prepare(batch, 12, torch.Generator().manual_seed(0))[1]
            )
            drafter.config = config
            out = served_forward(
                drafter,
                flat,
                lambda cfg, i: vllm_zlab({"layer_types": LAYOUTS[layout]}, i),
                batch.aux_hidden,
                anchor,
                start,
                end,
            )
            assert relative(out, trained_bidirectional[j]) > 1e-2, "the test must see a wrong mask"


# -- checkpoints trained before the setting existed -----------------------------------------------


def legacy_checkpoint(tmp_path: Path, layout: str = "mixed") -> tuple[Path, DFlashDrafter]:
    """A run folder with one checkpoint whose drafter/config.json is as exports were before the setting:
    no in_block_causality and no causality field (every layer was trained bidirectionally)."""
    config = draft_config(layout, "bidirectional")
    drafter = DFlashDrafter(config, random_head(config))
    step = tmp_path / "run" / "checkpoints" / "step-00000008"
    export_zlab(drafter, step / "drafter", dtype=None)
    config_path = step / "drafter" / "config.json"
    old = json.loads(config_path.read_text())
    for key in (CAUSALITY_KEY, "is_causal"):
        old.pop(key, None)
    old["dflash_config"].pop("causal", None)
    config_path.write_text(json.dumps(old))
    (tmp_path / "run" / "config.toml").write_text('[target]\npath = "/models/tiny-target"\n')
    return step, drafter


def test_legacy_checkpoint_loads_bidirectional_and_exports_so(tmp_path):
    step, drafter = legacy_checkpoint(tmp_path)
    head = drafter.target_head
    assert load_drafter(step / "drafter", head, own_checkpoint=True).config.in_block_causality == "bidirectional"
    assert load_drafter(step / "drafter", head).config.in_block_causality == "sliding_causal", (
        "a foreign export with the same config is read by the servers' rule"
    )
    out = export_checkpoint(step, tmp_path / "zlab")
    exported = json.loads((out / "config.json").read_text())
    assert exported["is_causal"] is False and exported["dflash_config"]["causal"] is False
    for rule in ZLAB_SERVERS.values():
        assert served(rule, exported, 3) == [False] * 3
    spec = json.loads((export_checkpoint(step, tmp_path / "spec", "speculators", "org/t") / "config.json").read_text())
    assert spec["sliding_window_non_causal"] is True
    for rule in SPECULATORS_SERVERS.values():
        assert served(rule, spec, 3) == [False] * 3


def test_export_command(tmp_path):
    step, _ = legacy_checkpoint(tmp_path)
    command = [sys.executable, "-m", "trainer.export", "--checkpoint", str(step)]
    done = subprocess.run(
        [*command, "--out", str(tmp_path / "a"), "--format", "speculators"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    spec = json.loads((tmp_path / "a" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny-target", "the run's target.path"
    # A mixed drafter trained with the default causality cannot be written in the speculators format.
    fresh = tmp_path / "fresh" / "checkpoints" / "step-00000001"
    config = draft_config("mixed", "sliding_causal")
    export_zlab(DFlashDrafter(config, random_head(config)), fresh / "drafter", dtype=None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--checkpoint",
            str(fresh),
            "--out",
            str(tmp_path / "b"),
            "--format",
            "speculators",
            "--verifier",
            "org/t",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "speculators format cannot describe" in done.stderr
    assert not (tmp_path / "b").exists()


def test_the_speculators_export_names_a_local_verifiers_architectures(tmp_path):
    """A verifier that is a model folder: its config.json's architectures go into the export (vLLM reads them)."""
    step, _ = legacy_checkpoint(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--checkpoint",
            str(step),
            "--out",
            str(tmp_path / "a"),
            "--format",
            "speculators",
            "--verifier",
            str(target),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    verifier = json.loads((tmp_path / "a" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target), "architectures": ["Qwen3ForCausalLM"]}


def test_the_speculators_export_of_a_gguf_run_names_the_file_not_the_cache(tmp_path):
    """A GGUF target's run holds this machine's dequantized copy as target.path: the export names the GGUF file it
    came from, and the architectures of its model type (a GGUF-loaded config has none)."""
    step, _ = legacy_checkpoint(tmp_path)
    cache = tmp_path / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps({"architectures": None, "model_type": "llama"}))
    (cache / "SOURCE").write_text("/models/SmolLM2-135M-Instruct.Q4_1.gguf\n")
    (tmp_path / "run" / "config.toml").write_text(f'[target]\npath = "{cache}"\n')
    done = subprocess.run(
        [sys.executable, "-m", "trainer.export", "--checkpoint", str(step), "--out", str(tmp_path / "a")]
        + ["--format", "speculators"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    verifier = json.loads((tmp_path / "a" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert verifier["architectures"] == ["LlamaForCausalLM"], verifier

"""Export a checkpoint's drafter for serving (the formats: common/drafter/export.py; GGUF: common/llamacpp.py).

python -m trainer.export --checkpoint RUN/checkpoints/step-N --out DIR [--format zlab|speculators]
python -m trainer.export --checkpoint RUN/checkpoints/step-N --out DIR --format gguf [--target TARGET]

Every export is a folder of its own, the unit to publish: the drafter's files (config.json and model.safetensors, or
draft.gguf) and its model card, README.md, and nothing else; a folder holding anything else (a run's folder, with its
secrets/) is refused. The GGUF draft is llama.cpp's converter's work on the z-lab export, with the target's folder
beside it (its vocabulary goes into the draft); it needs launch/setup_llamacpp.sh. Every export ends by printing the
commands that serve it, with its own block size, and the one that publishes it.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from common.drafter.export import (
    CAUSALITY_KEY,
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportError,
    config_from_export,
    drafter_folder,
    speculators_config,
    write_export,
    zlab_config,
)
from common.drafter.kind import DrafterKind
from common.drafter.kinds import kind_of
from common.gguf import SOURCE_FILE as GGUF_SOURCE_FILE
from common.gguf import GGUFError, dequantized_folder, is_gguf
from common.lifecycle import EXIT_CONFIG_ERROR
from common.llamacpp import DRAFT_FILE as GGUF_FILE
from common.llamacpp import ConversionError, LlamaCppMissing, convert, readable_tokenizer_folder

log = logging.getLogger(__name__)


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    fmt: str = "zlab",
    verifier_name_or_path: str | None = None,
    verifier_architectures: list[str] | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Path:
    """Export the drafter of a checkpoint folder (``checkpoints/step-N``) for serving, without a target.

    The checkpoint's own config is read with ``own_checkpoint=True``, so a checkpoint trained before the
    in-block causality setting existed is exported as what it is: every layer bidirectional.
    """
    source, own_checkpoint = drafter_folder(Path(checkpoint))
    if not own_checkpoint:
        raise FileNotFoundError(f"{checkpoint}: no drafter/{CONFIG_FILE} (expected a checkpoints/step-N folder)")
    config = config_from_export(json.loads((source / CONFIG_FILE).read_text()), own_checkpoint=True)
    weights = load_file(str(source / WEIGHTS_FILE))
    param_dtype = dtype or next(iter(weights.values())).dtype
    if fmt == "zlab":
        config_json = zlab_config(config, param_dtype)
    elif fmt == "speculators":
        if not verifier_name_or_path:
            raise ExportError("--verifier: the speculators format names the target (a hub id or a path)")
        config_json = speculators_config(config, verifier_name_or_path, verifier_architectures, param_dtype)
    else:
        raise ExportError(f"--format: zlab or speculators, got {fmt!r}")
    return write_export(config_json, weights, out_dir, dtype)


GGUF_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
CARD_FILE = "README.md"
EXPORT_FILES = {
    "zlab": {CONFIG_FILE, WEIGHTS_FILE, CARD_FILE},
    "speculators": {CONFIG_FILE, WEIGHTS_FILE, CARD_FILE},
    "gguf": {GGUF_FILE, CARD_FILE},
}
"""What an export's folder holds, by format: all of it is published, so nothing else may be in it."""


def export_folder(out: Path, fmt: str) -> Path:
    """``--out`` as the export's folder, or ExportError where it is not one of its own: a file, a ``.gguf`` name
    (an export is a folder since its card is a file beside the draft), or a folder holding anything but an export of
    this format (a run's folder with its secrets/, a checkout), which ``huggingface-cli upload`` would publish too."""
    if out.suffix == ".gguf":
        raise ExportError(
            f"--out {out}: an export is a folder, the unit you publish ({GGUF_FILE} and its model card {CARD_FILE}); "
            f"give the folder, e.g. --out {out.with_suffix('')}-gguf"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: a file; an export is a folder of its own (the unit you publish)")
    others = [p.name for p in out.iterdir() if p.name not in EXPORT_FILES[fmt]] if out.is_dir() else []
    others.sort(key=lambda name: (name != "secrets", name))  # a run's keys first: the reason above all others
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ExportError(
            f"--out {out} holds {shown}: an export is a folder of its own, the unit you publish, holding only "
            f"{', '.join(sorted(EXPORT_FILES[fmt]))}; give a new folder, e.g. --out {out / 'draft'}"
        )
    return out


def export_gguf(checkpoint: str | Path, out_dir: str | Path, target: str | Path, dtype: torch.dtype) -> Path:
    """The checkpoint's drafter as llama.cpp's draft GGUF, ``out_dir/draft.gguf``: the export in the format the
    converter reads for its kind, converted with the target's folder (a GGUF target's dequantized folder; a tokenizer
    saved by transformers 5 is read through a portable copy). Returns the folder."""
    source, _ = drafter_folder(Path(checkpoint))
    config = config_from_export(json.loads((source / CONFIG_FILE).read_text()), own_checkpoint=True)
    kind = kind_of(config.kind)
    if kind.llamacpp_spec_type is None:
        raise ExportError(f"llama.cpp serves no {kind.name} drafter: export the z-lab format for vLLM or SGLang")
    refusal = kind.llamacpp_refusal(config) if kind.llamacpp_refusal is not None else None
    if refusal is not None:
        raise ExportError(refusal)
    target_dir = dequantized_folder(target) if is_gguf(target) else Path(target)
    if not (target_dir / "config.json").is_file():
        raise ExportError(f"--target: {target} is no model folder (no config.json) nor a .gguf file")
    with tempfile.TemporaryDirectory(prefix="export-gguf-") as scratch:
        # the format whose config keys and tensor names the converter maps for this kind
        source_format = kind.llamacpp_format
        verifier = str(target_dir) if source_format == "speculators" else None
        draft = export_checkpoint(checkpoint, Path(scratch) / source_format, source_format, verifier, dtype=dtype)
        readable = readable_tokenizer_folder(target_dir, Path(scratch) / "target")
        convert(draft, Path(out_dir) / GGUF_FILE, GGUF_TYPES[dtype], target_dir=readable)
    return Path(out_dir)


LLAMA_SERVER = ".llamacpp/build/bin/llama-server"
"""Where launch/setup_llamacpp.sh builds llama.cpp's server (the printed commands run from the repository root)."""
LLAMA_SERVER_PORT = 8080
"""The port of the printed llama-server line: README step 7 measures it at http://localhost:8080."""


def serving_commands(out: Path, fmt: str, kind: DrafterKind, block_size: int, target: str | None) -> list[str]:
    """The commands that serve this export (its folder), with its block size (vLLM's num_speculative_tokens is
    B - 1, SGLang's num-draft-tokens is B, llama.cpp's draft length B - 1: a DFlash 2 drafter served with another
    misplaces its convolutions without an error), for the servers that serve its kind.

    llama.cpp serves a target given as a GGUF file as that file: the drafter learned the hidden states of its
    dequantized weights, which are the file's own values, and it is what a llama.cpp user runs. A target folder is
    converted first (bf16, beside the export's folder). llama-server listens where README step 7 measures it and
    serves the counters that measurement reads (``--metrics``)."""
    target = target or "TARGET"
    if fmt == "gguf":
        serve = (
            f"-md {shlex.quote(str(out / GGUF_FILE))} --spec-type {kind.llamacpp_spec_type} "
            f"--spec-draft-n-max {block_size - 1} --port {LLAMA_SERVER_PORT} --metrics"
        )
        if is_gguf(target):
            return [f"{LLAMA_SERVER} -m {shlex.quote(target)} {serve}"]
        target_file = shlex.quote(str(out.parent / "target.gguf"))
        return [  # the target as a GGUF first, by the same converter
            f"PYTHONPATH=.llamacpp/llama.cpp/gguf-py .llamacpp/venv/bin/python .llamacpp/llama.cpp/convert_hf_to_gguf.py "
            f"{shlex.quote(target)} --outfile {target_file} --outtype bf16",
            f"{LLAMA_SERVER} -m {target_file} {serve}",
        ]
    if fmt == "speculators":
        return [f"vllm serve {out}"]
    if is_gguf(target) and Path(target).is_file():
        target = str(dequantized_folder(target))  # vLLM and SGLang load the target as the folder training read
    commands = []
    if kind.vllm_method is not None:
        speculative = {"method": kind.vllm_method, "model": str(out), "num_speculative_tokens": block_size - 1}
        commands.append(f"vllm serve {target} --speculative-config '{json.dumps(speculative)}'")
    if kind.sglang_algorithm is not None:
        commands.append(
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {kind.sglang_algorithm} "
            f"--speculative-draft-model-path {out} --speculative-num-draft-tokens {block_size}"
        )
    return commands


def upload_command(out: Path) -> str:
    """The command that publishes the export: its folder, nothing beside it."""
    return f"huggingface-cli upload ORG/NAME {shlex.quote(str(out))}"


def model_card(checkpoint: Path, out: Path, fmt: str, commands: list[str], target: str | None) -> str:
    """The export's model card: what the drafter is, what it was trained on and for how long, the real acceptance
    its run measured at this step (both conventions, on the run's held-out prompts), and the commands that serve it."""
    import tomllib

    from common.acceptance import records
    from common.rundir import RunDir, read_json

    source, _ = drafter_folder(checkpoint)
    config = config_from_export(json.loads((source / CONFIG_FILE).read_text()), own_checkpoint=True)
    run_root = checkpoint.resolve().parent.parent
    step = (read_json(checkpoint / "trainer_state.json") or {}).get("step")
    settings = tomllib.loads((run_root / "config.toml").read_text()) if (run_root / "config.toml").is_file() else {}
    data = settings.get("data", {})
    found = records.finished_at(RunDir(run_root), step) if step is not None else None
    if found is not None:
        metrics = found.metrics
        acceptance = (
            f"tau {metrics.get('eval/tau', float('nan')):.3f} (1 + accepted drafts per verify forward), "
            f"{metrics.get('eval/zlab_tau', float('nan')):.3f} as z-lab's benchmark counts it (each prompt's mean "
            f"tokens per verify forward, then the mean), on the run's held-out prompts, greedy, measured by the run "
            f"at this step"
        )
    else:
        acceptance = "not measured at this step: `launch/run_all.sh evaluate --checkpoint CHECKPOINT`"
    lines = [
        f"# A {config.kind} speculative-decoding drafter for {target or 'its target'}",
        "",
        "Trained by dflash-stream.",
        "",
        "| | |",
        "|---|---|",
        f"| format | {fmt} |",
        f"| target | {target or 'not named'} |",
        f"| block size | {config.block_size} (serve it with this block size) |",
        f"| draft layers | {config.num_hidden_layers} x hidden {config.hidden_size}, over target layers "
        f"{list(config.target_layer_ids)} |",
        f"| mask token | {config.mask_token_id} |",
        f"| in-block causality | {config.in_block_causality} |",
        f"| data | {data.get('format', 'synthetic')}: {', '.join(map(str, data.get('paths', []))) or 'generated'} |",
        f"| steps | {step if step is not None else 'unknown'} |",
        f"| real acceptance | {acceptance} |",
        "",
        "Serve it:",
        "",
        "```bash",
        *commands,
        "```",
        "",
        f"To publish it (nothing here reaches the hub by itself): `{upload_command(out)}`.",
        "",
    ]
    return "\n".join(lines)


def _target_of_run(checkpoint: Path) -> str | None:
    """The run's ``target.path`` (RUN/config.toml beside RUN/checkpoints/step-N), if it names one."""
    import tomllib

    config = checkpoint.resolve().parent.parent / "config.toml"
    if not config.is_file():
        return None
    return tomllib.loads(config.read_text()).get("target", {}).get("path") or None


def _verifier_name(target: str | None) -> str | None:
    """The target as the export names it: for a GGUF target the file the user gave, not this machine's dequantized
    copy of it (common/gguf.py)."""
    source = Path(target) / GGUF_SOURCE_FILE if target else None
    return source.read_text().strip() if source is not None and source.is_file() else target


def _architectures_of(verifier: str | None) -> list[str] | None:
    """The target's ``architectures`` when the verifier is on this machine: a model folder's config.json, or a GGUF
    file's dequantized folder's; a config without them is named by its model_type's causal-LM class."""
    if not verifier or not Path(verifier).exists():
        return None
    folder = dequantized_folder(verifier) if is_gguf(verifier) else Path(verifier)
    config = folder / "config.json"
    if not config.is_file():
        return None
    settings = json.loads(config.read_text())
    if settings.get("architectures"):
        return list(settings["architectures"])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(settings.get("model_type"))
    return [causal_lm] if causal_lm else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoints/step-N")
    parser.add_argument("--out", required=True, type=Path, help="the export's own folder (the unit to publish)")
    parser.add_argument("--format", default="zlab", choices=["zlab", "speculators", "gguf"])
    parser.add_argument("--verifier", help="speculators: the target's hub id or path (default: the run's target.path)")
    parser.add_argument(
        "--target", help="gguf: the target's folder or .gguf file, whose vocabulary goes in (default: the run's)"
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_target = _target_of_run(args.checkpoint)
    target = args.verifier or (run_target if args.format == "speculators" else None)
    dtype = getattr(torch, args.dtype)
    try:
        out = export_folder(args.out, args.format)
        if args.format == "gguf":
            if not (args.target or run_target):
                raise ExportError("--target: the run names no target.path; give the target's folder or .gguf file")
            export_gguf(args.checkpoint, out, args.target or run_target, dtype)
            log.info("wrote %s (llama.cpp draft GGUF, %s)", out / GGUF_FILE, GGUF_TYPES[dtype])
        else:
            export_checkpoint(
                args.checkpoint, out, args.format, _verifier_name(target), _architectures_of(target), dtype=dtype
            )
            config = json.loads((out / CONFIG_FILE).read_text())
            log.info("wrote %s (%s format, in-block causality %s)", out, args.format, config[CAUSALITY_KEY])
    except (ExportError, FileNotFoundError, GGUFError, ConversionError, LlamaCppMissing) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    source, own = drafter_folder(args.checkpoint)
    drafter = config_from_export(json.loads((source / CONFIG_FILE).read_text()), own)
    block_size = drafter.block_size
    served_target = _verifier_name(args.target or run_target)
    commands = serving_commands(out, args.format, kind_of(drafter.kind), block_size, served_target)
    card = out / CARD_FILE
    card.write_text(model_card(args.checkpoint, out, args.format, commands, served_target))
    print(f"serve it (block size {block_size}; the model card: {card}):")
    for command in commands:
        print(f"  {command}")
    print(f"publish it (the folder {out}, nothing beside it):\n  {upload_command(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export a checkpoint's drafter for serving, without a target (the formats: common/drafter/export.py).

python -m trainer.export --checkpoint RUN/checkpoints/step-N --out DIR [--format zlab|speculators]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
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
from common.gguf import SOURCE_FILE as GGUF_SOURCE_FILE
from common.gguf import dequantized_folder, is_gguf
from common.lifecycle import EXIT_CONFIG_ERROR

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
    parser.add_argument("--out", required=True, type=Path, help="folder to write the export into")
    parser.add_argument("--format", default="zlab", choices=["zlab", "speculators"])
    parser.add_argument("--verifier", help="speculators: the target's hub id or path (default: the run's target.path)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target = args.verifier or (_target_of_run(args.checkpoint) if args.format == "speculators" else None)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            args.format,
            _verifier_name(target),
            _architectures_of(target),
            dtype=getattr(torch, args.dtype),
        )
    except (ExportError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    config = json.loads((out / CONFIG_FILE).read_text())
    log.info("wrote %s (%s format, in-block causality %s)", out, args.format, config[CAUSALITY_KEY])
    return 0


if __name__ == "__main__":
    sys.exit(main())

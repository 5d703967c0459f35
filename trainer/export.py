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


def _verifier_of_run(checkpoint: Path) -> str | None:
    """The run's ``target.path`` (RUN/config.toml beside RUN/checkpoints/step-N), if there is one."""
    import tomllib

    config = checkpoint.resolve().parent.parent / "config.toml"
    if not config.is_file():
        return None
    return tomllib.loads(config.read_text()).get("target", {}).get("path") or None


def _architectures_of(verifier: str | None) -> list[str] | None:
    """The target's ``architectures`` from its config.json, when the verifier is a local model folder."""
    config = Path(verifier) / "config.json" if verifier else None
    if config is None or not config.is_file():
        return None
    return list(json.loads(config.read_text()).get("architectures") or []) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, type=Path, help="RUN/checkpoints/step-N")
    parser.add_argument("--out", required=True, type=Path, help="folder to write the export into")
    parser.add_argument("--format", default="zlab", choices=["zlab", "speculators"])
    parser.add_argument("--verifier", help="speculators: the target's hub id or path (default: the run's target.path)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    verifier = args.verifier or (_verifier_of_run(args.checkpoint) if args.format == "speculators" else None)
    try:
        out = export_checkpoint(
            args.checkpoint,
            args.out,
            args.format,
            verifier,
            _architectures_of(verifier),
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

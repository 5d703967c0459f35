"""llama.cpp as this project uses it: its GGUF converter (drafts and targets) and its server binary.

``launch/setup_llamacpp.sh`` builds both into ``.llamacpp/`` at the repository root (or wherever ``DFLASH_LLAMACPP``
points): the sources vendored in PyPI's llama-cpp-python sdist, ``build/bin/llama-server``, and ``venv/``, the
converter's own python (transformers 4.x, which the project's .venv does not run). Nothing here imports llama.cpp:
the converter runs as a subprocess in that venv.

A draft GGUF is converted from this project's z-lab export with the target's folder beside it (the converter takes
the vocabulary and the target's sizes from there); a target GGUF from the target's Hugging Face folder. Targets are
converted once into the project's cache (common/gguf.py), keyed by the weights' content.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common.gguf import cache_root, content_key, portable_tokenizer_config

HOME_ENV = "DFLASH_LLAMACPP"
"""Environment variable naming the llama.cpp folder (default ``.llamacpp`` at the repository root)."""

SETUP = "launch/setup_llamacpp.sh"
DRAFT_FILE = "draft.gguf"
"""The draft's file in a GGUF export's folder (trainer/export.py): the folder is the unit, its card beside the file."""
OUTTYPES = ("f32", "f16", "bf16")
"""Float GGUF types the converter writes that this project checks (quantized drafts are the server's business)."""


class LlamaCppMissing(RuntimeError):
    """llama.cpp is not set up on this machine: the message says what to run."""


class ConversionError(RuntimeError):
    """llama.cpp's converter refused a folder: the same on every try (the message is its last error line)."""


def home() -> Path:
    default = Path(__file__).resolve().parents[1] / ".llamacpp"
    return Path(os.environ.get(HOME_ENV) or default)


def server_binary() -> Path:
    """``llama-server`` (LlamaCppMissing when it was never built)."""
    binary = home() / "build" / "bin" / "llama-server"
    if not binary.is_file():
        raise LlamaCppMissing(f"no llama-server at {binary}: run {SETUP} (builds it once, about ten minutes)")
    return binary


def converter_ready() -> None:
    """LlamaCppMissing unless the converter and its python are set up."""
    _converter()


def _converter() -> tuple[Path, Path, dict[str, str]]:
    """(the converter's python, convert_hf_to_gguf.py, its environment)."""
    python, script = home() / "venv" / "bin" / "python", home() / "llama.cpp" / "convert_hf_to_gguf.py"
    if not python.is_file() or not script.is_file():
        raise LlamaCppMissing(f"no llama.cpp converter under {home()}: run {SETUP}")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {
        "PYTHONPATH": str(home() / "llama.cpp" / "gguf-py"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return python, script, env


def convert(
    model_dir: Path, out_file: Path, outtype: str = "f32", target_dir: Path | None = None, timeout_s: float = 1800
) -> Path:
    """Convert a Hugging Face folder into ``out_file`` with llama.cpp's converter; a draft names its target's folder
    (``target_dir``). Written under a temporary name and renamed, so a killed conversion leaves no half file."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    python, script, env = _converter()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(f".{out_file.name}.{os.getpid()}.partial")
    command = [str(python), str(script), str(model_dir), "--outfile", str(partial), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        output = (done.stdout + done.stderr).strip().splitlines()
        reason = next((line for line in reversed(output) if "Error" in line or "error" in line), output[-1:] or [""])
        raise ConversionError(f"llama.cpp's converter refused {model_dir}: {str(reason).strip()}")
    os.replace(partial, out_file)
    return out_file


def target_gguf(target_dir: Path, outtype: str = "f32") -> Path:
    """The target folder as a GGUF file for llama-server, converted once into the cache (keyed by its weights)."""
    weights = sorted(Path(target_dir).glob("*.safetensors"))
    if not weights:
        raise ConversionError(f"{target_dir}: no safetensors weights to convert")
    key = content_key(weights[0]) if len(weights) == 1 else content_key(Path(target_dir) / "config.json")
    out = cache_root() / "llamacpp" / f"{Path(target_dir).name}-{key}-{outtype}.gguf"
    if not out.is_file():
        with tempfile.TemporaryDirectory(prefix="target-gguf-") as scratch:
            convert(readable_tokenizer_folder(Path(target_dir), Path(scratch)), out, outtype)
    return out


def readable_tokenizer_folder(target_dir: Path, scratch: Path) -> Path:
    """``target_dir`` itself when transformers 4.x reads its tokenizer, else a copy in ``scratch`` that it reads
    (``common.gguf.portable_tokenizer_config``; the weights linked, not copied): a user's folder saved by
    transformers 5 is left as it is."""
    config_file = Path(target_dir) / "tokenizer_config.json"
    if not config_file.is_file() or json.loads(config_file.read_text()).get("tokenizer_class") != "TokenizersBackend":
        return Path(target_dir)
    copy = Path(scratch) / Path(target_dir).name
    copy.mkdir(parents=True, exist_ok=True)
    for item in Path(target_dir).iterdir():
        if item.suffix == ".safetensors":
            (copy / item.name).symlink_to(item.resolve())
        elif item.is_file():
            shutil.copy2(item, copy / item.name)
    portable_tokenizer_config(copy)
    return copy

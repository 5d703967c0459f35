#!/usr/bin/env bash
# Set up ./.speculators (idempotent): speculators 0.9.0, the reference DSpark implementation that
# tests/test_dspark_reference.py compares our DSpark drafter with (pytest -m reference). Its own folder, appended to
# the tests' path after the project's .venv, because importing speculators pulls in openai and datasets (pyarrow,
# pandas: ~300 MB) and would change the venv's fsspec; the packages the venv has (torch, transformers) are its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "run launch/setup.sh first (the project's .venv)" >&2; exit 2; }
if [ ! -d .speculators/speculators ]; then
  "$PY" -m pip install -q --target .speculators --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  "$PY" -m pip install -q --target .speculators "loguru>=0.7.2,<=0.7.3" "openai>=2.0.0" "datasets>=4.0.0,<=5.1.0"
fi
PYTHONPATH= "$PY" -c "import sys; sys.path.append('.speculators'); import speculators.models.dspark; print('speculators', speculators.models.dspark.__file__)"

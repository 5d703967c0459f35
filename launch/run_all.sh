#!/usr/bin/env bash
# Start, resume, re-tune, stop or inspect a run (DESIGN.md "User surface").
#
#   launch/run_all.sh [--run-dir DIR] [--config FILE] [key=value ...]   start (or resume DIR) in the foreground
#   launch/run_all.sh restart-trainer --run-dir DIR [key=value ...]     replace the trainer, producers untouched
#   launch/run_all.sh stop --run-dir DIR                                stop the run cleanly
#   launch/run_all.sh status --run-dir DIR [--json]                     the live state
#
# With no arguments: launch/tiny.toml into a fresh runs/<timestamp> (relative to the current folder).
# On an existing DIR the run's own config.toml is the base; key=value overrides apply on top and are
# saved; --config is then refused unless it resolves to the same config.
# Everything else (devices, CUDA detection, restarts) is in launch/supervisor.py.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${DFLASH_PYTHON:-}" ]; then
  PY="$DFLASH_PYTHON"  # an interpreter chosen by the caller (tests use their own)
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  run | restart-trainer | stop | status) COMMAND=$1; shift ;;
  *) COMMAND=run ;;
esac
# exec: the supervisor gets Ctrl-C and `stop`'s SIGTERM directly.
exec "$PY" -m launch.supervisor "$COMMAND" "$@"

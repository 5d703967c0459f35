#!/usr/bin/env bash
# Start, resume, re-tune, stop or inspect a run, and evaluate or export its drafter (README.md).
#
#   launch/run_all.sh [--run-dir DIR] [--config FILE] [key=value ...]   start (or resume DIR) in the foreground
#   launch/run_all.sh restart-trainer --run-dir DIR [key=value ...]     replace the trainer, producers untouched
#   launch/run_all.sh stop --run-dir DIR                                stop the run cleanly
#   launch/run_all.sh status --run-dir DIR [--json]                     the live state
#   launch/run_all.sh check [--config FILE] [key=value ...]              what training would see of the data
#   launch/run_all.sh synthesize [--run-dir DIR] [key=value ...]         the target writes on-policy training data
#   launch/run_all.sh evaluate --checkpoint RUN/checkpoints/step-N       real acceptance of a checkpoint (launch.evaluate)
#   launch/run_all.sh export --checkpoint CKPT --out DIR [--format F]    the drafter for serving (trainer.export)
#
# With no arguments: launch/tiny.toml into a fresh runs/<timestamp> (relative to the current folder).
# On an existing DIR the run's own config.toml is the base; key=value overrides apply on top and are
# saved; --config is then refused unless it resolves to the same config.
# Everything else (devices, CUDA detection, restarts) is in launch/supervisor.py (its command line: launch/commands.py).
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
  check) shift; exec "$PY" -m launch.check "$@" ;;
  synthesize) shift; exec "$PY" -m launch.synthesize "$@" ;;
  evaluate) shift; exec "$PY" -m launch.evaluate "$@" ;;
  export) shift; exec "$PY" -m trainer.export "$@" ;;
  -h | --help | help)
    cat <<'USAGE'
usage: launch/run_all.sh [COMMAND] [options] [key=value ...]

commands:
  run (default)    start a run, or resume --run-dir DIR, in the foreground   [--run-dir DIR] [--config FILE]
  restart-trainer  replace the trainer of a running pipeline                 --run-dir DIR [key=value ...]
  stop             stop a running pipeline cleanly                          --run-dir DIR
  status           the live state of a pipeline                             --run-dir DIR [--json]
  check            what training would see of the config and the data        [--config FILE] [--sample N]
  synthesize       the target writes training data (its own answers)        [--run-dir DIR] [--config FILE]
  evaluate         real acceptance of a checkpoint against the target       --checkpoint RUN/checkpoints/step-N
  export           the drafter for serving (z-lab, speculators, gguf)       --checkpoint CKPT --out DIR [--format F]

With no arguments: the tiny default (launch/tiny.toml) on CPU into runs/<timestamp>.
'run_all.sh COMMAND --help' gives the options of one command.
USAGE
    exit 0 ;;
  *) COMMAND=run ;;
esac
# exec: the supervisor gets Ctrl-C and `stop`'s SIGTERM directly.
exec "$PY" -m launch.commands "$COMMAND" "$@"

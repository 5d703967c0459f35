"""The launcher's command line (``launch/run_all.sh`` runs it):

python -m launch.commands run [--run-dir DIR] [--config FILE] [key=value ...]
python -m launch.commands restart-trainer --run-dir DIR [key=value ...]
python -m launch.commands stop --run-dir DIR
python -m launch.commands status --run-dir DIR [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.lifecycle import EXIT_CONFIG_ERROR
from launch import status as status_cmd
from launch.supervisor import request_trainer_restart, run_supervisor, stop_run

COMMANDS = ("run", "restart-trainer", "stop", "status")


def _command_parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"launch/run_all.sh {command}")
    if command == "run":
        parser.description = "Start (or resume) a run in the foreground."
        parser.add_argument(
            "--run-dir", type=Path, help="run directory (default: a fresh runs/<timestamp>); an existing one is resumed"
        )
        parser.add_argument("--config", type=Path, help="TOML config of a new run (default: launch/tiny.toml)")
    else:
        parser.add_argument("--run-dir", type=Path, required=True)
    if command in ("run", "restart-trainer"):
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. training.lr=3e-4")
    if command == "restart-trainer":
        parser.description = (
            "Replace the trainer of a running pipeline (only training.*, logging.* and launcher-only keys may change)."
        )
    if command == "stop":
        parser.description = "Stop a running pipeline cleanly and wait for it."
    if command == "status":
        parser.description = "Show the live state of a pipeline."
        parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m launch.commands {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    command = argv[0]
    # Intermixed: overrides may come before or after --run-dir.
    args = _command_parser(command).parse_intermixed_args(argv[1:])
    if command == "run":
        return run_supervisor(args.run_dir, args.config, args.overrides)
    if command == "restart-trainer":
        return request_trainer_restart(args.run_dir, args.overrides)
    if command == "stop":
        return stop_run(args.run_dir)
    return status_cmd.show_status(args.run_dir, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())

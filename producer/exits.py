"""How a producer process starts and ends: its command line, its keys and its tensor-parallel group, then the loop
of rank 0 (``start``: producer/server.py ``Producer``) or a follower rank's forwards, to an exit code whichever way
it ends.

0 when it stopped (SIGTERM or Ctrl-C: the fill in flight finishes, the ring is closed), EXIT_CONFIG_ERROR for what
fails the same on every try: a configuration or keys it cannot start with, a target that does not load, a ring that
does not fit, data with no good document in an epoch or a regeneration cache too large.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from common.config import ConfigError, RunConfig
from common.lifecycle import EXIT_CONFIG_ERROR, start_role, stop_on_signals
from common.ring import RingMemoryError
from common.rundir import RunDir
from common.sockets import CurveKeys, SecretsError
from producer.build import device_setting, load_target
from producer.data.files import DataError
from producer.target_model.follower import follow
from producer.target_model.tensor_parallel import TensorParallelGroup, split_devices

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where a producer runs and whom it serves."""

    producer_id: int
    device: str | None = None
    """--device: overrides target.device; several, comma-separated, under torchrun: tensor parallel."""
    listen: str | None = None
    """--listen: the tcp endpoint it serves consumers on other hosts at; None: an ipc socket in the run directory."""
    curve: CurveKeys | None = None
    """The run's CURVE keys, with ``listen``."""
    group: TensorParallelGroup | None = None
    """Its tensor-parallel group, over several devices."""


class Serving(Protocol):
    """What of a producer its process's end reads (producer/server.py ``Producer``)."""

    def serve_forever(self) -> None: ...

    def request_stop(self) -> None: ...


def remote_keys(cfg: RunConfig, run_dir: RunDir, producer_id: int, listen: str) -> CurveKeys:
    """The run's CURVE keys for a producer serving other hosts on ``listen``; ConfigError says what
    is wrong (not tcp, an id launch.remote_producers does not give, a GPU ring, missing keys)."""
    if not listen.startswith("tcp://"):
        raise ConfigError(
            f"--listen {listen}: must be a tcp:// endpoint (producers on the trainer's host need no --listen)"
        )
    remote = cfg.launch.remote_producer_ids()
    if producer_id not in remote:
        raise ConfigError(
            f"--producer-id {producer_id}: a producer started with --listen must be one of launch.remote_producers, "
            f"whose ids follow the {cfg.launch.local_producers} local ones: {sorted(remote) or 'none listed'}"
        )
    if cfg.ring.backend == "cuda":
        raise ConfigError(
            "ring.backend: a producer serving other hosts (--listen) sends from host memory: use host or auto, not cuda"
        )
    try:
        return CurveKeys.load(run_dir.curve_keys)
    except SecretsError as exc:
        raise ConfigError(
            f"{exc}. Copy the run's secrets/curve.json from the trainer's host into {run_dir.root}/secrets/ "
            "(mode 0600, folder 0700)."
        ) from None


Start = Callable[[RunConfig, RunDir, Placement], Serving]


def run_producer(argv: list[str] | None, start: Start) -> int:
    """The process of producer ``--producer-id`` (of one rank of it, under torchrun) from its command line."""
    parser = argparse.ArgumentParser(description="DFlash producer: one target, one ring, one data shard.")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--producer-id", type=int, required=True)
    parser.add_argument(
        "--device",
        default=None,
        help="overrides target.device for this producer; several, comma-separated, under torchrun: tensor parallel",
    )
    parser.add_argument(
        "--listen",
        default=None,
        metavar="tcp://ADDRESS:PORT",
        help="serve consumers on other hosts here (a producer of launch.remote_producers)",
    )
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    name = f"producer-{args.producer_id}" + (f".r{rank}" if rank else "")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    return run_to_exit(args.run_dir, args.producer_id, args.device, args.listen, start)


def run_to_exit(run_dir: str | Path, producer_id: int, device: str | None, listen: str | None, start: Start) -> int:
    """Entry point of a producer process (of each rank of a tensor-parallel one); returns its exit code."""
    group = None
    try:
        root, cfg = start_role(run_dir)
        curve = remote_keys(cfg, root, producer_id, listen) if listen else None
        devices = split_devices(device) if device else []
        if len(devices) > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
            group = TensorParallelGroup.join(devices, device_setting(cfg, producer_id))
    except ConfigError as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    placement = Placement(producer_id, device, listen, curve, group)
    try:
        if group is not None and group.rank > 0:
            return run_follower(cfg, root, placement)
        return serve(cfg, root, placement, start)
    finally:
        if group is not None:
            group.stop_followers()
            group.close()


def serve(cfg: RunConfig, root: RunDir, placement: Placement, start: Start) -> int:
    """Run the producer ``start`` makes until SIGTERM / SIGINT; the exit code."""
    try:
        producer = start(cfg, root, placement)
    except (ConfigError, RingMemoryError, ValueError) as exc:
        log.error("cannot start producer %d: %s", placement.producer_id, exc)
        return EXIT_CONFIG_ERROR

    def request_stop(signum: int) -> None:
        log.info("signal %d: stopping", signum)
        producer.request_stop()

    stop_on_signals(request_stop)
    try:
        producer.serve_forever()
    except (DataError, ConfigError) as exc:  # found while producing (an epoch without a good document, a
        log.error("producer %d: %s", placement.producer_id, exc)  # regeneration cache too large): the same every try
        return EXIT_CONFIG_ERROR
    log.info("producer %d stopped cleanly", placement.producer_id)
    return 0


def run_follower(cfg: RunConfig, root: RunDir, placement: Placement) -> int:
    """A rank > 0 of a tensor-parallel producer: load this rank's shards, then run rank 0's forwards."""
    group = placement.group
    try:
        target = load_target(cfg, root, placement.producer_id, group.device, group)
    except (ConfigError, ValueError) as exc:
        log.error("cannot start producer %d rank %d: %s", placement.producer_id, group.rank, exc)
        return EXIT_CONFIG_ERROR
    log.info(
        "producer %d rank %d of %d ready on %s (%s): following rank 0",
        placement.producer_id,
        group.rank,
        group.size,
        group.devices[group.rank],
        target.identity,
    )
    return follow(group, target)

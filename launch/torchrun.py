"""torchrun for tensor-parallel producers and multi-rank trainers: ``python -m launch.torchrun [torchrun arguments]``.

The same as ``python -m torch.distributed.run``, except for the exit code when a rank exits 2 (a
configuration error: a degree that does not divide the target's heads, a missing data file, ...).
torchrun exits 1 for any failed rank, which the launcher takes for a crash and retries with backoff
until launch.max_restarts; this exits 2, so the launcher stops the run at once and shows the error,
as it does for a producer or trainer on one device.

The launcher starts it with ``--standalone`` (launch/processes.py): a trainer's ranks, like a tensor-parallel
producer's, are GPUs of one node; a trainer spread over several nodes is not supported (docs/operations.md
"Multi-host").
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

from common.lifecycle import EXIT_CONFIG_ERROR


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv``; 0 when every rank succeeded, 2 when one reported a configuration
    error, 128 + N after signal N (torchrun has then stopped its ranks), else 1."""
    try:
        torchrun(argv)
    except ChildFailedError as exc:
        exit_codes = {failure.exitcode for failure in exc.failures.values()}
        return EXIT_CONFIG_ERROR if EXIT_CONFIG_ERROR in exit_codes else 1
    except SignalException as exc:  # a stop, not a failure: no traceback in the log
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What every benchmark program needs: device synchronisation and the measured matmul ceiling."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, size: int, dtype: torch.dtype = torch.bfloat16, repeats: int = 20) -> float:
    """Measured dense ``size``^3 matmul rate in TFLOP/s: the MFU denominator (random data, never zeros)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12

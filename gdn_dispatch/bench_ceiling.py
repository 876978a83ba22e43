"""The two ceilings of the speed-of-light bound, measured on the device being benched: the
device-to-device copy bandwidth and the bf16 matmul rate (CUDA events; needs a GPU).
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

COPY_BYTES = 1 << 30
MATMUL_N = 8192
CEILING_ITERS = 10


def median_event_ms(fn: Callable[[], object], iters: int = CEILING_ITERS, warmup: int = 3) -> float:
    """Median CUDA-event ms of ``fn()`` over ``iters`` calls after ``warmup`` (one input)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def measure_copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_event_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_rate(device: torch.device, n: int = MATMUL_N) -> float:
    """bf16 ``n^3`` torch.matmul rate in FLOP/s, on random data (zeros would run cooler)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = median_event_ms(lambda: torch.matmul(a, b))
    del a, b
    return 2 * n ** 3 / (ms * 1e-3)

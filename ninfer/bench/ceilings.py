"""The two ceilings a speed-of-light ratio divides by, measured on the device in the same run:
device-copy bandwidth (bytes read plus bytes written per second) and the matmul rate.

On CUDA the timing is Triton's `do_bench` (CUDA events, median; CUDA events when Triton is
absent); on the CPU a median of host-clock runs, with sizes small enough for a CI machine."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CUDA_COPY_ELEMENTS = 2**29  # fp32: 2 GiB each way, many times the L2
CPU_COPY_ELEMENTS = 2**23  # 32 MiB
CUDA_MATMUL_SIZE = 8192
CPU_MATMUL_SIZE = 512


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 20) -> float:
    """Median time of `fn` after warm-up runs."""
    if device.type == "cuda":
        try:
            from triton.testing import do_bench

            return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
        except ImportError:
            return _cuda_event_median(fn, repeats)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_event_median(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str, elements: int | None = None) -> float:
    """Bytes read plus bytes written per second by a large device-to-device copy (plain launches:
    inside a CUDA graph a copy becomes a copy-engine node, which is slower than the SMs)."""
    device = torch.device(device)
    if elements is None:
        elements = CUDA_COPY_ELEMENTS if device.type == "cuda" else CPU_COPY_ELEMENTS
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / seconds


def matmul_rate(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, size: int | None = None
) -> float:
    """FLOP/s of a square matmul on random data (2 n^3 FLOPs), in `dtype`."""
    device = torch.device(device)
    if size is None:
        size = CUDA_MATMUL_SIZE if device.type == "cuda" else CPU_MATMUL_SIZE
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), device)
    return 2.0 * size**3 / seconds

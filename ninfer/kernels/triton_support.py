"""Whether the Triton kernels can run: Triton importable and the tensors on a CUDA device.
The CPU build of torch ships without Triton, so everything here must import without it."""

from __future__ import annotations

import functools
import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    return HAS_TRITON and all(t.is_cuda for t in tensors)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter on CPU: any small number keeps grids tiny
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def device_name(device: torch.device) -> str:
    """The CUDA device's name, which per-device tuned settings are keyed by."""
    return torch.cuda.get_device_name(device)

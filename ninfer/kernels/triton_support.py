"""Whether the Triton kernels can run: Triton importable and the tensors on a CUDA device;
the device facts the kernels size their grids by; and how many programs of a compiled kernel
a Hopper SM holds (`programs_per_sm`). The CPU build of torch ships without Triton, so
everything here must import without it."""

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


# Hopper (sm_90) residency limits: shared memory an SM gives its programs, and what the
# hardware keeps per program besides; registers an SM, given to a warp 256 at a time; warps
# and programs an SM.
SM90_SHARED, SM90_SHARED_RESERVED = 228 * 1024, 1024
SM90_REGISTERS, SM90_REGISTER_UNIT, SM90_WARPS, SM90_PROGRAMS = 65536, 256, 64, 32


def programs_per_sm(shared: int, registers: int, warps: int) -> tuple[int, str]:
    """How many programs of a kernel an sm_90 SM holds at once, and what bounds it (`shared
    memory`, `registers`, `warps` or `programs`): the driver's occupancy rule for a program of
    `warps` warps taking `shared` bytes of shared memory and `registers` registers a thread.
    A Gluon product of 76,824 bytes fits two, not three (docs/performance.md, Measurement 29).
    `tools/gpu/compile_check.py --sass` prints it for each kernel."""
    per_warp = -(-registers * 32 // SM90_REGISTER_UNIT) * SM90_REGISTER_UNIT
    limits = {"shared memory": SM90_SHARED // (shared + SM90_SHARED_RESERVED)}
    if per_warp:
        limits["registers"] = SM90_REGISTERS // (per_warp * warps)
    limits |= {"warps": SM90_WARPS // warps, "programs": SM90_PROGRAMS}
    bound = min(limits, key=limits.get)  # of equal limits, the first named
    return limits[bound], bound

"""Programmatic dependent launch (Hopper and later) for our Triton kernels.

A decode step is about a thousand small kernels, and between two of them the GPU idles while
the next grid is launched and its programs are placed (about 0.7 us per kernel in the decode
profiles, docs/performance.md). Launched with PDL, a kernel's programs are placed while the
kernel before it still runs, and wait on the device until it has finished.

The contract, kept by every kernel of ours: its first statement is `await_inputs(PDL)`, before
any load, store or early return, so that no program reads what the kernel before it writes
(or writes what it reads) too soon. Waiting first in every program also keeps the order
transitive: a kernel ends only after its own predecessor has, so kernels further back have
finished too. Kernels of other libraries (torch, cuBLAS, fla) are launched without the
attribute and keep the stream's full ordering on both sides.

Read before the wait: since a kernel lets its dependents be placed only after every one of
its programs has waited, a program that has not yet waited may already read what kernels two
or more back in the stream wrote (they have all finished), though not what the kernel just
before it writes. The kernels in `READ_BEFORE_WAIT` do that with loads whose memory round trip
would otherwise follow the previous kernel's end; they store nothing before the wait and read
such memory through L2 (an SM's L1 may hold what it read before the last write).

`NINFER_PDL=0` launches every kernel without it (for A/B timing and debugging)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Kernels that load before `await_inputs`, and what.
READ_BEFORE_WAIT = {
    # 27B C=1 step 5.43 -> 5.39 ms, 35B-A3B 1.86 -> 1.85 ms (docs/performance.md,
    # Measurement 15)
    "_recurrent_kernel": "its state tile: the slot a host copy wrote, the state a step ago; "
    "with GATES_BEFORE_WAIT at one token, the gates' x row (the in projection's input, two "
    "kernels back or more), b|a rows, A_log and dt_bias; with NORM_INPUTS_EARLY, the output "
    "norm's weight",
    # 35B-A3B q4 C=1 step 1.78-1.79 -> 1.74 ms (docs/performance.md, Measurement 18)
    "_groupwise_gemv_int_kernel": "a one-step program's codes and scales (weights), and the "
    "experts' down product's pair lists (written by the routing two kernels back)",
    # these three: 27B q4 C=1 step 5.04 -> 4.97 ms, 35B-A3B 1.50 -> 1.41 ms (docs/performance.md,
    # Measurement 35)
    "_rms_norm_kernel": "the norm weight",
    "_gated_rms_norm_kernel": "the norm weight, and z: the GDN in projection's output, with "
    "the recurrent or chunked rule's kernels between wherever the norm runs",
    "_moe_router_route_kernel": "with the norm inside: the router rows, the norm weight",
    "_decode_split_kernel": "with READS_BEFORE_WAIT: the sequence's length and page table "
    "(host copies before the step), and its run's first page when every token on it precedes "
    "the newest (written by an earlier step)",
    "_decode_merge_kernel": "with READS_BEFORE_WAIT: the output gate (the q|gate|k|v "
    "product's, three kernels back)",
}

# The memory order of an arrival counter's reset by the last program to arrive (the split-K
# products, the fused router, the GDN output norm). Nothing in the kernel reads the counter
# after it, and the next kernel that uses it waits for this one to end, which makes every
# write visible, so the reset needs no fence. Ordered (acq_rel, Triton's default), it held the
# last program until its result stores were acknowledged: on the GPU machine the 27B q4 C=8
# step 6.71 -> 6.65 ms with it relaxed (docs/performance.md, Measurement 33).
COUNTER_RESET_SEM = tl.constexpr("relaxed")


@triton.jit
def await_inputs(PDL: tl.constexpr):
    """Under PDL: wait until the kernel before this one in the stream has finished and its
    writes are visible, then let the next kernel's programs be placed as SMs free up."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_has_pdl()


def pdl_options(device: torch.device) -> dict:
    """The launch keywords for a kernel on `device`: PDL where the GPU (sm_90+) and Triton
    support it and NINFER_PDL is not 0, else the kernel's PDL constant off."""
    if device.type != "cuda" or os.environ.get("NINFER_PDL", "1") == "0":
        return {"PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _device_has_pdl(index):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}

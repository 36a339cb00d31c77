"""A coming product's weights asked into the L2 by a latency-bound kernel before it.

At one decode token the GDN layer's recurrent and gated-norm kernels, and the attention
kernels, take microseconds while moving little memory, and the product after them then reads
its weights from DRAM from its first program on. A kernel that takes `prefetch_l2` asks the L2
for those weights (Hopper's `cp.async.bulk.prefetch.L2`: one instruction per range, no
registers, nothing waits on it) once it has waited for the kernel before it, so that the
transfer fills the DRAM time its own work leaves idle, and the product finds them in the L2.
Weights are never written during a step, so the hint cannot be stale; it changes no result.

Ours because no library offers an L2 prefetch of another kernel's operand. Asked after the
wait, not before: before it the kernel before this one is still running, and when that is a
product the prefetch would take its bandwidth."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Byte ranges one launch can prefetch (a product's planes: codes and scales, or q6's three).
MAX_RANGES = 3
# Ranges are cut into 16-byte-aligned pieces of at most this many bytes, one per thread.
_ALIGN = 16
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Switch for A/B timing: False launches the kernels that take it without prefetches.
L2_PREFETCH = True
# Share of each range prefetched (its first bytes), and whether the kernel asks after its own
# stores rather than right after its wait.
L2_PREFETCH_SHARE = 1.0
L2_PREFETCH_LATE = False


def _prefetch_asm(first_thread_only: bool) -> str:
    lines = ["{", ".reg .pred p, q;", ".reg .u32 t;"]
    if first_thread_only:
        lines += ["mov.u32 t, %tid.x;", "setp.eq.u32 q, t, 0;", "setp.gt.and.s32 p, $2, 0, q;"]
    else:
        lines += ["setp.gt.s32 p, $2, 0;"]
    lines += ["@p cp.async.bulk.prefetch.L2.global [$1], $2;", "mov.b32 $0, 0;", "}"]
    return "\n".join(lines)


_ASM_EACH = tl.constexpr(_prefetch_asm(False))
_ASM_FIRST = tl.constexpr(_prefetch_asm(True))
# One bulk prefetch per program (its first thread) rather than one per thread.
L2_PREFETCH_ONE_PER_PROGRAM = False


@triton.jit
def _prefetch_range(base, nbytes, program, programs, THREADS: tl.constexpr, ONE: tl.constexpr):
    """This program's share of [base, base + nbytes): a piece of at most ceil(nbytes /
    (programs * THREADS)) bytes, rounded up to 16, per thread (ONE: one piece, thread 0)."""
    if ONE:
        piece = tl.cdiv(tl.cdiv(nbytes, programs), 16) * 16
        start = (program + tl.arange(0, 1)).to(tl.int64) * piece
    else:
        piece = tl.cdiv(tl.cdiv(nbytes, programs * THREADS), 16) * 16
        start = (program * THREADS + tl.arange(0, THREADS)).to(tl.int64) * piece
    size = tl.minimum(tl.maximum(nbytes - start, 0), piece).to(tl.int32)
    tl.inline_asm_elementwise(
        _ASM_FIRST if ONE else _ASM_EACH,
        "=r,l,r",
        [base + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def prefetch_l2(
    base0, bytes0, base1, bytes1, base2, bytes2, program, programs, THREADS: tl.constexpr,
    ONE: tl.constexpr,
):
    """Program `program` of `programs` asks the L2 for its share of up to three byte ranges
    (`prefetch_args`; a range of 0 bytes is skipped). Call after `await_inputs`."""
    _prefetch_range(base0, bytes0, program, programs, THREADS, ONE)
    if bytes1 > 0:
        _prefetch_range(base1, bytes1, program, programs, THREADS, ONE)
    if bytes2 > 0:
        _prefetch_range(base2, bytes2, program, programs, THREADS, ONE)


def prefetch_args(planes: tuple[torch.Tensor, ...] | None, device: torch.device) -> tuple:
    """(base0, bytes0, base1, bytes1, base2, bytes2) for `prefetch_l2` from the tensors to
    prefetch (each contiguous, on `device`), and whether to prefetch at all: not in Triton's
    interpreter, not with `L2_PREFETCH` off, not for tensors elsewhere or not 16-byte aligned.
    Each range is the tensor's bytes rounded down to 16."""
    ranges = []
    if planes and L2_PREFETCH and not INTERPRETED and device.type == "cuda":
        for plane in planes[:MAX_RANGES]:
            nbytes = int(plane.numel() * plane.element_size() * L2_PREFETCH_SHARE)
            nbytes = nbytes // _ALIGN * _ALIGN
            if (
                plane.device == device
                and plane.is_contiguous()
                and plane.data_ptr() % _ALIGN == 0
                and nbytes > 0
            ):
                ranges.append((plane.view(torch.uint8).view(-1), nbytes))
    if not ranges:
        return (None, 0, None, 0, None, 0), False
    while len(ranges) < MAX_RANGES:
        ranges.append((ranges[0][0], 0))
    return tuple(item for pair in ranges for item in pair), True

"""Group-wise int GEMV/small-M GEMM in Triton for `q8_g32_fp16` and `q4_g64_fp16` weights.

Decode reads every weight once per step, so the codes are read straight from their stored
planes and dequantized in registers. Integer codes are exact in bf16/fp16, so each group's
product x_g · codes_g runs on the tensor cores (x padded to 16 rows) and is scaled once per
group and row afterwards. An FMA-unit variant for M <= 4 (codes to floats by a bit trick) was
measured slower on the GPU machine and dropped.
The q4 nibbles of a byte are values 2j and 2j+1, so they meet x's even and odd columns.
Split-K fills the GPU when N is small; the splits' fp32 partials are summed at the end.
Reference: `groupwise_gemv.groupwise_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_support import next_power_of_2, num_sms
from ninfer.quant import EncodedTensor

SUPPORTED = {"q8_g32_fp16": (8, 32), "q4_g64_fp16": (4, 64)}
GROUPS_PER_STEP = 4
# Weight rows per program, per format: the faster of 64 and 128 at M = 1..8 on the GPU machine
# (bench/decode_kernels.md).
BLOCK_N = {"q8_g32_fp16": 64, "q4_g64_fp16": 128}


@triton.jit
def _groupwise_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    partial_ptr,
    M,
    N,
    K,
    num_groups,
    groups_per_split,
    stride_xm,
    stride_codes,
    stride_scales,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_rows = x_ptr + ms[:, None] * stride_xm
    code_rows = codes_ptr + rows[:, None].to(tl.int64) * stride_codes
    scale_rows = scales_ptr + rows.to(tl.int64) * stride_scales
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, num_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(first, last, STEP):
        for i in tl.static_range(STEP):
            group = step + i
            # masks must be tensors in the interpreter, so "group < last" is asked per element
            if BITS == 8:
                ks = group * GROUP + tl.arange(0, GROUP)
                live = ks < last * GROUP
                codes = tl.load(
                    code_rows + ks[None, :], mask=row_mask[:, None] & live[None, :], other=0
                )
                xs = tl.load(
                    x_rows + ks[None, :],
                    mask=m_mask[:, None] & (live & (ks < K))[None, :],
                    other=0.0,
                )
                part = tl.dot(xs, tl.trans(codes.to(xs.dtype)))
            else:
                cols = group * (GROUP // 2) + tl.arange(0, GROUP // 2)
                live = cols < last * (GROUP // 2)
                packed = tl.load(
                    code_rows + cols[None, :], mask=row_mask[:, None] & live[None, :], other=0
                ).to(tl.int32)
                low = ((packed & 15) ^ 8) - 8
                high = ((packed >> 4) ^ 8) - 8
                even = 2 * cols
                x_even = tl.load(
                    x_rows + even[None, :],
                    mask=m_mask[:, None] & (live & (even < K))[None, :],
                    other=0.0,
                )
                x_odd = tl.load(
                    x_rows + even[None, :] + 1,
                    mask=m_mask[:, None] & (live & (even + 1 < K))[None, :],
                    other=0.0,
                )
                part = tl.dot(x_even, tl.trans(low.to(x_even.dtype)))
                part = tl.dot(x_odd, tl.trans(high.to(x_odd.dtype)), part)
            scale_mask = row_mask & (rows * 0 + group < last)
            scale = tl.load(scale_rows + group, mask=scale_mask, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
    out = partial_ptr + (split * M + ms[:, None]) * N + rows[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & row_mask[None, :])


def groupwise_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x: [M, K] bf16/fp16; weight: an encoded [N, K] tensor in a SUPPORTED format, planes on
    x's device. Returns [M, N] in x's dtype."""
    bits, group = SUPPORTED[weight.format]
    num_rows, k = weight.shape
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("groupwise GEMV needs unit stride along K")
    m = x.shape[0]
    num_groups = scales.shape[1]
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = BLOCK_N[weight.format]
    n_blocks = triton.cdiv(num_rows, block_n) * triton.cdiv(m, block_m)
    steps = triton.cdiv(num_groups, GROUPS_PER_STEP)
    splits = max(1, min(steps, triton.cdiv(2 * num_sms(x.device), n_blocks)))
    groups_per_split = triton.cdiv(steps, splits) * GROUPS_PER_STEP
    splits = triton.cdiv(num_groups, groups_per_split)
    partial = torch.empty(splits, m, num_rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(m, block_m), splits)
    _groupwise_gemv_kernel[grid](
        x,
        codes,
        scales,
        partial,
        m,
        num_rows,
        k,
        num_groups,
        groups_per_split,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        BITS=bits,
        GROUP=group,
        STEP=GROUPS_PER_STEP,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return partial.sum(dim=0).to(x.dtype)

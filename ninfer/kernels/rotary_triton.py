"""Partial rotary embedding in Triton, in place on the rotated dims only.

Eager torch slices, negates, concatenates and multiplies (about ten kernels) and rebuilds the
whole head with a final concatenation, although only the first rot dims (64 of 256 in Qwen3.5)
change. This kernel reads and rewrites just those dims of every head of a token in one program,
in fp32 with one rounding. The result is written into x, which the caller must own. The
engine no longer launches it: the attention layer runs this arithmetic inside its prelude
kernel (`attention_prelude_triton`), and this kernel stays as the unfused form that prelude is
checked against, bit for bit, after `rms_norm_triton`.
Reference: `rotary.apply_rotary` (same signature; it returns a new tensor instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    mask = (heads < NUM_HEADS)[:, None] & dim_mask[None, :]
    cos_first = tl.load(cos_ptr + token * stride_ct + dims, mask=dim_mask).to(tl.float32)
    cos_second = tl.load(cos_ptr + token * stride_ct + HALF + dims, mask=dim_mask).to(tl.float32)
    sin_first = tl.load(sin_ptr + token * stride_st + dims, mask=dim_mask).to(tl.float32)
    sin_second = tl.load(sin_ptr + token * stride_st + HALF + dims, mask=dim_mask).to(tl.float32)
    first_ptr = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    first = tl.load(first_ptr, mask=mask).to(tl.float32)
    second = tl.load(first_ptr + HALF, mask=mask).to(tl.float32)
    new_first = first * cos_first[None, :] - second * sin_first[None, :]
    new_second = second * cos_second[None, :] + first * sin_second[None, :]
    tl.store(first_ptr, new_first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptr + HALF, new_second.to(x_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] with unit stride on head_dim, rotated in place and returned;
    cos, sin: [T, rot] with unit stride on rot."""
    tokens, num_heads, _ = x.shape
    half = cos.shape[-1] // 2
    if tokens and half:
        _rotary_kernel[(tokens,)](
            x,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_HEADS=num_heads,
            HALF=half,
            HEADS_PAD=next_power_of_2(num_heads),
            HALF_PAD=next_power_of_2(half),
            num_warps=4,
            **pdl_options(x.device),
        )
    return x

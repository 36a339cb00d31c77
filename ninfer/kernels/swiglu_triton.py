"""SwiGLU activation in Triton: silu(gate) * up in one pass.

Eager torch runs silu and the product as two kernels with an intermediate in memory (five
tensor passes); this reads gate and up once and writes the result once (three), in fp32 with a
single rounding at the end. At a 27B prefill of 4096 tokens that is 0.14 GB instead of 0.36 GB
per layer, and one launch fewer per layer in decode.
Reference: `swiglu.silu_mul` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.groupwise_gemv_triton import split_block, swiglu_values
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n,
    stride_g,
    stride_u,
    stride_o,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    BLOCK: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = swiglu_values(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)
    if SPLIT_BITS != 0:  # this block's integer-GEMV codes (x_split.py)
        split_block(
            out,
            n,
            tl.program_id(1),
            row,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            BLOCK,
            SPLIT_BITS,
            SPLIT_GROUP,
        )


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, split: SplitRequest | None = None
) -> torch.Tensor:
    """gate, up: [..., n] of one shape with unit stride on the last dim (rows may be strided,
    e.g. the halves of a fused gate/up product); returns a new [..., n] in gate's dtype. With
    `split`, a [T, n] output carries its integer-GEMV codes (`x_split`)."""
    n = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    buffers = None
    if gate.dim() == 2:
        buffers = producer_buffers(split, out.shape[0], n, out.device, BLOCK)
    split_args, split_constants = split_launch_args(split, buffers, out, BLOCK)
    if out.numel():
        _silu_mul_kernel[(gate2.shape[0], triton.cdiv(n, BLOCK))](
            gate2,
            up2,
            out,
            n,
            gate2.stride(0),
            up2.stride(0),
            out.stride(0),
            *split_args,
            BLOCK=BLOCK,
            **split_constants,
            num_warps=4,
            **pdl_options(gate2.device),
        )
    result = out.view(gate.shape)
    if buffers is not None:
        attach(result, split, buffers)
    return result

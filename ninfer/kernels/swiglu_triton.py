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

from ninfer.kernels.pdl_triton import await_inputs, pdl_options

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
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., n] of one shape with unit stride on the last dim (rows may be strided,
    e.g. the halves of a fused gate/up product); returns a new [..., n] in gate's dtype."""
    n = gate.shape[-1]
    gate2, up2 = gate.reshape(-1, n), up.reshape(-1, n)
    out = torch.empty(gate2.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        _silu_mul_kernel[(gate2.shape[0], triton.cdiv(n, BLOCK))](
            gate2,
            up2,
            out,
            n,
            gate2.stride(0),
            up2.stride(0),
            out.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_options(gate2.device),
        )
    return out.view(gate.shape)

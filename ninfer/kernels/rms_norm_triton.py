"""Fused (1 + w) RMSNorm(+residual) in Triton: one program per row, fp32 inside; the residual
sum is written once, rounded as an unfused add would round it, and the norm reads that value.
Saves a pass over the hidden state per norm. Reference: `rms_norm.rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_support import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_sum,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        total = (x + residual.to(tl.float32)).to(sum_out_ptr.dtype.element_ty)
        tl.store(sum_out_ptr + row * stride_sum + cols, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * inv_rms * (1.0 + weight)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm.rms_norm`; x may be a strided view (e.g. q heads inside q_proj)."""
    dim = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_rows = total = rows  # unused by the kernel
    else:
        residual_rows = _rows(residual)
        total = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            residual_rows,
            weight,
            out,
            total,
            rows.stride(0),
            residual_rows.stride(0),
            out.stride(0),
            total.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    y = out.view(x.shape)
    return y if residual is None else (y, total.view(x.shape))

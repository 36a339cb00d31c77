"""Fused (1 + w) RMSNorm(+residual) in Triton: one program per row (per part of a row when it
also writes the integer GEMV's codes of its output), fp32 inside; the residual sum is written
once, rounded as an unfused add would round it, and the norm reads that value. Saves a pass
over the hidden state per norm. Reference: `rms_norm.rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.groupwise_gemv_triton import split_values
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

# Warps per program: one per NORM_ELEMENTS_PER_WARP values of the (power-of-two padded) row,
# at most NORM_MAX_WARPS, or NORM_DECODE_MAX_WARPS for up to DECODE_ROWS rows. A decode norm
# is latency: one row with the residual and the x split took 2.46 us at 4 warps against 3.55
# at 16 (5120 wide) and 2.05 against 3.16 at 8 (2048 wide) on the H200 (CUDA-graph replay,
# median); prefill rows keep more warps, fewer values (registers) per thread.
NORM_ELEMENTS_PER_WARP, NORM_MAX_WARPS = 256, 16
NORM_DECODE_MAX_WARPS, DECODE_ROWS = 4, 16


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_out_ptr,
    stride_x,
    stride_x_head,
    heads,
    stride_residual,
    stride_out,
    stride_sum,
    dim,
    eps,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    SPLIT_BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    # The norm weight, which no kernel writes, is read before the wait
    # (`pdl_triton.READ_BEFORE_WAIT`): read after the row, it was a memory round trip of its
    # own (Nsight Compute on the H200: a 27B decode norm stalled as long on its part of the
    # weight as on the row, the compiler placing the load after the sum of squares).
    if SPLIT_BITS == 0:
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        weight = norm_part_weight(weight_ptr, tl.program_id(1), dim, SPLIT_GROUP, SPLIT_BLOCK_G)
    await_inputs(PDL)
    x_row = x_ptr + (row // heads) * stride_x + (row % heads) * stride_x_head
    residual_row = residual_ptr + row * stride_residual
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_row + cols, mask=mask, other=0.0)
    if SPLIT_BITS != 0:  # the part's values again: from the L1, where the row's just came
        part = norm_part_inputs(
            x_row, residual_row, weight, tl.program_id(1), dim, HAS_RESIDUAL, SPLIT_GROUP,
            SPLIT_BLOCK_G,
        )  # fmt: skip
    if HAS_RESIDUAL:
        total = (x + residual.to(tl.float32)).to(sum_out_ptr.dtype.element_ty)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    if SPLIT_BITS == 0:
        if HAS_RESIDUAL:
            tl.store(sum_out_ptr + row * stride_sum + cols, total, mask=mask)
        y = x * inv_rms * (1.0 + weight)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        norm_part(
            part,
            out_ptr + row * stride_out,
            sum_out_ptr + row * stride_sum,
            inv_rms,
            tl.program_id(1),
            dim,
            row,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            HAS_RESIDUAL,
            SPLIT_BITS,
            SPLIT_GROUP,
            SPLIT_BLOCK_G,
        )


@triton.jit
def _part(part_index, dim, SPLIT_GROUP: tl.constexpr, SPLIT_BLOCK_G: tl.constexpr):
    """Part `part_index` of a row: its SPLIT_BLOCK_G groups, their [groups, values] columns
    and those columns' mask."""
    groups = part_index * SPLIT_BLOCK_G + tl.arange(0, SPLIT_BLOCK_G)
    part = groups[:, None] * SPLIT_GROUP + tl.arange(0, SPLIT_GROUP)[None, :]
    return groups, part, part < dim


@triton.jit
def norm_part_weight(
    weight_ptr, part_index, dim, SPLIT_GROUP: tl.constexpr, SPLIT_BLOCK_G: tl.constexpr
):
    """The norm weight's values of part `part_index` (`norm_part`), fp32."""
    _, part, part_mask = _part(part_index, dim, SPLIT_GROUP, SPLIT_BLOCK_G)
    return tl.load(weight_ptr + part, mask=part_mask, other=0.0).to(tl.float32)


@triton.jit
def norm_part_inputs(
    x_row,
    residual_row,
    weight,
    part_index,
    dim,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    SPLIT_BLOCK_G: tl.constexpr,
):
    """What `norm_part` takes of part `part_index`: x's values (fp32), the residual's as
    stored (x's again without one) and the norm weight's (`norm_part_weight`, read apart so
    that a kernel can read it before its wait)."""
    _, part, part_mask = _part(part_index, dim, SPLIT_GROUP, SPLIT_BLOCK_G)
    xp = tl.load(x_row + part, mask=part_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        rp = tl.load(residual_row + part, mask=part_mask, other=0.0)
    else:
        rp = xp
    return xp, rp, weight


@triton.jit
def norm_part(
    inputs,
    out_row,
    sum_row,
    inv_rms,
    part_index,
    dim,
    m,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    SPLIT_BLOCK_G: tl.constexpr,
):
    """Part `part_index` of a normed row from its `inputs` (`norm_part_inputs`): its residual
    sum, output and, with SPLIT_BITS, its integer-GEMV codes (x_split.py) as row m's, from
    the same arithmetic in registers. The norm kernel and the fused MoE router
    (`moe_router_triton`) write a row's parts here, so both write alike."""
    xp, rp, weight = inputs
    groups, part, part_mask = _part(part_index, dim, SPLIT_GROUP, SPLIT_BLOCK_G)
    if HAS_RESIDUAL:
        total_part = (xp + rp.to(tl.float32)).to(sum_row.dtype.element_ty)
        tl.store(sum_row + part, total_part, mask=part_mask)
        xp = total_part.to(tl.float32)
    y = (xp * inv_rms * (1.0 + weight)).to(out_row.dtype.element_ty)
    tl.store(out_row + part, y, mask=part_mask)
    if SPLIT_BITS != 0:
        split_values(
            y.to(tl.float32),
            groups,
            dim // SPLIT_GROUP,
            m,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            SPLIT_BITS,
            SPLIT_GROUP,
            SPLIT_BLOCK_G,
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    split: SplitRequest | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm.rms_norm`; x may be a strided view: [T, heads, dim] is read
    with both of its strides (q or k heads inside the fused q/k/v product: no copy), other
    shapes as rows of unit stride (copied where they are not). With `split`, a [T, dim] x's
    output carries its integer-GEMV codes (`x_split`)."""
    dim = x.shape[-1]
    if x.dim() == 3 and x.stride(-1) == 1:
        x_rows, heads, stride_x, stride_x_head = x, x.shape[1], x.stride(0), x.stride(1)
    else:
        x_rows = _rows(x)
        heads, stride_x, stride_x_head = 1, x_rows.stride(0), 0
    num_rows = x.shape[:-1].numel()
    out = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device)
    if residual is None:
        residual_rows = total = out  # unused by the kernel
    else:
        residual_rows = _rows(residual)
        total = torch.empty(num_rows, dim, dtype=x.dtype, device=x.device)
    buffers = producer_buffers(split, num_rows, dim, x.device) if x.dim() == 2 else None
    split_args, split_constants = split_launch_args(split, buffers, out)
    if num_rows:
        block = next_power_of_2(dim)
        # Splitting, the row is written in parts of SPLIT_BLOCK_G groups, one program each: one
        # program looping over a 5120-wide row's 80 groups made each norm ~5 us longer than
        # the norm and a separate split together (docs/performance.md, Measurement 7). Each
        # part's program still reads the whole row for its sum of squares.
        most_warps = NORM_DECODE_MAX_WARPS if num_rows <= DECODE_ROWS else NORM_MAX_WARPS
        parts = 1
        if buffers is not None:
            parts = triton.cdiv(dim // split.group, split_constants["SPLIT_BLOCK_G"])
        _rms_norm_kernel[(num_rows, parts)](
            x_rows,
            residual_rows,
            weight,
            out,
            total,
            stride_x,
            stride_x_head,
            heads,
            residual_rows.stride(0),
            out.stride(0),
            total.stride(0),
            dim,
            eps,
            *split_args,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            **split_constants,
            num_warps=min(most_warps, max(1, block // NORM_ELEMENTS_PER_WARP)),
            **pdl_options(x_rows.device),
        )
    y = out.view(x.shape)
    if buffers is not None:
        attach(y, split, buffers)
    return y if residual is None else (y, total.view(x.shape))

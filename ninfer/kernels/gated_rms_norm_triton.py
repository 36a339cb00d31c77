"""Fused GDN output norm in Triton: RMSNorm of each head's row, times w in the model dtype, times
silu(z), in one kernel. Eager torch runs this as 13 kernels (casts, pow, mean, add, rsqrt, muls,
silu); in a graph-replayed decode step each costs a launch gap larger than its work, 48 times
per step at 27B. The roundings of the reference are kept: normed to x's dtype, w * normed to
the dtype torch promotes the pair to. Reference: `gated_rms_norm.gated_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.groupwise_gemv_triton import split_block
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

ELEMENTS_PER_PROGRAM = 2048  # 16 rows of 128 per program: a 27B decode token is 3 programs
# Warps per program: eight give each thread 8 values of one row (one 16-byte load). At four,
# each thread held two rows, and the compiler read the second only after the first row's
# sum of squares, a memory round trip more (sm_90, Triton 3.6).
WARPS = 8


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    weight_ptr,
    out_ptr,
    rows,
    heads,
    dim,
    stride_x_token,
    stride_x_head,
    stride_z_token,
    stride_z_head,
    eps,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    ROUND_SCALED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < dim
    mask = (row < rows)[:, None] & col_mask[None, :]
    token, head = row // heads, row % heads
    x_offsets = (token * stride_x_token + head * stride_x_head)[:, None] + cols[None, :]
    z_offsets = (token * stride_z_token + head * stride_z_head)[:, None] + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    # The weight and z are read before the wait (`pdl_triton.READ_BEFORE_WAIT`), z through
    # the L2: after it, the compiler placed both behind the sum of squares, each a memory
    # round trip of its own (Nsight Compute on the H200: the 35B-A3B decode norm stalled on
    # them about as long as on x).
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + z_offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    await_inputs(PDL)
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / dim + eps)
    normed = (x * inv_rms[:, None]).to(dtype).to(tl.float32)
    scaled = weight[None, :] * normed
    if ROUND_SCALED:
        scaled = scaled.to(dtype).to(tl.float32)
    out = (scaled * (z * tl.sigmoid(z))).to(dtype)
    tl.store(out_ptr + row[:, None] * dim + cols[None, :], out, mask=mask)
    if SPLIT_BITS != 0:
        # The program's rows are BLOCK_ROWS heads of one token (the caller checks that they
        # tile the heads and that dim = BLOCK_D): columns of that token's [heads * dim] row.
        first = tl.program_id(0).to(tl.int64) * BLOCK_ROWS
        split_block(
            out,
            heads * dim,
            (first % heads) // BLOCK_ROWS,
            first // heads,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            BLOCK_ROWS * BLOCK_D,
            SPLIT_BITS,
            SPLIT_GROUP,
        )


def _heads(t: torch.Tensor) -> torch.Tensor:
    """[..., heads, dim] as [tokens, heads, dim] (a [rows, dim] tensor is one token of `rows`
    heads); a view whenever the leading dims merge, as they do for a projection's slice."""
    heads = t.shape[-2] if t.dim() > 1 else 1
    t = t.reshape(-1, heads, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def gated_rms_norm(
    x: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    split: SplitRequest | None = None,
) -> torch.Tensor:
    """Same contract as `gated_rms_norm.gated_rms_norm`; x and z may be strided views (rows
    must have unit stride along dim, else they are copied). weight in x's dtype or fp32.
    With `split`, the output carries the integer-GEMV codes of its [tokens, heads * dim]
    rows (`x_split`), which a reshape to that shape keeps."""
    dim = x.shape[-1]
    x3, z3 = _heads(x), _heads(z)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        block_d = next_power_of_2(dim)
        block_rows = min(max(1, ELEMENTS_PER_PROGRAM // block_d), next_power_of_2(rows))
        tokens, heads = x3.shape[0], x3.shape[1]
        buffers = None
        if block_d == dim and heads % block_rows == 0:
            buffers = producer_buffers(split, tokens, heads * dim, x.device, block_rows * dim)
        split_args, split_constants = split_launch_args(split, buffers, out, block_rows * dim)
        _gated_rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            x3,
            z3,
            weight,
            out,
            rows,
            x3.shape[1],
            dim,
            x3.stride(0),
            x3.stride(1),
            z3.stride(0),
            z3.stride(1),
            eps,
            *split_args,
            ROUND_SCALED=torch.promote_types(weight.dtype, x.dtype) == x.dtype,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            **split_constants,
            num_warps=WARPS,
            **pdl_options(x3.device),
        )
        if buffers is not None:
            attach(out, split, buffers)
    return out

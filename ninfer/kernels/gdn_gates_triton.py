"""Gated DeltaNet gates in Triton: beta and g of a block of tokens in one program.

Eager torch spends about eight elementwise kernels per GDN layer on them (casts, exp, neg,
add, softplus, mul, sigmoid), each a launch of almost no work in a decode step; this reads b
and a (the halves of the fused b|a projection, any row stride) once and writes both results.
fp32 inside; softplus as torch computes it (x above 20 passes through, else log1p(exp(x)),
log1p in the accurate form log(u) * x / (u - 1), u = 1 + x, since Triton has no log1p).
Reference: `gdn_gates.gdn_gates` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_support import next_power_of_2

# Tokens per program at most (decode steps take fewer: the next power of two of T).
BLOCK_T = 16


@triton.jit
def _gdn_gates_kernel(
    b_ptr,
    a_ptr,
    A_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    T,
    H,
    stride_b,
    stride_a,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < H
    mask = (tokens < T)[:, None] & head_mask[None, :]
    rows = tokens.to(tl.int64)[:, None]
    b = tl.load(b_ptr + rows * stride_b + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + rows * stride_a + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    A_log = tl.load(A_log_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    x = a + dt_bias[None, :]
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u == 1.0  # e below half an ulp of 1: log1p(e) is e
    log1p = tl.where(rounded, e, tl.log(u) * (e / tl.where(rounded, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    g = -tl.exp(A_log)[None, :] * softplus
    beta = tl.sigmoid(b)
    out = rows * H + heads[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gdn_gates.gdn_gates`; b and a need unit stride along the heads."""
    tokens, heads = b.shape
    if b.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("gdn gates need unit stride along the heads")
    g = torch.empty(tokens, heads, dtype=torch.float32, device=b.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        block_t = min(BLOCK_T, next_power_of_2(tokens))
        block_h = next_power_of_2(heads)
        _gdn_gates_kernel[(triton.cdiv(tokens, block_t),)](
            b,
            a,
            A_log,
            dt_bias,
            g,
            beta,
            tokens,
            heads,
            b.stride(0),
            a.stride(0),
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            num_warps=max(1, min(4, block_t * block_h // 256)),
        )
    return g, beta

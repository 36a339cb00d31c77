"""The attention layer's prelude in one Triton kernel: q_norm, k_norm, partial rotary on both and
the K/V write into the pages, where the layer launched five kernels (two norms, two rotaries,
the KV write). Ours because a decode step is latency-bound, and each of those launches, moving
a few kilobytes, cost 1-3.5 us of it on the H200.

One program per (token, head row), one warp at head_dim 256: the query heads first, then the
K/V heads, each of which also moves its V row. At decode sizes that spreads even one token over
the SMs (28 programs at 27B). A row gets the arithmetic of the unfused kernels, so the results
equal theirs bit for bit: `rms_norm_triton`'s for the norm (fp32 inside, one rounding to the
model dtype; the sum of squares reduced over a [BLOCK] row with the same warps, so in the same
order), then `rotary_triton`'s on the rounded values of the first rot dims (fp32, one rounding).
The rotated dims are normed once more as [HALF] halves, from the same x with the same
arithmetic, so no value has to move between lanes. The normed, rotated key goes straight to its
page, cast to the cache dtype as the KV write casts it; a negative slot skips its token's K and
V (a padded row of a fixed-size batch). The key is not returned: attention, decode and prefill
alike, reads it from the pages.
Reference: `attention_prelude.attention_prelude` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2


@triton.jit
def _normed(x_ptr, weight_ptr, inv_rms, mask):
    """Elements of a row normed as the whole row is, rounded to x's dtype, back in fp32."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr, mask=mask, other=0.0).to(tl.float32)
    return (x * inv_rms * (1.0 + weight)).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _norm_rotate_row(
    x_row,
    weight_ptr,
    cos_row,
    sin_row,
    out_row,
    head_dim,
    eps,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the row at x_row to out_row normed, its first 2 * HALF dims rotated; rounded to
    x's dtype, then cast to out_row's."""
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * inv_rms * (1.0 + weight)).to(x_row.dtype.element_ty)
    tl.store(out_row + cols, y.to(out_row.dtype.element_ty), mask=mask & (cols >= 2 * HALF))
    # cos and sin, then the halves, loaded in rotary_triton's order: LLVM orders each sum's
    # two products by where their inputs come from and fuses the first into an FMA, so the
    # order decides which product is rounded (seen in the sm_90 PTX of both kernels)
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    cos_first = tl.load(cos_row + dims, mask=dim_mask).to(tl.float32)
    cos_second = tl.load(cos_row + HALF + dims, mask=dim_mask).to(tl.float32)
    sin_first = tl.load(sin_row + dims, mask=dim_mask).to(tl.float32)
    sin_second = tl.load(sin_row + HALF + dims, mask=dim_mask).to(tl.float32)
    first = _normed(x_row + dims, weight_ptr + dims, inv_rms, dim_mask)
    second = _normed(x_row + HALF + dims, weight_ptr + HALF + dims, inv_rms, dim_mask)
    new_first = first * cos_first - second * sin_first
    new_second = second * cos_second + first * sin_second
    new_first = new_first.to(x_row.dtype.element_ty).to(out_row.dtype.element_ty)
    new_second = new_second.to(x_row.dtype.element_ty).to(out_row.dtype.element_ty)
    tl.store(out_row + dims, new_first, mask=dim_mask)
    tl.store(out_row + HALF + dims, new_second, mask=dim_mask)


@triton.jit
def _attention_prelude_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    stride_kcp,
    stride_kct,
    stride_kch,
    stride_vcp,
    stride_vct,
    stride_vch,
    head_dim,
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    if head < NUM_HEADS:
        _norm_rotate_row(
            q_ptr + token * stride_qt + head * stride_qh,
            q_weight_ptr,
            cos_row,
            sin_row,
            out_ptr + token * stride_ot + head * stride_oh,
            head_dim,
            eps,
            HALF,
            HALF_PAD,
            BLOCK,
        )
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            page = slot // PAGE
            offset = slot % PAGE
            _norm_rotate_row(
                k_ptr + token * stride_kt + kv_head * stride_kh,
                k_weight_ptr,
                cos_row,
                sin_row,
                k_cache_ptr + page * stride_kcp + offset * stride_kct + kv_head * stride_kch,
                head_dim,
                eps,
                HALF,
                HALF_PAD,
                BLOCK,
            )
            cols = tl.arange(0, BLOCK)
            mask = cols < head_dim
            v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + cols, mask=mask)
            v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vct + kv_head * stride_vch
            tl.store(v_dst + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def attention_prelude(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_write_slots: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `attention_prelude.attention_prelude`, with unit stride along head_dim
    (query, key, value, caches) and rot (cos, sin); any other strides, as q/k/v views of the
    fused projection's output have. A negative slot skips its token's K and V."""
    tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if any(t.stride(-1) != 1 for t in (query, key, value, cos, sin, k_cache, v_cache)):
        raise ValueError("the attention prelude needs unit stride along head_dim and rot")
    out = torch.empty(tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    block = next_power_of_2(head_dim)
    half = cos.shape[-1] // 2
    _attention_prelude_kernel[(tokens, num_heads + num_kv_heads)](
        query,
        key,
        value,
        q_weight,
        k_weight,
        cos,
        sin,
        out,
        k_cache,
        v_cache,
        kv_write_slots,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        head_dim,
        eps,
        NUM_HEADS=num_heads,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        BLOCK=block,
        PAGE=PAGE_SIZE,
        num_warps=min(16, max(1, block // 256)),  # rms_norm_triton's: its order of the sum
        **pdl_options(query.device),
    )
    return out

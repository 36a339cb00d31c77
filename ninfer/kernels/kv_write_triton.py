"""KV write in Triton: scatter the new tokens' K and V rows into their 64-token pages.

The reference does two `index_copy_`s (plus a cast each when the dtypes differ); this is one
launch for both, one program per token moving its [nkv, d] K and V rows, cast to the cache
dtype on the store. The bytes are the same; what it saves is the second launch and the casts,
which matter in decode steps (a few hundred tokens at most) rather than in prefill. A negative
slot skips its token (a padded row of a fixed-size batch), where the reference would raise.
The engine no longer launches it: the attention layer writes its K/V inside its prelude
kernel (`attention_prelude_triton`), which is checked against this one.
Reference: `kv_write.write_kv` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2


@triton.jit
def _write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kct,
    stride_kch,
    stride_vcp,
    stride_vct,
    stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    page = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + page * stride_kcp + offset * stride_kct + heads[:, None] * stride_kch
    v_dst = v_cache_ptr + page * stride_vcp + offset * stride_vct + heads[:, None] * stride_vch
    tl.store(k_dst + dims[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst + dims[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_write_slots: torch.Tensor,
) -> None:
    """k, v: [T, n_kv_heads, head_dim] (unit stride on head_dim); caches: [num_pages, 64,
    n_kv_heads, head_dim] (unit stride on head_dim); kv_write_slots: int64 [T],
    `page_id * 64 + offset`, negative to skip."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if any(t.stride(-1) != 1 for t in (k, v, k_cache, v_cache)):
        raise ValueError("KV write needs unit stride along head_dim")
    _write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        kv_write_slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_heads),
        DIM_PAD=next_power_of_2(head_dim),
        PAGE=PAGE_SIZE,
        num_warps=4,
        **pdl_options(k.device),
    )

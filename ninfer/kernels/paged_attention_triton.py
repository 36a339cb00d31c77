"""Paged decode attention in Triton: one query per sequence over its 64-token K/V pages.

Split-K: each program takes one sequence, one KV head (all the query heads of its GQA group at
once, so every K/V byte is read once) and a run of pages, and keeps an online softmax; a second
kernel merges the runs by their maxima and sums. At batch 1 the splits are what fill the GPU.
Scores and softmax are fp32; p is cast to the cache dtype for the P·V product.
Reference: `paged_attention.paged_attention_decode` (same signature, `max_seq_len` aside).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2, num_sms

LOG2E = 1.4426950408889634
SPLIT_WAVES = 2  # programs per SM the split aims for (measured: 2 a little ahead of 4, 8 slower)
SPLIT_WARPS = 4  # warps of the split kernel (tuned on the GPU machine, see bench/decode_kernels.py)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_pt,
    pages_per_split,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + seq)
    first_page = split * pages_per_split
    end_page = tl.minimum(first_page + pages_per_split, tl.cdiv(seq_len, PAGE))

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, PAGE)
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=(rows < GROUP)[:, None],
        other=0.0,
    )
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for page_index in range(first_page, end_page):
        page = tl.load(page_table_ptr + seq * stride_pt + page_index).to(tl.int64)
        k = tl.load(
            k_cache_ptr
            + page * stride_kp
            + tokens[:, None] * stride_kt
            + kv_head * stride_kh
            + dims[None, :]
        )
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # log2 units
        valid = (page_index * PAGE + tokens) < seq_len
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            v_cache_ptr
            + page * stride_vp
            + tokens[:, None] * stride_vt
            + kv_head * stride_vh
            + dims[None, :]
        )
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    part = (seq * num_heads + heads) * num_splits + split
    row_mask = rows < GROUP
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
    tl.store(part_max_ptr + part, running_max, mask=row_mask)
    tl.store(part_sum_ptr + part, running_sum, mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    base = (seq * tl.num_programs(1) + head) * num_splits
    used = splits < num_splits
    maxima = tl.load(part_max_ptr + base + splits, mask=used, other=float("-inf"))
    sums = tl.load(part_sum_ptr + base + splits, mask=used, other=0.0)
    top = tl.max(maxima, axis=0)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp2(maxima - top))
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=used[:, None],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], axis=0) / tl.sum(sums * weights, axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def choose_splits(num_seqs: int, num_kv_heads: int, max_pages: int, device: torch.device):
    """(pages_per_split, num_splits): enough programs for SPLIT_WAVES waves over the SMs, so
    that enough page loads are in flight."""
    programs = SPLIT_WAVES * num_sms(device)
    wanted = max(1, math.ceil(programs / max(1, num_seqs * num_kv_heads)))
    pages_per_split = math.ceil(max_pages / min(wanted, max_pages))
    return pages_per_split, math.ceil(max_pages / pages_per_split)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """q: [B, nh, d] in the cache dtype; caches [num_pages, 64, nkv, d] with unit stride on d.
    `max_seq_len` (a host int, at least every seq_len) sizes the split; without it the launcher
    reads it from the device. Returns [B, nh, d] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged attention needs unit stride along head_dim")
    if head_dim != next_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    max_pages = max(1, math.ceil(max_seq_len / PAGE_SIZE))
    pages_per_split, num_splits = choose_splits(num_seqs, num_kv_heads, max_pages, q.device)
    group = num_heads // num_kv_heads
    part_out = torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
    )
    part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        part_out,
        part_max,
        part_sum,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        pages_per_split,
        num_splits,
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=PAGE_SIZE,
        num_warps=SPLIT_WARPS,
        num_stages=2,
        **pdl_options(q.device),
    )
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out,
        part_max,
        part_sum,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        num_warps=4,
        **pdl_options(part_out.device),
    )
    return out

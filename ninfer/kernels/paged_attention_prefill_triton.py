"""Paged prefill attention in Triton: each sequence's new queries over its 64-token K/V pages.

Same contract as `paged_attention.paged_attention_prefill`: the new chunk's K/V are already in
the pages (the layer writes first, then attends), so one causal pass over pages 0.. covers the
cached prefix and the chunk alike; query i of a sequence sits at position context_len + i and
sees keys 0..context_len + i.

One program takes BLOCK_M consecutive new tokens of one sequence for one query head and walks
that sequence's pages with an online softmax (fp32 scores and sums, p cast to the cache dtype
for the P·V product). The flat varlen batch is cut into blocks on the device (no host sync):
`block_seq` / `block_index` name each program's sequence and block, and the grid is sized by an
upper bound so spare programs return at once. Query heads vary fastest in the grid, so the heads
of one GQA group run side by side and re-read their K/V pages from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

LOG2E = 1.4426950408889634
BLOCK_M = 64  # new tokens per program
NUM_WARPS = 8  # a [64, 256] fp32 accumulator is 64 registers a thread at 8 warps
NUM_STAGES = 2  # two K/V pages in flight: 2 x 64 KB of shared memory at head_dim 256


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    query_start_ptr,
    context_lens_ptr,
    block_seq_ptr,
    block_index_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    head = tl.program_id(0)
    block = tl.program_id(1)
    seq = tl.load(block_seq_ptr + block)
    if seq >= num_seqs:
        return
    kv_head = head // GROUP
    first_token = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - first_token
    context_len = tl.load(context_lens_ptr + seq)
    seq_len = context_len + query_len

    rows = tl.load(block_index_ptr + block) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_valid = rows < query_len
    query_pos = context_len + rows
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    tokens = (first_token + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    # key 0 is visible to every row (also to the spare rows past the chunk), so no row's max
    # stays -inf and the rescale below never sees inf - inf
    last_key = tl.minimum(context_len + tl.max(rows, axis=0), seq_len - 1)
    offsets = tl.arange(0, PAGE)
    for page_index in range(0, last_key // PAGE + 1):
        page = tl.load(page_table_ptr + seq * stride_pt + page_index).to(tl.int64)
        k = tl.load(
            k_cache_ptr
            + page * stride_kp
            + offsets[:, None] * stride_kt
            + kv_head * stride_kh
            + dims[None, :],
            mask=dim_valid[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # log2 units
        key_pos = page_index * PAGE + offsets
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos < seq_len)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            v_cache_ptr
            + page * stride_vp
            + offsets[:, None] * stride_vt
            + kv_head * stride_vh
            + dims[None, :],
            mask=dim_valid[None, :],
            other=0.0,
        )
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


def query_blocks(query_start: torch.Tensor, num_tokens: int, block_m: int):
    """(block_seq, block_index), int32 [G] with G = ceil(T / block_m) + B, an upper bound on the
    blocks of block_m new tokens: block g is block `block_index[g]` of sequence `block_seq[g]`;
    spare entries have block_seq == B. Built with device ops, so nothing waits for the GPU."""
    num_seqs = query_start.shape[0] - 1
    query_lens = (query_start[1:] - query_start[:-1]).long()
    blocks = (query_lens + block_m - 1) // block_m
    blocks_end = blocks.cumsum(0)
    ids = torch.arange(triton.cdiv(num_tokens, block_m) + num_seqs, device=query_start.device)
    block_seq = torch.searchsorted(blocks_end, ids, right=True)
    first_block = (blocks_end - blocks)[block_seq.clamp(max=num_seqs - 1)]
    return block_seq.to(torch.int32), (ids - first_block).to(torch.int32)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [T, nh, d] (flat varlen) in the cache dtype; caches [num_pages, 64, nkv, d] with unit
    stride on d. seq_lens must equal context_lens + query lengths (it is not read). Returns
    [T, nh, d] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged attention needs unit stride along head_dim")
    out = torch.empty_like(q)
    num_seqs = query_start.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_seq, block_index = query_blocks(query_start, num_tokens, BLOCK_M)
    _prefill_kernel[(num_heads, block_seq.shape[0])](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        query_start,
        context_lens,
        block_seq,
        block_index,
        scale * LOG2E,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=max(16, next_power_of_2(head_dim)),
        BLOCK_M=BLOCK_M,
        PAGE=PAGE_SIZE,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        **pdl_options(q.device),
    )
    return out

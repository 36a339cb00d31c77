"""Paged decode attention in Triton: one query per sequence over its 64-token K/V pages.

Split-K: each program takes one sequence, one KV head (all the query heads of its GQA group at
once, so every K/V byte is read once) and a run of pages, and keeps an online softmax; a second
kernel merges the runs by their maxima and sums. At batch 1 the splits are what fill the GPU.
Scores and softmax are fp32; p is cast to the cache dtype for the P·V product.
Reference: `paged_attention.paged_attention_decode` (same signature, `max_seq_len` aside).

`paged_attention_decode_gated` also applies the gated-attention output gate in the merge
kernel: a merge program finishes one head of one sequence, so it multiplies by sigmoid(gate)
and writes o_proj's integer-GEMV codes for that head's groups alone (one launch fewer per
attention layer than the merge followed by `output_gate_triton.sigmoid_gate`, same roundings).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.groupwise_gemv_triton import split_block
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2, num_sms
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

LOG2E = 1.4426950408889634
SPLIT_WAVES = 2  # programs per SM the split aims for (measured: 2 a little ahead of 4, 8 slower)
SPLIT_WARPS = 4  # warps of the split kernel (tuned on the GPU machine, see bench/decode_kernels.py)
# Under PDL, what the kernels read before their wait (`pdl_triton.READ_BEFORE_WAIT`): the split
# kernel its sequence's length and the first page of its run (the page table's entry, and the
# page's K and V tiles when every token on it precedes the newest, so an earlier step wrote
# them); the merge kernel the output gate, which the q|gate|k|v product wrote three kernels
# back. The step's inputs come from host copies before its first kernel, and the newest
# token's K/V from the prelude, the kernel just before the split, which is why the page that
# holds it is read after the wait. Without it the split kernel's first K tile waited on three
# round trips after the wait: the length, the page table, the page. Off: compiled for sm_90,
# the split kernel then takes 255 registers (173 without), and on the H200 the C=1 steps ran a
# little slower with it (27B q4 4.84 against 4.82-4.83 ms, 35B-A3B q4 1.37 against 1.35-1.36
# ms; docs/performance.md, Measurement 37). Not timed at long contexts.
READS_BEFORE_WAIT = False


@triton.jit
def _query(q_ptr, seq, stride_qb, heads, stride_qh, row_mask, HEAD_DIM: tl.constexpr):
    """The query rows of a GQA group, zeros past the group."""
    dims = tl.arange(0, HEAD_DIM)
    return tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    )


@triton.jit
def _page_tile(
    cache_ptr, page, stride_p, stride_t, kv_head, stride_h, count,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """[PAGE, HEAD_DIM]: one KV head's K or V on a page, its first `count` tokens (PAGE, or 0
    to read nothing; zeros past them)."""
    tokens = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    head = cache_ptr + page * stride_p + kv_head * stride_h
    return tl.load(head + tokens[:, None] * stride_t + dims[None, :], mask=tokens[:, None] < count)


@triton.jit
def _attend_page(
    q, k, v, page_index, seq_len, running_max, running_sum, acc, scale_log2,
    PAGE: tl.constexpr,
):  # fmt: skip
    """The online softmax's running maximum, sum and P.V accumulator after one more page."""
    tokens = tl.arange(0, PAGE)
    scores = tl.dot(q, tl.trans(k)) * scale_log2  # log2 units
    valid = (page_index * PAGE + tokens) < seq_len
    scores = tl.where(valid[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
    return new_max, running_sum, acc


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
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """With EARLY, the sequence's length and the run's first page before the wait
    (`READS_BEFORE_WAIT`)."""
    if not EARLY:
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
    heads = kv_head * GROUP + rows
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if EARLY:
        # the newest token is at seq_len - 1: a page wholly before it was written by an
        # earlier step
        first_is_old = (first_page + 1) * PAGE < seq_len
        early_tokens = tl.where(first_is_old, PAGE, 0)
        page = tl.load(
            page_table_ptr + seq * stride_pt + first_page, mask=first_page < end_page, other=0
        ).to(tl.int64)
        k = _page_tile(k_cache_ptr, page, stride_kp, stride_kt, kv_head, stride_kh, early_tokens,
                       PAGE, HEAD_DIM)  # fmt: skip
        v = _page_tile(v_cache_ptr, page, stride_vp, stride_vt, kv_head, stride_vh, early_tokens,
                       PAGE, HEAD_DIM)  # fmt: skip
        await_inputs(PDL)
        q = _query(q_ptr, seq, stride_qb, heads, stride_qh, rows < GROUP, HEAD_DIM)
        if first_page < end_page:
            if not first_is_old:  # the newest token's page, which the prelude wrote
                k = _page_tile(k_cache_ptr, page, stride_kp, stride_kt, kv_head, stride_kh,
                               PAGE, PAGE, HEAD_DIM)  # fmt: skip
                v = _page_tile(v_cache_ptr, page, stride_vp, stride_vt, kv_head, stride_vh,
                               PAGE, PAGE, HEAD_DIM)  # fmt: skip
            running_max, running_sum, acc = _attend_page(
                q, k, v, first_page, seq_len, running_max, running_sum, acc, scale_log2, PAGE
            )
        later_pages = first_page + 1
    else:
        q = _query(q_ptr, seq, stride_qb, heads, stride_qh, rows < GROUP, HEAD_DIM)
        later_pages = first_page
    for page_index in range(later_pages, end_page):
        page = tl.load(page_table_ptr + seq * stride_pt + page_index).to(tl.int64)
        k = _page_tile(k_cache_ptr, page, stride_kp, stride_kt, kv_head, stride_kh, PAGE,
                       PAGE, HEAD_DIM)  # fmt: skip
        v = _page_tile(v_cache_ptr, page, stride_vp, stride_vt, kv_head, stride_vh, PAGE,
                       PAGE, HEAD_DIM)  # fmt: skip
        running_max, running_sum, acc = _attend_page(
            q, k, v, page_index, seq_len, running_max, running_sum, acc, scale_log2, PAGE
        )

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
    gate_ptr,
    stride_gb,
    stride_gh,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GATED: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[seq, head] = the runs merged; with GATED, times sigmoid(gate[seq, head]), each
    rounded to out's dtype as the separate kernels round them (out is then [B, heads *
    HEAD_DIM], stride_oh = HEAD_DIM), and with SPLIT_BITS the head's integer-GEMV codes. With
    EARLY, the gate is read before the wait (`READS_BEFORE_WAIT`)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    gate_row = gate_ptr + seq * stride_gb + head * stride_gh + dims
    if GATED:
        if EARLY:
            gate = tl.load(gate_row)
    await_inputs(PDL)
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
    out = out.to(out_ptr.dtype.element_ty)
    if GATED:
        if not EARLY:
            gate = tl.load(gate_row)
        # rounded to the activation dtype before the product, as torch.sigmoid's output is
        sig = tl.sigmoid(gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
        out = (out.to(tl.float32) * sig.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out)
    if SPLIT_BITS != 0:  # this head's integer-GEMV codes (x_split.py)
        split_block(
            out,
            tl.num_programs(1) * HEAD_DIM,
            head,
            seq,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            HEAD_DIM,
            SPLIT_BITS,
            SPLIT_GROUP,
        )


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
    return _decode(q, k_cache, v_cache, page_table, seq_lens, scale, max_seq_len)


def paged_attention_decode_gated(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gate: torch.Tensor,
    split: SplitRequest | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """`paged_attention_decode` followed by `output_gate_triton.sigmoid_gate(out, gate, split)`
    in one merge kernel, bit for bit: gate [B, nh, d] with unit stride on d. Returns [B, nh *
    d] in q's dtype, carrying o_proj's codes when `split` asks for them."""
    num_seqs, num_heads, head_dim = q.shape
    if tuple(gate.shape) != (num_seqs, num_heads, head_dim) or gate.stride(2) != 1:
        raise ValueError(f"gate {tuple(gate.shape)} does not match the query {tuple(q.shape)}")
    out = torch.empty(num_seqs, num_heads * head_dim, dtype=q.dtype, device=q.device)
    buffers = producer_buffers(split, num_seqs, num_heads * head_dim, out.device, head_dim)
    _decode(
        q, k_cache, v_cache, page_table, seq_lens, scale, max_seq_len, out, gate, split, buffers
    )
    if buffers is not None:
        attach(out, split, buffers)
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None,
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    split: SplitRequest | None = None,
    buffers: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """The split and merge launches; with `gate`, into out [B, nh * d], gated and split."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("paged attention needs unit stride along head_dim")
    if head_dim != next_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if out is None:
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
        EARLY=READS_BEFORE_WAIT,
        num_warps=SPLIT_WARPS,
        num_stages=2,
        **pdl_options(q.device),
    )
    split_args, split_constants = split_launch_args(split, buffers, out, head_dim)
    _decode_merge_kernel[(num_seqs, num_heads)](
        part_out,
        part_max,
        part_sum,
        out,
        out.stride(0),
        head_dim if gate is not None else out.stride(1),
        num_splits,
        gate if gate is not None else out,
        gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0,
        *split_args,
        SPLITS_PAD=next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        GATED=gate is not None,
        EARLY=READS_BEFORE_WAIT,
        **split_constants,
        num_warps=4,
        **pdl_options(part_out.device),
    )
    return out

"""Depthwise causal conv + SiLU in Triton over a flat varlen batch, continuing from (and then
updating) each sequence's window of the last K - 1 inputs in its state slot.

One program per (span of up to SPAN tokens of one sequence, block of channels) walks its span in
tiles, so a long prefill spreads over the GPU. The spans are numbered in batch order and each
program finds its sequence and span from query_start, so the grid, sized on the host without a
device sync (S sequences of T tokens, each at least one, have at most S + (T - S) // SPAN spans),
holds no idle programs; a grid of as many spans per sequence as the longest could have would be
mostly empty when many short prompts share a chunk. Only a sequence's first K - 1 tokens read
inputs from the window, and they lie in its first span (SPAN >= K - 1), so the program of that
span is the only reader of the window and rewrites it after a barrier behind its reads, taking
the new entries from x (or from the old window, for a sequence shorter than K - 1 tokens): the
update is race-free. Decode (one token per sequence) maps program to sequence directly.
The conv accumulates in fp32 and the output is rounded once.
Reference: `causal_conv1d.causal_conv1d` (same signature).

`causal_conv1d_and_gates` runs the GDN gates from the layer input (`gdn_gates_triton`'s
`gdn_gates_from_x`) as programs of the same launch: the two read and write different tensors,
so one grid of the conv's programs followed by the gates' needs no counter, and a decode step
of several sequences has one dependent launch fewer per GDN layer (docs/performance.md,
Measurement 24). Reference: `causal_conv1d.causal_conv1d_and_gates` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.gdn_gates_triton import BLOCK_K as GATES_BLOCK_K
from ninfer.kernels.gdn_gates_triton import (
    PROJ_NUM_WARPS,
    ROWS_PER_PROGRAM,
    _gates_from_x_program,
    check_gates_from_x,
    gates_outputs,
    normed_rows_args,
)
from ninfer.kernels.norm_fold import NormedRows
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

SPAN = 64  # tokens per prefill program (a power of two): 16 per channel block for 1024 tokens
SEARCH_BLOCK = 128  # sequences a program scans at once while finding its span
CONV_WARPS = 4


@triton.jit
def _find_span(pair, query_start_ptr, num_seqs, SPAN: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """(sequence, span within it) of the pair-th span of the batch, spans numbered in batch
    order; past the last span, the last sequence and a span beyond its end."""
    seq = -1
    first_span = 0
    spans_before = 0
    for base in range(0, num_seqs, SEARCH_BLOCK):
        seqs = base + tl.arange(0, SEARCH_BLOCK)
        valid = seqs < num_seqs
        begins = tl.load(query_start_ptr + seqs, mask=valid, other=0)
        ends = tl.load(query_start_ptr + seqs + 1, mask=valid, other=0)
        spans = ((ends - begins + SPAN - 1) // SPAN).to(tl.int32)  # loop-carried sums stay int32
        firsts = spans_before + tl.cumsum(spans, 0) - spans
        started = valid & (firsts <= pair)
        seq += tl.sum(started.to(tl.int32), 0)
        first_span = tl.maximum(first_span, tl.max(tl.where(started, firsts, 0), 0))
        spans_before += tl.sum(spans, 0)
    return seq, pair - first_span


@triton.jit
def _conv_program(
    pair,
    chan_block,
    x_ptr,
    weight_ptr,
    windows_ptr,
    state_slots_ptr,
    query_start_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    stride_weight_c,
    stride_window_slot,
    stride_window_c,
    channels,
    num_seqs,
    WIDTH: tl.constexpr,
    SPAN: tl.constexpr,
    ONE_TOKEN_EACH: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One program's part of the conv: span `pair` of the batch (the sequence `pair` where
    each has one token), channels of block `chan_block`."""
    if ONE_TOKEN_EACH:
        seq = pair
        span = 0
    else:
        seq, span = _find_span(pair, query_start_ptr, num_seqs, SPAN, SEARCH_BLOCK)
    chans = chan_block * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_mask = chans < channels
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    begin = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    window = windows_ptr + slot * stride_window_slot + chans * stride_window_c
    span_begin = begin + span * SPAN
    span_end = tl.minimum(end, span_begin + SPAN)

    for tile in range(span_begin, span_end, BLOCK_T):
        times = (tile + tl.arange(0, BLOCK_T)).to(tl.int64)  # times * stride passes 2^31
        time_mask = times < span_end
        acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
        for j in tl.static_range(WIDTH):
            tap = tl.load(weight_ptr + chans * stride_weight_c + j, mask=chan_mask, other=0.0)
            source = times - (WIDTH - 1) + j
            in_batch = source >= begin
            mask = time_mask[:, None] & chan_mask[None, :]
            from_x = tl.load(
                x_ptr + source[:, None] * stride_xt + chans[None, :],
                mask=mask & in_batch[:, None],
                other=0.0,
            )
            from_window = tl.load(
                window[None, :] + (WIDTH - 1 + source - begin)[:, None],
                mask=mask & ~in_batch[:, None],
                other=0.0,
            )
            acc += (from_x.to(tl.float32) + from_window.to(tl.float32)) * tap.to(tl.float32)[
                None, :
            ]
        out = acc * tl.sigmoid(acc)
        tl.store(
            out_ptr + times[:, None] * stride_ot + chans[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=time_mask[:, None] & chan_mask[None, :],
        )

    if span == 0:
        # The tiles above may read a window entry from another thread than the one that
        # rewrites it below.
        tl.debug_barrier()
        # Entry i of the new window is input end - (K - 1) + i; when that input is itself in the
        # old window it sits at entry n + i > i (n new tokens), read before it is overwritten.
        for i in tl.static_range(WIDTH - 1):
            source = end - (WIDTH - 1) + i + tl.zeros([BLOCK_C], tl.int64)
            in_batch = source >= begin
            from_x = tl.load(
                x_ptr + source * stride_xt + chans, mask=chan_mask & in_batch, other=0.0
            )
            from_window = tl.load(
                window + (WIDTH - 1 + source - begin), mask=chan_mask & ~in_batch, other=0.0
            )
            value = from_x.to(tl.float32) + from_window.to(tl.float32)
            tl.store(window + i, value.to(windows_ptr.dtype.element_ty), mask=chan_mask)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    weight_ptr,
    windows_ptr,
    state_slots_ptr,
    query_start_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    stride_weight_c,
    stride_window_slot,
    stride_window_c,
    channels,
    num_seqs,
    WIDTH: tl.constexpr,
    SPAN: tl.constexpr,
    ONE_TOKEN_EACH: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    _conv_program(
        tl.program_id(0),
        tl.program_id(1),
        x_ptr,
        weight_ptr,
        windows_ptr,
        state_slots_ptr,
        query_start_ptr,
        out_ptr,
        stride_xt,
        stride_ot,
        stride_weight_c,
        stride_window_slot,
        stride_window_c,
        channels,
        num_seqs,
        WIDTH,
        SPAN,
        ONE_TOKEN_EACH,
        SEARCH_BLOCK,
        BLOCK_T,
        BLOCK_C,
    )


@triton.jit
def _conv_and_gates_kernel(
    x_ptr,
    weight_ptr,
    windows_ptr,
    state_slots_ptr,
    query_start_ptr,
    out_ptr,
    stride_xt,
    stride_ot,
    stride_weight_c,
    stride_window_slot,
    stride_window_c,
    channels,
    num_seqs,
    ba_x_ptr,
    ba_weight_ptr,
    A_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    heads,
    stride_ba_x,
    stride_ba_w,
    conv_programs,
    chan_blocks,
    row_blocks,
    squares_ptr,
    square_blocks,
    eps,
    WIDTH: tl.constexpr,
    SPAN: tl.constexpr,
    ONE_TOKEN_EACH: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SQUARE_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The conv kernel's programs first (span, channel block), then the gates-from-x kernel's
    (token, b|a row block), in one 1-D grid."""
    await_inputs(PDL)
    pid = tl.program_id(0)
    if pid < conv_programs:
        _conv_program(
            pid // chan_blocks,
            pid % chan_blocks,
            x_ptr,
            weight_ptr,
            windows_ptr,
            state_slots_ptr,
            query_start_ptr,
            out_ptr,
            stride_xt,
            stride_ot,
            stride_weight_c,
            stride_window_slot,
            stride_window_c,
            channels,
            num_seqs,
            WIDTH,
            SPAN,
            ONE_TOKEN_EACH,
            SEARCH_BLOCK,
            BLOCK_T,
            BLOCK_C,
        )
    else:
        job = pid - conv_programs
        _gates_from_x_program(
            job // row_blocks,
            job % row_blocks,
            ba_x_ptr,
            ba_weight_ptr,
            A_log_ptr,
            dt_bias_ptr,
            g_ptr,
            beta_ptr,
            heads,
            stride_ba_x,
            stride_ba_w,
            squares_ptr,
            square_blocks,
            eps,
            HIDDEN,
            BLOCK_ROWS,
            BLOCK_K,
            SQUARE_BLOCKS,
        )


def _conv_launch(x: torch.Tensor, weight: torch.Tensor, conv_windows: torch.Tensor, state_slots):
    """The conv's output, grid (spans, channel blocks) and launch arguments: positional, then
    compile-time."""
    channels, width = weight.shape
    if x.stride(1) != 1 or weight.stride(1) != 1 or conv_windows.stride(2) != 1:
        raise ValueError("causal conv needs unit stride along channels, taps and window")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, num_seqs = x.shape[0], state_slots.shape[0]
    span = max(SPAN, next_power_of_2(width - 1))
    block_t = min(16, next_power_of_2(max(1, num_tokens // max(1, num_seqs))), span)
    block_c = 256 if block_t == 1 else 128
    grid = (num_seqs + (num_tokens - num_seqs) // span, triton.cdiv(channels, block_c))
    strides = (
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_windows.stride(0),
        conv_windows.stride(1),
        channels,
        num_seqs,
    )
    constants = {
        "WIDTH": width,
        "SPAN": span,
        "ONE_TOKEN_EACH": num_tokens == num_seqs,
        "SEARCH_BLOCK": SEARCH_BLOCK,
        "BLOCK_T": block_t,
        "BLOCK_C": block_c,
    }
    return out, grid, strides, constants


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """x: [T, C]; weight: [C, K]; conv_windows: [num_slots, C, K - 1], read and updated in place;
    every sequence has at least one token. Returns silu(conv(x)) as [T, C] in x's dtype."""
    out, grid, strides, constants = _conv_launch(x, weight, conv_windows, state_slots)
    if state_slots.shape[0] == 0:
        return out
    _causal_conv1d_kernel[grid](
        x,
        weight,
        conv_windows,
        state_slots,
        query_start,
        out,
        *strides,
        **constants,
        num_warps=CONV_WARPS,
        **pdl_options(x.device),
    )
    return out


def causal_conv1d_and_gates(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    ba_x: torch.Tensor | NormedRows,
    w_ba: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`causal_conv1d` of x and `gdn_gates_triton.gdn_gates_from_x` of ba_x (the layer input,
    maybe a folded norm's rows) in one launch: (conv output, g, beta), each as the two kernels
    give it, bit for bit. Two kernels a GDN layer runs between its in projection and its
    recurrent kernel, both short, become one link of the step's chain of dependent launches.
    Meant, as the gates kernel is, for decode-sized batches."""
    ba_x, square_args, square_constants = normed_rows_args(ba_x)
    check_gates_from_x(ba_x, w_ba)
    if ba_x.shape[0] != x.shape[0]:
        raise ValueError(f"{ba_x.shape[0]} gate rows for {x.shape[0]} conv tokens")
    out, (spans, chan_blocks), strides, constants = _conv_launch(
        x, weight, conv_windows, state_slots
    )
    heads = w_ba.shape[0] // 2
    g, beta = gates_outputs(ba_x, heads)
    if state_slots.shape[0] == 0 or x.shape[0] == 0:
        return out, g, beta
    row_blocks = triton.cdiv(w_ba.shape[0], ROWS_PER_PROGRAM)
    conv_programs = spans * chan_blocks
    _conv_and_gates_kernel[(conv_programs + x.shape[0] * row_blocks,)](
        x,
        weight,
        conv_windows,
        state_slots,
        query_start,
        out,
        *strides,
        ba_x,
        w_ba,
        A_log,
        dt_bias,
        g,
        beta,
        heads,
        ba_x.stride(0),
        w_ba.stride(0),
        conv_programs,
        chan_blocks,
        row_blocks,
        *square_args,
        **constants,
        HIDDEN=ba_x.shape[1],
        BLOCK_ROWS=ROWS_PER_PROGRAM,
        BLOCK_K=GATES_BLOCK_K,
        **square_constants,
        num_warps=PROJ_NUM_WARPS,  # the gates kernel's (its sums' order), the conv's too
        **pdl_options(x.device),
    )
    return out, g, beta

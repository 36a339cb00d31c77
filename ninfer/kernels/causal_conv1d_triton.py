"""Depthwise causal conv + SiLU in Triton over a flat varlen batch, continuing from (and then
updating) each sequence's window of the last K - 1 inputs in its state slot.

One program per (sequence, block of channels) walks that sequence's tokens in tiles; an input
before the sequence's first new token is read from the window. The program that reads a window
is the one that rewrites it, after its last read of that entry, so the update is race-free.
The conv accumulates in fp32 and the output is rounded once.
Reference: `causal_conv1d.causal_conv1d` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_support import next_power_of_2


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
    WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_mask = chans < channels
    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    begin = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    window = windows_ptr + slot * stride_window_slot + chans * stride_window_c

    for tile in range(begin, end, BLOCK_T):
        times = tile + tl.arange(0, BLOCK_T)
        time_mask = times < end
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

    # Entry i of the new window is input end - (K - 1) + i; when that input is itself in the old
    # window it sits at entry n + i > i (n new tokens), which is read before it is overwritten.
    for i in tl.static_range(WIDTH - 1):
        source = end - (WIDTH - 1) + i + tl.zeros([BLOCK_C], tl.int32)
        in_batch = source >= begin
        from_x = tl.load(x_ptr + source * stride_xt + chans, mask=chan_mask & in_batch, other=0.0)
        from_window = tl.load(
            window + (WIDTH - 1 + source - begin), mask=chan_mask & ~in_batch, other=0.0
        )
        value = from_x.to(tl.float32) + from_window.to(tl.float32)
        tl.store(window + i, value.to(windows_ptr.dtype.element_ty), mask=chan_mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """x: [T, C]; weight: [C, K]; conv_windows: [num_slots, C, K - 1], read and updated in place.
    Returns silu(conv(x)) as [T, C] in x's dtype."""
    channels, width = weight.shape
    if x.stride(1) != 1 or weight.stride(1) != 1 or conv_windows.stride(2) != 1:
        raise ValueError("causal conv needs unit stride along channels, taps and window")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0:
        return out
    tokens_per_seq = max(1, x.shape[0] // num_seqs)
    block_t = min(16, next_power_of_2(tokens_per_seq))
    block_c = 256 if block_t == 1 else 128
    grid = (num_seqs, triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x,
        weight,
        conv_windows,
        state_slots,
        query_start,
        out,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        conv_windows.stride(0),
        conv_windows.stride(1),
        channels,
        WIDTH=width,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=4,
    )
    return out

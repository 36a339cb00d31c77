"""Gated delta rule, token by token, in Triton: the decode form, with the fp32 state read from
and written back to its slot in place (fla's recurrent kernel takes dense states, not slots).

One program per (sequence, value head, block of dv columns) holds its [dk, BLOCK_V] slice of
the state in registers across that sequence's tokens, so a multi-token step (speculative
verification) reads and writes the state once. q and k are L2-normalised in the kernel.
Reference: `gdn_recurrent.recurrent_gated_delta_rule` (same signature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2, num_sms


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    states_ptr,
    state_slots_ptr,
    query_start_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_state_slot,
    stride_state_head,
    q_scale,
    key_dim,
    value_dim,
    RATIO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    seq = tl.program_id(0)
    value_head = tl.program_id(1)
    key_head = value_head // RATIO
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_mask = rows < key_dim
    col_mask = cols < value_dim
    tile_mask = row_mask[:, None] & col_mask[None, :]

    slot = tl.load(state_slots_ptr + seq).to(tl.int64)
    begin = tl.load(query_start_ptr + seq)
    end = tl.load(query_start_ptr + seq + 1)
    state_ptrs = (
        states_ptr
        + slot * stride_state_slot
        + value_head * stride_state_head
        + rows[:, None] * value_dim
        + cols[None, :]
    )
    state = tl.load(state_ptrs, mask=tile_mask, other=0.0)
    for t in range(begin, end):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + rows, mask=row_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + rows, mask=row_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t * stride_vt + value_head * stride_vh + cols, mask=col_mask, other=0.0)
        decay = tl.exp(tl.load(g_ptr + t * stride_gt + value_head).to(tl.float32))
        beta = tl.load(beta_ptr + t * stride_bt + value_head).to(tl.float32)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)
        delta = (v.to(tl.float32) - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(
            out_ptr + t * stride_ot + value_head * stride_oh + cols,
            out.to(out_ptr.dtype.element_ty),
            mask=col_mask,
        )
    tl.store(state_ptrs, state, mask=tile_mask)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay), beta: [T, Hv];
    states: fp32 [num_slots, Hv, dk, dv] (contiguous per slot), read and updated in place.
    Returns o: [T, Hv, dv] in v's dtype."""
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    key_dim = q.shape[2]
    if states.dtype != torch.float32 or states.stride(3) != 1 or states.stride(2) != value_dim:
        raise ValueError("GDN states must be fp32 with contiguous [dk, dv] per head")
    for x in (q, k, v):
        if x.stride(2) != 1:
            raise ValueError("q, k, v need unit stride along the head dimension")
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta need unit stride along heads")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0 or v.shape[0] == 0:
        return out
    # Narrow column blocks when few sequences, so that the grid still covers the SMs.
    block_v = min(next_power_of_2(value_dim), 64)
    while block_v > 16 and num_seqs * num_value_heads * (value_dim // block_v) < num_sms(v.device):
        block_v //= 2
    grid = (num_seqs, num_value_heads, triton.cdiv(value_dim, block_v))
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        out,
        states,
        state_slots,
        query_start,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        key_dim**-0.5,
        key_dim,
        value_dim,
        RATIO=num_value_heads // q.shape[1],
        BLOCK_K=next_power_of_2(key_dim),
        BLOCK_V=block_v,
        num_warps=4,
        **pdl_options(q.device),
    )
    return out

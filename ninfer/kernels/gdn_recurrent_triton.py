"""Gated delta rule, token by token, in Triton: the decode form, with the state (fp32 or bf16,
updated in fp32) read from and written back to its slot in place (fla's recurrent kernel takes
dense states, not slots).

One program per (sequence, value head, block of dv columns) holds its [dk, BLOCK_V] slice of
the state in registers across that sequence's tokens, so a multi-token step (speculative
verification) reads and writes the state once. q and k are L2-normalised in the kernel.
Reference: `gdn_recurrent.recurrent_gated_delta_rule` (same signature).

`recurrent_gated_delta_rule_from_x` takes the layer input x and the stacked b|a weight in place
of g and beta: each program computes b and a of its head and tokens and the gates from them
(the arithmetic and summation order of `gdn_gates_triton.gdn_gates_from_x`, whose helpers it
calls), so a decode step launches no gates kernel before the conv. Each launch costs a few
microseconds of a latency-bound step; the dot products are repeated per column block, but
two weight rows per head are little to read. Reference:
`gdn_recurrent.recurrent_gated_delta_rule_from_x` (same signature).

`recurrent_gated_delta_rule_from_x_normed` runs, at one token, the GDN output norm in the same
kernel: each head's column block that arrives last at the head's counter reads the head's o
back and writes the norm's output and the out projection's integer-GEMV codes, so the norm's
kernel is not launched. Reference: `recurrent_gated_delta_rule_from_x`, then
`gated_rms_norm_triton.gated_rms_norm` (bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.gdn_gates_triton import BLOCK_K as HIDDEN_BLOCK
from ninfer.kernels.gdn_gates_triton import _log_decay, _x_dot_rows
from ninfer.kernels.groupwise_gemv_triton import split_block, tile_counters, zeroed_once
from ninfer.kernels.norm_fold import HeadNormedRows
from ninfer.kernels.pdl_triton import COUNTER_RESET_SEM, await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2, num_sms
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

STATE_DTYPES = (torch.float32, torch.bfloat16)
# Widest column block and warps per program. With the narrowing below, within 3 % of the
# fastest setting swept at one token at the 27B and 35B-A3B shapes on the GPU machine
# (bench/decode_variants.py, docs/performance.md Measurement 9).
MAX_BLOCK_V = 64
# Up to this many sequences the state tile is read before the wait for the kernel before this
# one (`pdl_triton.READ_BEFORE_WAIT`). On the GPU machine at one sequence: the 27B C=1 step
# 5.43 -> 5.39 ms, the 35B-A3B one 1.86 -> 1.85 ms; at eight, 9.30 -> 9.33-9.34 ms, so not
# there (docs/performance.md, Measurement 15).
STATE_FIRST_MAX_SEQS = 1
# The output norm runs in the recurrent kernel (`recurrent_gated_delta_rule_from_x_normed`) only
# where a head is split into at most this many column blocks. On the GPU machine at one token:
# the 27B step (four blocks of 32 columns a head) 5.09-5.10 -> 5.07-5.08 ms; the 35B-A3B step
# (eight blocks of 16) 1.66 -> 1.69 ms, for a cause not found (docs/performance.md,
# Measurement 30).
NORM_LAST_MAX_BLOCKS = 4
RECURRENT_WARPS = 4
# With the state tile, at one token of one sequence, the gates from x computed before the
# wait too (`pdl_triton.READ_BEFORE_WAIT`): x is the in projection's input, two kernels back
# or more (the norm that wrote it, the in projection), so the b|a products, the longest
# chain before the rule, would overlap the kernel before this one. And the output norm's
# poller given z and the norm weight read before the rule, not after its poll. On the GPU
# machine, with `groupwise_gemv_triton.COMBINE_ROUTES_EARLY`, the three together: the 27B q4
# C=1 step 4.89-4.90 -> 4.83 ms, the 35B-A3B step 1.41 -> 1.36-1.38 ms (docs/performance.md,
# Measurement 36).
GATES_BEFORE_WAIT = True
NORM_INPUTS_EARLY = True
# The state tile stored before the arrival count of the output norm (`NORM_LAST`), not after
# the head's last block has run the norm: the count's fence then waits for the state's stores
# with o's, in one round trip, and no program ends on a state store issued after the count.
STATE_BEFORE_COUNT = tl.constexpr(True)
# The head's last block by index runs the output norm once the head's o is in a mailbox (each
# value's 16 bits over a mark, one 32-bit word, zeroed again by that block), as the fused MoE
# router waits for its logits (`moe_router_triton`); else the last block to arrive at the
# head's counter reads o back. The mailbox spares the counter's fence and atomic and the
# read-back: about two memory round trips at the end of the kernel. On the GPU machine the
# 27B q4 C=1 step 5.08-5.09 -> 5.07 ms (docs/performance.md, Measurement 33); at 35B-A3B's
# eight blocks a head the norm stays apart (`NORM_LAST_MAX_BLOCKS`), no faster in the kernel
# with the mailbox either (1.61 ms both ways). Like the counters, a device's mailbox serves
# one kernel at a time.
NORM_MAILBOX = True
NORM_MAILBOX_WORDS = 1 << 16
_mailboxes: dict[torch.device, torch.Tensor] = {}
# ... and at several sequences with the gates given (a decode step of several lanes): (widest
# column block, warps, register cap or None). Uncapped at 64 columns and four warps, a program
# of the 27B step's form (the output norm folded) takes 184 registers and two fit an SM; capped
# at 160, three fit without a spill. Timed alone on the GPU machine, eight 27B sequences, fp32
# states beyond the L2: 19.05 us uncapped, 17.88 at (64, 4, 160), 17.58 at (32, 2, 160); the
# 27B q4 C=8 step 6.80-6.81 -> 6.71-6.73 ms (docs/performance.md, Measurement 32).
SEQS_SETTING: tuple[int, int, int | None] = (32, 2, 160)


@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    x_ptr,
    ba_weight_ptr,
    A_log_ptr,
    dt_bias_ptr,
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
    stride_xt,
    stride_w,
    stride_ot,
    stride_oh,
    stride_state_slot,
    stride_state_head,
    q_scale,
    key_dim,
    value_dim,
    num_value_heads,
    z_ptr,
    stride_zt,
    stride_zh,
    norm_weight_ptr,
    squares_ptr,
    normed_ptr,
    counters_ptr,
    mailbox_ptr,
    norm_eps,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    RATIO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GATES_FROM_X: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    STATE_FIRST: tl.constexpr,
    GATES_FIRST: tl.constexpr,
    NORM_EARLY: tl.constexpr,
    FOLD_NORM: tl.constexpr,
    NORM_LAST: tl.constexpr,
    MAILBOX: tl.constexpr,
    ROUND_SCALED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    seq = tl.program_id(0)
    value_head = tl.program_id(1)
    key_head = value_head // RATIO
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_mask = rows < key_dim
    col_mask = cols < value_dim
    # At one sequence (STATE_FIRST) the state tile is read before the wait
    # (`pdl_triton.READ_BEFORE_WAIT`), so that its memory round trip overlaps the kernel
    # before this one: the slot and the sequence's tokens come from host copies before the
    # step, the state from this layer's kernel a step ago.
    if not STATE_FIRST:
        await_inputs(PDL)
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
    tile_mask = row_mask[:, None] & col_mask[None, :]
    if GATES_FROM_X:
        # Head h's b is row h of the stacked b|a weight, its a row num_value_heads + h.
        head_row = value_head + tl.arange(0, 1)
        head_mask = head_row < num_value_heads
        b_row = ba_weight_ptr + head_row.to(tl.int64)[:, None] * stride_w
        a_row = b_row + num_value_heads * stride_w
        A_log = tl.load(A_log_ptr + value_head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + value_head).to(tl.float32)
    if STATE_FIRST:  # through L2: an SM's L1 may still hold what it read of the slot a step ago
        state = tl.load(state_ptrs, mask=tile_mask, other=0.0, cache_modifier=".cg")
        if GATES_FIRST:
            # One token's gates before the wait too: x is the in projection's input, written
            # two kernels back or more, the b|a rows and A_log, dt_bias weights
            first_decay, first_beta = _gates_from_x(
                x_ptr + begin * stride_xt, b_row, a_row, head_mask, A_log, dt_bias, HIDDEN,
                BLOCK_HIDDEN, True,
            )  # fmt: skip
        if NORM_LAST and NORM_EARLY:  # the output norm's weight, which its poller reads last
            last_dims = tl.arange(0, BLOCK_D)
            last_weight = tl.load(
                norm_weight_ptr + last_dims, mask=last_dims < value_dim, other=0.0
            )
        await_inputs(PDL)
    else:
        state = tl.load(state_ptrs, mask=tile_mask, other=0.0)
    state = state.to(tl.float32)  # a bf16 state is updated in fp32, rounded once when stored
    if FOLD_NORM:
        norm_weight = tl.load(norm_weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if NORM_LAST and NORM_EARLY:  # the head's z, for its poller's norm, with q, k and v
        last_z, weight_then = _norm_inputs(
            z_ptr + begin * stride_zt + value_head * stride_zh, norm_weight_ptr, value_dim,
            BLOCK_D,
        )  # fmt: skip
        if not STATE_FIRST:
            last_weight = weight_then
    for t in range(begin, end):
        q = tl.load(q_ptr + t * stride_qt + key_head * stride_qh + rows, mask=row_mask, other=0.0)
        k = tl.load(k_ptr + t * stride_kt + key_head * stride_kh + rows, mask=row_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        v = tl.load(v_ptr + t * stride_vt + value_head * stride_vh + cols, mask=col_mask, other=0.0)
        if FOLD_NORM:  # asked for with q, k and v, so that no load waits after the rule
            z_at = z_ptr + t * stride_zt + value_head * stride_zh + cols
            z = tl.load(z_at, mask=col_mask, other=0.0).to(tl.float32)
        if GATES_FIRST:
            decay, beta = first_decay, first_beta
        elif GATES_FROM_X:
            decay, beta = _gates_from_x(
                x_ptr + t * stride_xt, b_row, a_row, head_mask, A_log, dt_bias, HIDDEN,
                BLOCK_HIDDEN, False,
            )  # fmt: skip
        else:
            decay = tl.exp(tl.load(g_ptr + t * stride_gt + value_head).to(tl.float32))
            beta = tl.load(beta_ptr + t * stride_bt + value_head).to(tl.float32)
        state = state * decay
        predicted = tl.sum(state * k[:, None], axis=0)
        delta = (v.to(tl.float32) - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        if FOLD_NORM:
            # the output norm folded (`norm_fold.HeadNormedRows`): o as stored unfolded, times
            # w and silu(z); its sum of squares over this block of the head's columns
            out = out.to(out_ptr.dtype.element_ty).to(tl.float32)
            blocks = tl.num_programs(2)
            square_at = (t * num_value_heads + value_head) * blocks + tl.program_id(2)
            tl.store(squares_ptr + square_at, tl.sum(out * out, axis=0))
            out = out * norm_weight * (z * tl.sigmoid(z))
        tl.store(
            out_ptr + t * stride_ot + value_head * stride_oh + cols,
            out.to(out_ptr.dtype.element_ty),
            mask=col_mask,
        )
        if MAILBOX:  # (NORM_LAST: one token) o as stored, over a mark
            stored = out.to(out_ptr.dtype.element_ty).to(tl.int16, bitcast=True)
            word = (stored.to(tl.int32) << 16) | 1
            box = mailbox_ptr + value_head * value_dim + cols
            tl.atomic_xchg(box, word, mask=col_mask, sem="relaxed")
    if STATE_BEFORE_COUNT:
        tl.store(state_ptrs, state.to(states_ptr.dtype.element_ty), mask=tile_mask)
    if NORM_LAST:  # one token: the head's last block runs its output norm
        counter = counters_ptr + value_head
        if MAILBOX:  # the last by index, once the head's o is in its mailbox
            runs = tl.program_id(2) == tl.num_programs(2) - 1
        else:  # the last to arrive at the head's counter
            tl.debug_barrier()  # every thread's part of o is written before the arrival counts
            runs = tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1
        if runs:
            dims = tl.arange(0, BLOCK_D)
            head_dims = dims < value_dim
            if MAILBOX:
                box = mailbox_ptr + value_head * value_dim + dims
                words = tl.load(box, mask=head_dims, other=1, volatile=True)
                while tl.min(words & 1, axis=0) == 0:
                    words = tl.load(box, mask=head_dims, other=1, volatile=True)
                tl.store(box, tl.zeros_like(words), mask=head_dims)  # for the next call
                o = (words >> 16).to(tl.int16).to(out_ptr.dtype.element_ty, bitcast=True)
            else:
                # .cg reads from L2, where the head's other blocks wrote theirs
                o_row = out_ptr + begin * stride_ot + value_head * stride_oh
                o = tl.load(o_row + dims, mask=head_dims, other=0.0, cache_modifier=".cg")
            if not NORM_EARLY:
                last_z, last_weight = _norm_inputs(
                    z_ptr + begin * stride_zt + value_head * stride_zh, norm_weight_ptr,
                    value_dim, BLOCK_D,
                )  # fmt: skip
            _head_norm(
                o.to(tl.float32),
                last_z.to(tl.float32),
                last_weight.to(tl.float32),
                normed_ptr,
                begin,
                value_head,
                num_value_heads,
                value_dim,
                norm_eps,
                xq_ptr,
                corr_ptr,
                xscale_ptr,
                ROUND_SCALED,
                BLOCK_D,
                SPLIT_BITS,
                SPLIT_GROUP,
            )
            if not MAILBOX:
                tl.atomic_xchg(counter, 0, sem=COUNTER_RESET_SEM)
    if not STATE_BEFORE_COUNT:
        tl.store(state_ptrs, state.to(states_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit
def _norm_inputs(z_row, weight_ptr, dim, BLOCK_D: tl.constexpr):
    """A head's z row and the output norm's weight, as `_head_norm` takes them (zeros past
    dim)."""
    dims = tl.arange(0, BLOCK_D)
    z = tl.load(z_row + dims, mask=dims < dim, other=0.0)
    return z, tl.load(weight_ptr + dims, mask=dims < dim, other=0.0)


@triton.jit
def _gates_from_x(
    x_row,
    b_row,
    a_row,
    head_mask,
    A_log,
    dt_bias,
    HIDDEN: tl.constexpr,
    BLOCK_HIDDEN: tl.constexpr,
    X_THROUGH_L2: tl.constexpr,
):
    """One token's (decay, beta) of a head from its x row and b|a weight rows, as the gates
    kernel computes them (beta rounded to x's dtype, as that kernel stores it)."""
    b = tl.sum(_x_dot_rows(x_row, b_row, head_mask, HIDDEN, 1, BLOCK_HIDDEN, X_THROUGH_L2), 0)
    a = tl.sum(_x_dot_rows(x_row, a_row, head_mask, HIDDEN, 1, BLOCK_HIDDEN, X_THROUGH_L2), 0)
    decay = tl.exp(_log_decay(a, A_log, dt_bias))
    return decay, tl.sigmoid(b).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _head_norm(
    o,
    z,
    weight,
    normed_ptr,
    token,
    head,
    heads,
    dim,
    eps,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    ROUND_SCALED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
):
    """One head's GDN output norm of one token, as `gated_rms_norm_triton` computes it (the
    same roundings), from o [BLOCK_D] as the rule stored it, the head's z and the norm weight
    (all fp32; zeros past dim; read by the caller, which asks for them early), written to row
    `token` of normed [tokens, heads * dim] with its integer-GEMV codes (SPLIT_BITS 0: none)."""
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    dtype = normed_ptr.dtype.element_ty
    inv_rms = tl.rsqrt(tl.sum(o * o, axis=0) / dim + eps)
    normed = (o * inv_rms).to(dtype).to(tl.float32)
    scaled = weight * normed
    if ROUND_SCALED:
        scaled = scaled.to(dtype).to(tl.float32)
    out = (scaled * (z * tl.sigmoid(z))).to(dtype)
    tl.store(normed_ptr + token * heads * dim + head * dim + cols, out, mask=mask)
    if SPLIT_BITS != 0:
        split_block(
            out,
            heads * dim,
            head,
            token,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            BLOCK_D,
            SPLIT_BITS,
            SPLIT_GROUP,
        )


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
    states: fp32 or bf16 [num_slots, Hv, dk, dv] (contiguous per slot), read and updated in
    place.
    Returns o: [T, Hv, dv] in v's dtype."""
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta need unit stride along heads")
    return _launch(q, k, v, states, state_slots, query_start, g=g, beta=beta)


def recurrent_gated_delta_rule_normed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> HeadNormedRows:
    """`recurrent_gated_delta_rule` with the GDN output norm (gate z [T, Hv, dv], unit stride
    along dv; weight [dv]) folded into its output, for the out projection to finish
    (`norm_fold.HeadNormedRows`, the sums over the kernel's column blocks)."""
    if g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError("g and beta need unit stride along heads")
    if z.shape != v.shape or z.stride(2) != 1 or norm_weight.shape != (v.shape[2],):
        raise ValueError(f"gate {tuple(z.shape)} or norm weight does not match o {tuple(v.shape)}")
    fold = (z, norm_weight.contiguous(), eps)
    return _launch(q, k, v, states, state_slots, query_start, g=g, beta=beta, fold=fold)


def recurrent_gated_delta_rule_from_x(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    norm_last: tuple | None = None,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule` with g and beta those `gdn_gates_triton.gdn_gates_from_x`
    computes from x [T, hidden] and ba_weight [2Hv, hidden] (b rows over a rows), of x's dtype
    with unit stride along hidden. Meant for decode-sized T, as that kernel is. `norm_last`:
    `recurrent_gated_delta_rule_from_x_normed`'s."""
    hidden = x.shape[1]
    if tuple(ba_weight.shape) != (2 * v.shape[1], hidden):
        raise ValueError(
            f"b|a weight {tuple(ba_weight.shape)} does not match {v.shape[1]} value heads "
            f"and hidden size {hidden}"
        )
    if x.stride(1) != 1 or ba_weight.stride(1) != 1:
        raise ValueError("gdn gates from x need unit stride along hidden")
    if ba_weight.dtype != x.dtype:
        raise ValueError(f"b|a weight in {ba_weight.dtype}, input in {x.dtype}")
    return _launch(
        q,
        k,
        v,
        states,
        state_slots,
        query_start,
        x=x,
        ba_weight=ba_weight,
        A_log=A_log,
        dt_bias=dt_bias,
        norm_last=norm_last,
    )


def recurrent_gated_delta_rule_from_x_normed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    split: SplitRequest | None = None,
) -> torch.Tensor | None:
    """`recurrent_gated_delta_rule_from_x` at one token, followed by the GDN output norm in the
    same kernel: each head's last column block runs the norm of the head's o (`_head_norm`),
    once the head's o is in its mailbox (`NORM_MAILBOX`), or the block that arrives last at
    the head's counter does, so the norm's launch goes. Returns the norm's output
    [1, Hv, dv] with the codes `split` asks for attached, bit for bit what
    `gated_rms_norm_triton.gated_rms_norm` gives for the rule's o; None where it does not take
    the step (a head in more than `NORM_LAST_MAX_BLOCKS` column blocks, more than one token,
    z [T, Hv, dv] without unit stride along dv, a weight not [dv], or no arrival counters at
    hand, as inside a graph capture that would allocate them): the caller then runs the rule
    and the norm apart."""
    heads, dim = v.shape[1], v.shape[2]
    counters = tile_counters(v.device, heads)
    mailbox = None
    if NORM_MAILBOX and v.element_size() == 2:  # a 16-bit o fits a word with its mark
        mailbox = zeroed_once(_mailboxes, v.device, NORM_MAILBOX_WORDS, torch.int32, heads * dim)
    blocks = triton.cdiv(dim, _block_v(state_slots.shape[0], heads, dim, v.device))
    if (
        blocks > NORM_LAST_MAX_BLOCKS
        or v.shape[0] != 1
        or state_slots.shape[0] != 1
        or z.shape != v.shape
        or z.stride(2) != 1
        or norm_weight.shape != (dim,)
        or counters is None
    ):
        return None
    normed = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    buffers = None
    if next_power_of_2(dim) == dim:
        buffers = producer_buffers(split, 1, heads * dim, v.device, dim)
    norm_last = (z, norm_weight.contiguous(), eps, normed, counters, mailbox, split, buffers)
    recurrent_gated_delta_rule_from_x(
        q, k, v, x, ba_weight, A_log, dt_bias, states, state_slots, query_start, norm_last
    )
    if buffers is not None:
        attach(normed, split, buffers)
    return normed


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    ba_weight: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    fold: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    norm_last: tuple | None = None,
) -> torch.Tensor | HeadNormedRows:
    """The kernel with the gates given (g, beta) or computed from x (x, ba_weight, A_log,
    dt_bias); the other set None. With `fold` (z, the norm's weight, eps) the output norm is
    folded in (`recurrent_gated_delta_rule_normed`); with `norm_last` each head's last block
    runs it (`recurrent_gated_delta_rule_from_x_normed`)."""
    num_value_heads, value_dim = v.shape[1], v.shape[2]
    key_dim = q.shape[2]
    if states.dtype not in STATE_DTYPES or states.stride(3) != 1 or states.stride(2) != value_dim:
        raise ValueError("GDN states must be fp32 or bf16 with contiguous [dk, dv] per head")
    for operand in (q, k, v):
        if operand.stride(2) != 1:
            raise ValueError("q, k, v need unit stride along the head dimension")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = state_slots.shape[0]
    max_block, warps, registers = MAX_BLOCK_V, RECURRENT_WARPS, None
    if x is None and num_seqs > 1:
        max_block, warps, registers = SEQS_SETTING
    block_v = _block_v(num_seqs, num_value_heads, value_dim, v.device, max_block)
    blocks = triton.cdiv(value_dim, block_v)
    z = norm_weight = squares = out  # unused unless folding
    if fold is not None:
        z, norm_weight, eps = fold
        if value_dim % block_v:
            raise ValueError(f"column blocks of {block_v} do not tile a head of {value_dim}")
        squares = torch.empty(v.shape[0], num_value_heads, blocks, device=v.device)
    normed = counters = mailbox = out
    norm_eps, round_scaled, split, buffers = 0.0, False, None, None
    if norm_last is not None:
        z, norm_weight, norm_eps, normed, counters, mailbox, split, buffers = norm_last
        round_scaled = torch.promote_types(norm_weight.dtype, v.dtype) == v.dtype
    split_args, split_constants = split_launch_args(split, buffers, out, value_dim)
    if num_seqs == 0 or v.shape[0] == 0:
        return out if fold is None else _head_normed(out, squares, eps)
    from_x = x is not None
    grid = (num_seqs, num_value_heads, blocks)
    _recurrent_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        x,
        ba_weight,
        A_log,
        dt_bias,
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
        0 if from_x else g.stride(0),
        0 if from_x else beta.stride(0),
        x.stride(0) if from_x else 0,
        ba_weight.stride(0) if from_x else 0,
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        key_dim**-0.5,
        key_dim,
        value_dim,
        num_value_heads,
        z,
        z.stride(0),
        z.stride(1),
        norm_weight,
        squares,
        normed,
        counters,
        counters if mailbox is None else mailbox,
        norm_eps,
        *split_args,
        RATIO=num_value_heads // q.shape[1],
        BLOCK_K=next_power_of_2(key_dim),
        BLOCK_V=block_v,
        GATES_FROM_X=from_x,
        HIDDEN=x.shape[1] if from_x else 0,
        BLOCK_HIDDEN=HIDDEN_BLOCK,
        STATE_FIRST=num_seqs <= STATE_FIRST_MAX_SEQS,
        NORM_EARLY=NORM_INPUTS_EARLY,
        GATES_FIRST=from_x
        and GATES_BEFORE_WAIT
        and num_seqs <= STATE_FIRST_MAX_SEQS
        and v.shape[0] == 1,
        FOLD_NORM=fold is not None,
        NORM_LAST=norm_last is not None,
        MAILBOX=norm_last is not None and mailbox is not None,
        ROUND_SCALED=round_scaled,
        BLOCK_D=next_power_of_2(value_dim),
        **split_constants,
        num_warps=warps,
        **({"maxnreg": registers} if registers else {}),
        **pdl_options(q.device),
    )
    return out if fold is None else _head_normed(out, squares, eps)


def _block_v(
    num_seqs: int,
    num_value_heads: int,
    value_dim: int,
    device: torch.device,
    max_block: int = MAX_BLOCK_V,
) -> int:
    """A program's columns of a head, at most max_block: narrower when few sequences, so that
    the grid still covers the SMs."""
    block_v = min(next_power_of_2(value_dim), max_block)
    while block_v > 16 and num_seqs * num_value_heads * (value_dim // block_v) < num_sms(device):
        block_v //= 2
    return block_v


def _head_normed(out: torch.Tensor, squares: torch.Tensor, eps: float) -> HeadNormedRows:
    tokens, heads, dim = out.shape
    return HeadNormedRows(out.view(tokens, heads * dim), squares, dim, eps)

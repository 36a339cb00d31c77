"""The MoE router product and the routing in one Triton kernel, for decode: it saves a launch
per MoE layer in a decode step that is launch-bound (cuBLAS's GEMV of the router stacked with
the shared expert's gate, then the routing kernel of `moe_routing_triton`, took two).

Program (t, b) computes the dot products of x[t] with its block of router rows as the GDN
gates' kernels do (`gdn_gates_triton._x_dot_rows`: fp32 sums rounded to x's dtype, as F.linear's
output is) and stores them into token t's row of logits. Token t's last program routes it on
the whole row (`route_token`, the routing kernel's own code) once every expert's logit is in:
- with the mailbox (`ROUTE_MAILBOX`), each program also writes its experts' logits into t's
  row of a mailbox kept at zero, each as one 64-bit word of the logit's bits and a mark, and
  the last program by index polls the row until every word is marked, routes on the logits
  the words carry and zeroes the row. The last logit's store then reaches the routing in about
  one memory round trip;
- else each program bumps t's arrival counter and the program that arrives last reads the row
  back and resets the counter: a fence, the atomic and the read are three round trips. The
  counters, and the order of stores, barrier and atomic, are the split-K GEMV's
  (`groupwise_gemv_triton.tile_counters`).
Where neither can be had (first asked for inside a graph capture) the product and the routing
run as two launches. On the H200 the mailbox took the 35B-A3B q4 C=1 decode step from
1.64-1.65 to 1.60 ms (docs/performance.md, Measurement 33). The fp32 summation order is not
cuBLAS's, so a logit can differ from the unfused path's in its last bit, and the chosen
experts then differ at near-ties only.

`moe_norm_router_route` also runs the RMSNorm(+residual) before the MoE block in the same
kernel: one launch fewer per MoE layer (the 35B-A3B C=1 decode step 1.84 -> 1.79-1.80 ms on the
H200, docs/performance.md, Measurement 17). Every program norms its token's row itself for its
dots, rounded as the norm kernel rounds it, and the first programs write the norm's outputs.
References: `moe_router.moe_router_route`, `moe_router.moe_norm_router_route` (same
signatures, but for the norm's `split`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.gdn_gates_triton import _x_dot_rows
from ninfer.kernels.groupwise_gemv_triton import tile_counters, zeroed_once
from ninfer.kernels.moe_router import check_router
from ninfer.kernels.moe_routing import Routes
from ninfer.kernels.moe_routing_triton import ROUTE_WARPS, empty_routes, moe_route, route_token
from ninfer.kernels.pdl_triton import COUNTER_RESET_SEM, await_inputs, pdl_options
from ninfer.kernels.rms_norm_triton import (
    norm_part,
    norm_part_inputs,
    norm_part_weight,
    rms_norm,
)
from ninfer.kernels.triton_support import next_power_of_2
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

# Router rows per program: one spreads 35B-A3B's 257 rows (256 experts and the shared gate)
# over 257 programs per token, each reading 4 KiB of weight. On the H200 at one token the
# kernel took 5.9 us against 6.8 us at two rows (8.2 at eight), and the 35B-A3B C=1 step
# 1.89 ms against 1.92 (bench/decode_kernels.md). Columns per step: 512, 16 per thread and
# row with the routing's one warp (ROUTE_WARPS, which the last arrival needs); hidden 2048 is
# four unrolled steps.
ROWS_PER_PROGRAM = 1
BLOCK_K = 512
# With the norm inside: groups of the normed row (and of its codes) each of the first programs
# writes once it has counted. Its one warp writes them while the last program routes.
NORM_PART_GROUPS = 16
# Each program holds the whole row (one warp: the routing's): up to 4096 values compile for
# sm_90 without spilling (168 registers; 96 at 35B-A3B's 2048). Wider rows take the norm
# kernel, then the router.
NORM_MAX_HIDDEN = 4096
ALL_STAGES = (True, True, True)
# The routing waits on a mailbox, not an arrival counter (above). A poller spins only on
# programs that wait on nothing, so it cannot hold back what it waits for; the highest index
# also runs last under Triton's interpreter, which runs programs one by one in order. Like
# the counters, a device's mailbox serves one kernel at a time (the engine's one stream).
ROUTE_MAILBOX = True
# With the norm inside, each program reads its router row before the wait (the kernel's
# NORM path): on the H200 the 35B-A3B C=1 step took 1.41 ms with it against 1.42 after the
# wait, at the edge of the spread (docs/performance.md, Measurement 35).
ROWS_BEFORE_WAIT = True
MAILBOX_WORDS = 1 << 16
_mailboxes: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _moe_router_route_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    counters_ptr,
    mailbox_ptr,
    weights_ptr,
    experts_ptr,
    pair_tokens_ptr,
    pair_experts_ptr,
    pairs_ptr,
    num_rows,
    num_experts,
    stride_x,
    stride_w,
    first,
    count,
    residual_ptr,
    stride_residual,
    norm_weight_ptr,
    eps,
    normed_ptr,
    sum_ptr,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    SHARED: tl.constexpr,
    DOTS: tl.constexpr,
    COUNT: tl.constexpr,
    ROUTE: tl.constexpr,
    MAILBOX: tl.constexpr,
    NORM: tl.constexpr,
    ROWS_BEFORE_WAIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    SPLIT_BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
):
    """DOTS, COUNT, ROUTE: its three stages, all on but where `python bench/decode_variants.py`
    times it with some left out (without COUNT, program 0 stands for the last to arrive).
    NORM: x is the attention's output and the router's input is RMSNorm(x + residual), which
    every program computes for its dots from the whole row (BLOCK_H wide, rounded as the norm
    kernel rounds it); programs 0, 1, ... also write the norm's outputs, a part each
    (`rms_norm_triton.norm_part`), once they have counted, so the routing does not wait for
    them. DOTS applies without NORM only."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    logits_row = logits_ptr + token.to(tl.int64) * num_rows
    x_row = x_ptr + token.to(tl.int64) * stride_x
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    if NORM:
        # Weights, which no kernel writes, are read before the wait
        # (`pdl_triton.READ_BEFORE_WAIT`), as stored: the norm weight and, with
        # ROWS_BEFORE_WAIT, the router row.
        cols = tl.arange(0, BLOCK_H)
        live = cols < HIDDEN
        w_mask = row_mask[:, None] & live[None, :]
        if ROWS_BEFORE_WAIT:
            w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)
        norm_weight = tl.load(norm_weight_ptr + cols, mask=live, other=0.0)
    await_inputs(PDL)
    if NORM:
        # One pass over the row: the router row's load is issued with x's and the residual's,
        # so its memory round trip overlaps their reads from L2 and the sum of squares (two
        # passes, the norm first and then `_x_dot_rows`, took 8.8 us against 7.8 on the H200).
        residual_row = residual_ptr + token.to(tl.int64) * stride_residual
        if not ROWS_BEFORE_WAIT:
            w = tl.load(w_rows + cols[None, :], mask=w_mask, other=0.0)
        x = tl.load(x_row + cols, mask=live, other=0.0).to(tl.float32)
        residual = tl.load(residual_row + cols, mask=live, other=0.0).to(tl.float32)
        total = (x + residual).to(sum_ptr.dtype.element_ty).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(total * total, axis=0) / HIDDEN + eps)  # as the norm kernel's
        scale = 1.0 + norm_weight.to(tl.float32)
        normed = (total * inv_rms * scale).to(normed_ptr.dtype.element_ty).to(tl.float32)
        dots = tl.sum(w.to(tl.float32) * normed[None, :], axis=1)
        tl.store(logits_row + rows, dots.to(logits_ptr.dtype.element_ty), mask=row_mask)
    elif DOTS:
        dots = _x_dot_rows(x_row, w_rows, row_mask, HIDDEN, BLOCK_ROWS, BLOCK_K)
        tl.store(logits_row + rows, dots.to(logits_ptr.dtype.element_ty), mask=row_mask)
    counter = counters_ptr + token
    mailbox_row = mailbox_ptr + token.to(tl.int64) * num_experts
    if MAILBOX:  # (with all three stages)
        # the logit as stored, widened to fp32, in the high half; the mark in the low one
        bits = dots.to(logits_ptr.dtype.element_ty).to(tl.float32).to(tl.int32, bitcast=True)
        word = (bits.to(tl.int64) << 32) | 1
        tl.atomic_xchg(
            mailbox_row + rows, word, mask=row_mask & (rows < num_experts), sem="relaxed"
        )
        last = tl.program_id(1) == tl.num_programs(1) - 1
    elif COUNT:
        tl.debug_barrier()  # every thread's logits are written before the arrival counts
        last = tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(1) - 1
    else:
        last = tl.program_id(1) == 0
    if last:
        if ROUTE:
            ids = tl.arange(0, BLOCK_E)
            experts = ids < num_experts
            if MAILBOX:
                box = mailbox_row + ids
                words = tl.load(box, mask=experts, other=1, volatile=True)
                while tl.min((words & 1).to(tl.int32), axis=0) == 0:
                    words = tl.load(box, mask=experts, other=1, volatile=True)
                tl.store(box, tl.zeros_like(words), mask=experts)  # for the next call
                carried = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
                logits = tl.where(experts, carried, float("-inf"))
            else:
                # .cg reads from L2, where the other programs' logits are
                logits = tl.load(
                    logits_row + ids, mask=experts, other=float("-inf"), cache_modifier=".cg"
                ).to(tl.float32)
            route_token(
                logits,
                token,
                tl.num_programs(0),
                num_experts,
                weights_ptr,
                experts_ptr,
                pair_tokens_ptr,
                pair_experts_ptr,
                pairs_ptr,
                first,
                count,
                TOP_K,
                BLOCK_E,
                BLOCK_TOP,
                SHARED,
            )
        if COUNT and not MAILBOX:
            tl.atomic_xchg(counter, 0, sem=COUNTER_RESET_SEM)
    if NORM:
        if tl.program_id(1) * SPLIT_BLOCK_G * SPLIT_GROUP < HIDDEN:
            part_weight = norm_part_weight(
                norm_weight_ptr, tl.program_id(1), HIDDEN, SPLIT_GROUP, SPLIT_BLOCK_G
            )
            inputs = norm_part_inputs(
                x_row, residual_row, part_weight, tl.program_id(1), HIDDEN, True, SPLIT_GROUP,
                SPLIT_BLOCK_G,
            )  # fmt: skip
            norm_part(
                inputs,
                normed_ptr + token.to(tl.int64) * HIDDEN,
                sum_ptr + token.to(tl.int64) * HIDDEN,
                inv_rms,
                tl.program_id(1),
                HIDDEN,
                token,
                xq_ptr,
                corr_ptr,
                xscale_ptr,
                True,
                SPLIT_BITS,
                SPLIT_GROUP,
                SPLIT_BLOCK_G,
            )


def moe_router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
    stages: tuple[bool, bool, bool] = ALL_STAGES,
) -> tuple[Routes, torch.Tensor]:
    """Same contract as `moe_router.moe_router_route`; x and router_weight of one dtype with
    unit stride along hidden. Meant for decode-sized T: each token re-reads the whole router.
    `stages` (the dots, the arrival counter, the routing) are for timing the kernel with some
    left out; the results are then not the routes."""
    _check(x, router_weight, num_experts)
    counters = tile_counters(x.device, x.shape[0])
    if counters is None:  # none yet inside a graph capture: the product, then the routing
        logits = F.linear(x, router_weight)
        return moe_route(logits[:, :num_experts], top_k, x.dtype, first, count, shared), logits
    args = (num_experts, top_k, first, count, shared, stages)
    return _launch(x, router_weight, counters, *args)


def moe_norm_router_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
    split: SplitRequest | None = None,
) -> tuple[Routes, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `moe_router.moe_norm_router_route`: the norm runs inside the router's
    kernel (one launch for both), and the normed rows carry their integer-GEMV codes where
    `split` asks for them, as the norm kernel's do. x, residual and router weight in one
    dtype with unit stride along hidden; the norm weight contiguous, of any float dtype."""
    _check(x, router_weight, num_experts)
    tokens, hidden = x.shape
    if residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} is not x's {tuple(x.shape)} rows")
    if norm_weight.shape != (hidden,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} is not one of {hidden} values")
    counters = tile_counters(x.device, tokens)
    if counters is None or hidden > NORM_MAX_HIDDEN:  # (none yet inside a graph capture)
        normed, total = rms_norm(x, norm_weight, eps, residual, split)
        return (
            *moe_router_route(normed, router_weight, num_experts, top_k, first, count, shared),
            normed,
            total,
        )
    normed = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    total = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    buffers = producer_buffers(split, tokens, hidden, x.device)
    split_args, split_constants = split_launch_args(split, buffers, normed)
    # the first programs write a part each: as many groups a part as a token's programs need
    groups, part_groups = triton.cdiv(hidden, split_constants["SPLIT_GROUP"]), NORM_PART_GROUPS
    programs = triton.cdiv(router_weight.shape[0], ROWS_PER_PROGRAM)
    while triton.cdiv(groups, part_groups) > programs:
        part_groups *= 2
    split_constants["SPLIT_BLOCK_G"] = part_groups
    norm = (residual, residual.stride(0), norm_weight, eps, normed, total, *split_args)
    constants = {"NORM": True, "BLOCK_H": next_power_of_2(hidden), **split_constants}
    constants["ROWS_BEFORE_WAIT"] = ROWS_BEFORE_WAIT
    args = (num_experts, top_k, first, count, shared, ALL_STAGES)
    routes, logits = _launch(x, router_weight, counters, *args, norm, constants)
    if buffers is not None:
        attach(normed, split, buffers)
    return routes, logits, normed, total


def _check(x: torch.Tensor, router_weight: torch.Tensor, num_experts: int) -> None:
    check_router(x, router_weight, num_experts)
    if x.stride(1) != 1 or router_weight.stride(1) != 1:
        raise ValueError("the fused router needs unit stride along hidden")
    if router_weight.dtype != x.dtype:
        raise ValueError(f"router weight in {router_weight.dtype}, input in {x.dtype}")


def _launch(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    counters: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool,
    stages: tuple[bool, bool, bool],
    norm: tuple | None = None,
    norm_constants: dict | None = None,
) -> tuple[Routes, torch.Tensor]:
    """The kernel over x's tokens; `norm`: the norm's arguments (residual ... split buffers)
    and their constants, or None (NORM off; x stands for each pointer)."""
    tokens, hidden = x.shape
    num_rows = router_weight.shape[0]
    logits = torch.empty(tokens, num_rows, dtype=x.dtype, device=x.device)
    routes = empty_routes(tokens, top_k, x.dtype, x.device, shared)
    if norm is None:
        norm = (x, 0, x, 0.0, x, x, x, x, x)
        norm_constants = {"NORM": False, "BLOCK_H": 1, "SPLIT_BITS": 0, "SPLIT_GROUP": 1}
        norm_constants["ROWS_BEFORE_WAIT"] = False
        norm_constants["SPLIT_BLOCK_G"] = 1
    mailbox = None
    if ROUTE_MAILBOX and stages == ALL_STAGES:
        mailbox = zeroed_once(
            _mailboxes, x.device, MAILBOX_WORDS, torch.int64, tokens * num_experts
        )
    if tokens:
        _moe_router_route_kernel[(tokens, triton.cdiv(num_rows, ROWS_PER_PROGRAM))](
            x,
            router_weight,
            logits,
            counters,
            counters if mailbox is None else mailbox,
            *routes,
            num_rows,
            num_experts,
            x.stride(0),
            router_weight.stride(0),
            first,
            count,
            *norm,
            HIDDEN=hidden,
            BLOCK_ROWS=ROWS_PER_PROGRAM,
            BLOCK_K=BLOCK_K,
            TOP_K=top_k,
            BLOCK_E=next_power_of_2(num_experts),
            BLOCK_TOP=next_power_of_2(top_k),
            SHARED=shared,
            DOTS=stages[0],
            COUNT=stages[1],
            ROUTE=stages[2],
            MAILBOX=mailbox is not None,
            **norm_constants,
            num_warps=ROUTE_WARPS,
            **pdl_options(x.device),
        )
    return routes, logits

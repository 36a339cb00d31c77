"""The MoE router product and the routing in one Triton kernel, for decode: it saves a launch
per MoE layer in a decode step that is launch-bound (cuBLAS's GEMV of the router stacked with
the shared expert's gate, then the routing kernel of `moe_routing_triton`, took two).

Program (t, b) computes the dot products of x[t] with its block of router rows as the GDN
gates' kernels do (`gdn_gates_triton._x_dot_rows`: fp32 sums rounded to x's dtype, as F.linear's
output is) and stores them into token t's row of logits; then it bumps t's arrival counter,
and the program that arrives last routes the token on the whole row (`route_token`, the
routing kernel's own code) and resets the counter. The counters, and the order of stores,
barrier and atomic, are the split-K GEMV's (`groupwise_gemv_triton.tile_counters`); where they
cannot be had (first asked for inside a graph capture) the product and the routing run as two
launches. The fp32 summation order is not cuBLAS's, so a logit can differ from the unfused
path's in its last bit, and the chosen experts then differ at near-ties only.
Reference: `moe_router.moe_router_route` (same signature)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ninfer.kernels.gdn_gates_triton import _x_dot_rows
from ninfer.kernels.groupwise_gemv_triton import tile_counters
from ninfer.kernels.moe_router import check_router
from ninfer.kernels.moe_routing import Routes
from ninfer.kernels.moe_routing_triton import ROUTE_WARPS, empty_routes, moe_route, route_token
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

# Router rows per program: one spreads 35B-A3B's 257 rows (256 experts and the shared gate)
# over 257 programs per token, each reading 4 KiB of weight. On the H200 at one token the
# kernel took 5.9 us against 6.8 us at two rows (8.2 at eight), and the 35B-A3B C=1 step
# 1.89 ms against 1.92 (bench/decode_kernels.md). Columns per step: 512, 16 per thread and
# row with the routing's one warp (ROUTE_WARPS, which the last arrival needs); hidden 2048 is
# four unrolled steps.
ROWS_PER_PROGRAM = 1
BLOCK_K = 512


@triton.jit
def _moe_router_route_kernel(
    x_ptr,
    w_ptr,
    logits_ptr,
    counters_ptr,
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
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SHARED: tl.constexpr,
    DOTS: tl.constexpr,
    COUNT: tl.constexpr,
    ROUTE: tl.constexpr,
    PDL: tl.constexpr,
):
    """DOTS, COUNT, ROUTE: its three stages, all on but where `python bench/decode_variants.py`
    times it with some left out (without COUNT, program 0 stands for the last to arrive)."""
    await_inputs(PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < num_rows
    logits_row = logits_ptr + token.to(tl.int64) * num_rows
    if DOTS:
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
        x_row = x_ptr + token.to(tl.int64) * stride_x
        dots = _x_dot_rows(x_row, w_rows, row_mask, HIDDEN, BLOCK_ROWS, BLOCK_K)
        tl.store(logits_row + rows, dots.to(logits_ptr.dtype.element_ty), mask=row_mask)
    counter = counters_ptr + token
    if COUNT:
        tl.debug_barrier()  # every thread's logits are written before the arrival counts
        last = tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(1) - 1
    else:
        last = tl.program_id(1) == 0
    if last:
        if ROUTE:
            ids = tl.arange(0, BLOCK_E)
            # .cg reads from L2, where the other programs' logits are
            logits = tl.load(
                logits_row + ids, mask=ids < num_experts, other=float("-inf"), cache_modifier=".cg"
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
                SHARED,
            )
        if COUNT:
            tl.atomic_xchg(counter, 0)


def moe_router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
    stages: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Routes, torch.Tensor]:
    """Same contract as `moe_router.moe_router_route`; x and router_weight of one dtype with
    unit stride along hidden. Meant for decode-sized T: each token re-reads the whole router.
    `stages` (the dots, the arrival counter, the routing) are for timing the kernel with some
    left out; the results are then not the routes."""
    check_router(x, router_weight, num_experts)
    if x.stride(1) != 1 or router_weight.stride(1) != 1:
        raise ValueError("the fused router needs unit stride along hidden")
    if router_weight.dtype != x.dtype:
        raise ValueError(f"router weight in {router_weight.dtype}, input in {x.dtype}")
    tokens, hidden = x.shape
    num_rows = router_weight.shape[0]
    counters = tile_counters(x.device, tokens)
    if counters is None:  # none yet inside a graph capture: the product, then the routing
        logits = F.linear(x, router_weight)
        return moe_route(logits[:, :num_experts], top_k, x.dtype, first, count, shared), logits
    logits = torch.empty(tokens, num_rows, dtype=x.dtype, device=x.device)
    routes = empty_routes(tokens, top_k, x.dtype, x.device, shared)
    if tokens:
        _moe_router_route_kernel[(tokens, triton.cdiv(num_rows, ROWS_PER_PROGRAM))](
            x,
            router_weight,
            logits,
            counters,
            *routes,
            num_rows,
            num_experts,
            x.stride(0),
            router_weight.stride(0),
            first,
            count,
            HIDDEN=hidden,
            BLOCK_ROWS=ROWS_PER_PROGRAM,
            BLOCK_K=BLOCK_K,
            TOP_K=top_k,
            BLOCK_E=next_power_of_2(num_experts),
            SHARED=shared,
            DOTS=stages[0],
            COUNT=stages[1],
            ROUTE=stages[2],
            num_warps=ROUTE_WARPS,
            **pdl_options(x.device),
        )
    return routes, logits

"""Comparisons behind settings and choices of the decode kernels, on the GPU (random
inputs, CUDA-graph replay, median; weights rotated over sets larger than the L2):

- the warps of the one-token norm (`rms_norm_triton`) and routing (`moe_routing_triton`)
  programs, which are latency and not bandwidth (docs/performance.md, Measurement 8);
- the column block and warps of the GDN decode kernel (`gdn_recurrent_triton`, b|a product
  and gates inside) at one token, beside the one-token cost of the small kernels around it
  (gated norm, conv, SwiGLU) that folding into a neighbour would save (Measurement 9); and
  at eight sequences, against the rate of copy (states rotated beyond the L2), and there, as
  several lanes run it (gates given, output norm folded), at its register caps;
- at the 35B-A3B shapes, one token: the fused router stage by stage (the kernel with its dot
  products, arrival counter or routing left out), with the norm before it inside or apart,
  the experts' down product with the MoE combine inside or apart, the router's rows per
  program (`moe_router_triton`) and the integer GEMV's rows per program, words per step and
  warps at the expert products (nine pairs, the shared expert stacked) and the dense products;
- at the 27B shapes, one token: the same integer GEMV settings at every product of a layer
  and the head;
- the one-row integer GEMV's time against its rows (so its programs per SM) at two K, its
  weights from DRAM (rotated) and held in the L2 (one weight again and again), and the time
  one dependent launch of a trivial kernel adds to a chain inside a CUDA graph, with and
  without programmatic dependent launch (docs/performance.md, Measurement 21);
- the q4 product at two to eight x rows in Gluon (`groupwise_gemv_gluon`) against the Triton
  tensor-core kernel, at its rows per program, ring slots and the programs per SM that K is
  split for (bench/decode_kernels.md, "The q4 product at eight rows in Gluon"), and the 27B
  products at eight rows as the C=8 step calls them at each of those settings
  (`gluon_q4_settings_at_eight_rows`; a `*` marks the shipped one);
- torch's int4 tensor-core product (`torch.ops.aten._weight_int4pack_mm`, weights prepared by
  `_convert_weight_to_int4pack`) against our q4 GEMVs at the 27B shapes, one to sixteen x rows
  (bench/decode_kernels.md, "torch's int4 tensor-core kernel against ours").

    python bench/decode_variants.py [--skip-int4pack] [--only NAME] [--warps 2,4,8]
"""

from __future__ import annotations

import argparse
import math
from functools import partial

import torch
import triton
import triton.language as tl
from decode_kernels import rotating  # this folder: the scripts run as `python bench/...`
from triton.testing import do_bench_cudagraph

from ninfer.bench.ceilings import copy_bandwidth
from ninfer.kernels import (
    causal_conv1d_triton,
    gated_rms_norm_triton,
    gdn_gates_triton,
    gdn_recurrent_triton,
    groupwise_gemv_triton,
    moe_combine_triton,
    moe_router_triton,
    moe_routing_triton,
    rms_norm_triton,
    swiglu_triton,
)
from ninfer.kernels.moe_routing_triton import moe_route
from ninfer.kernels.pdl_triton import await_inputs
from ninfer.kernels.x_split import SplitRequest
from ninfer.quant import EncodedTensor, get_format

DEVICE = "cuda"
BF16 = torch.bfloat16
Q4, Q8, Q6 = get_format("q4_g64_fp16"), get_format("q8_g32_fp16"), get_format("q6_g64_fp16")
# 27B q4 products: MLP gate|up, MLP down, GDN out_proj, GDN qkv|z
GEMV_SHAPES = ((34816, 5120), (5120, 17408), (5120, 6144), (16384, 5120))
# Warps the integer GEMV sweeps try.
SWEEP_WARPS = (2, 4, 8)


def median_us(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def norm_and_routing_warps() -> None:
    print(f"{'one-token kernel':40} {'warps':>5} {'us':>7}")
    split = SplitRequest.for_format("q4_g64_fp16")
    defaults = rms_norm_triton.NORM_ELEMENTS_PER_WARP, rms_norm_triton.NORM_DECODE_MAX_WARPS
    rms_norm_triton.NORM_DECODE_MAX_WARPS = 16
    for dim in (5120, 2048):
        x = torch.randn(1, dim, device=DEVICE, dtype=BF16)
        residual, weight = torch.randn_like(x), torch.randn(dim, device=DEVICE, dtype=BF16)
        for per_warp in (2048, 1024, 512, 256):
            rms_norm_triton.NORM_ELEMENTS_PER_WARP = per_warp
            warps = min(16, max(1, rms_norm_triton.next_power_of_2(dim) // per_warp))
            us = median_us(
                lambda x=x, w=weight, r=residual: rms_norm_triton.rms_norm(x, w, 1e-6, r, split)
            )
            print(f"{f'rms_norm + residual + split, 1 x {dim}':40} {warps:5d} {us:7.2f}")
    rms_norm_triton.NORM_ELEMENTS_PER_WARP, rms_norm_triton.NORM_DECODE_MAX_WARPS = defaults
    default_warps = moe_routing_triton.ROUTE_WARPS
    for tokens in (1, 8):
        logits = torch.randn(tokens, 256, device=DEVICE, dtype=BF16)
        for warps in (1, 2, 4):
            moe_routing_triton.ROUTE_WARPS = warps
            us = median_us(lambda z=logits: moe_routing_triton.moe_route(z, 8, BF16, 0, 256, True))
            print(f"{f'moe_route T={tokens}, 256 experts, top 8':40} {warps:5d} {us:7.2f}")
    moe_routing_triton.ROUTE_WARPS = default_warps


def gdn_decode_kernels() -> None:
    """One token at the 27B (48 value heads, hidden 5120, MLP 17408) and 35B-A3B (32, 2048,
    shared expert 512) shapes, 16 key heads, dk = dv = 128."""
    print(f"{'one-token GDN-layer kernel':48} {'us':>7}")
    for shape in (("27B", 5120, 48, 17408), ("35B-A3B", 2048, 32, 512)):
        _gdn_decode_kernels_at(*shape)


def _eight_sequences():
    """A GDN layer's decode inputs at eight sequences of one token, 27B shape: (q, k, v, x,
    b|a weight, A_log, dt_bias, fp32 states, slot sets, query starts), the states spread
    over eight slot sets (eight sequences' states of a layer, 25 MB, would fit in the L2)."""
    dim, key_heads, value_heads, hidden, seqs, sets = 128, 16, 48, 5120, 8, 8

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(BF16)

    states = torch.randn(sets * seqs, value_heads, dim, dim, device=DEVICE) * 0.1
    slot_sets = [
        torch.arange(i * seqs, (i + 1) * seqs, device=DEVICE, dtype=torch.int32)
        for i in range(sets)
    ]
    query_start = torch.arange(seqs + 1, device=DEVICE, dtype=torch.int32)
    q, k = randn(seqs, key_heads, dim), randn(seqs, key_heads, dim)
    v, x = randn(seqs, value_heads, dim), randn(seqs, hidden)
    ba_weight = randn(2 * value_heads, hidden, scale=0.02)
    A_log = torch.randn(value_heads, device=DEVICE)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    return q, k, v, x, ba_weight, A_log, dt_bias, states, slot_sets, query_start


def _eight_sequences_moved(states: torch.Tensor) -> int:
    """Bytes one call moves: each of one slot set's states read and written, fp32."""
    return 2 * states.nbytes // 8


def gdn_decode_eight_sequences() -> None:
    """The GDN decode kernel (b|a product and gates inside) at eight sequences of one token,
    27B shape: the column block and warps against the rate of copy, the fp32 states rotated
    over slot sets larger than the L2 (eight sequences' states of a layer, 25 MB, would fit
    in it). At this size a program holds a [128, block] fp32 slice of a state, so the block
    sets the programs per SM and the waves."""
    copy = copy_bandwidth(DEVICE)
    q, k, v, x, ba_weight, A_log, dt_bias, states, slot_sets, query_start = _eight_sequences()
    moved = _eight_sequences_moved(states)
    print(f"{'GDN recurrent + gates, 8 sequences, 27B':48} {'us':>7} {'of copy':>8}")
    defaults = gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS
    sms = gdn_recurrent_triton.num_sms
    gdn_recurrent_triton.num_sms = lambda device: 1  # the block as set, never narrowed
    for block_v, warps in ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)):
        gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = block_v, warps
        calls = [
            lambda slots=slots: gdn_recurrent_triton.recurrent_gated_delta_rule_from_x(
                q, k, v, x, ba_weight, A_log, dt_bias, states, slots, query_start
            )
            for slots in slot_sets
        ]
        us = median_us(rotating(calls))
        label = f"block {block_v}, {warps} warps"
        print(f"{label:48} {us:7.2f} {moved / (us * 1e-6) / copy:8.0%}")
    gdn_recurrent_triton.num_sms = sms
    gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = defaults


def gdn_seqs_settings() -> None:
    """The GDN decode kernel as eight sequences run it (gates given, the output norm folded),
    27B shape, at `SEQS_SETTING` forms: widest column block, warps and register cap (None:
    the compiler's count), the fp32 states rotated beyond the L2 (docs/performance.md,
    Measurement 32)."""
    copy = copy_bandwidth(DEVICE)
    q, k, v, x, ba_weight, A_log, dt_bias, states, slot_sets, query_start = _eight_sequences()
    g, beta = gdn_gates_triton.gdn_gates_from_x(x, ba_weight, A_log, dt_bias)
    inputs = (q, k, v, g, beta, states)
    norm = (torch.randn_like(v), torch.ones(v.shape[-1], device=DEVICE, dtype=BF16), 1e-6)
    moved = _eight_sequences_moved(states)
    rule = gdn_recurrent_triton
    print(f"{'GDN rule + norm, 8 sequences, 27B, setting':48} {'us':>7} {'of copy':>8}")
    chosen = rule.SEQS_SETTING
    settings = [(64, 4, None), (64, 4, 160), (64, 4, 128), (32, 2, None), (32, 2, 160)]
    settings += [(32, 2, 144), (16, 1, 160), (64, 8, None)]
    for setting in settings:
        rule.SEQS_SETTING = setting
        calls = [
            partial(rule.recurrent_gated_delta_rule_normed, *inputs, slots, query_start, *norm)
            for slots in slot_sets
        ]
        us = median_us(rotating(calls))
        label = f"{setting}{' (as set)' if setting == chosen else ''}"
        print(f"{label:48} {us:7.2f} {moved / (us * 1e-6) / copy:8.0%}")
    rule.SEQS_SETTING = chosen


def _gdn_decode_kernels_at(name: str, hidden: int, value_heads: int, mlp: int) -> None:
    dim, key_heads = 128, 16
    split = SplitRequest.for_format("q4_g64_fp16")

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(BF16)

    slots = torch.tensor([3], device=DEVICE, dtype=torch.int32)
    query_start = torch.tensor([0, 1], device=DEVICE, dtype=torch.int32)
    q, k, v = randn(1, key_heads, dim), randn(1, key_heads, dim), randn(1, value_heads, dim)
    x, ba_weight = randn(1, hidden), randn(2 * value_heads, hidden, scale=0.02)
    A_log = torch.randn(value_heads, device=DEVICE)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    states = torch.randn(8, value_heads, dim, dim, device=DEVICE) * 0.1

    def rule():
        gdn_recurrent_triton.recurrent_gated_delta_rule_from_x(
            q, k, v, x, ba_weight, A_log, dt_bias, states, slots, query_start
        )

    print(f"{f'{name} recurrent + gates, as chosen':48} {median_us(rule):7.2f}")
    defaults = gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS
    sms = gdn_recurrent_triton.num_sms
    gdn_recurrent_triton.num_sms = lambda device: 1  # the block as set, never narrowed
    for block_v, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (128, 16)):
        gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = block_v, warps
        us = median_us(rule)
        print(f"{f'{name} recurrent + gates, block {block_v}, {warps} warps':48} {us:7.2f}")
    gdn_recurrent_triton.num_sms = sms
    gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = defaults
    out, z, weight = randn(1, value_heads, dim), randn(1, value_heads, dim), randn(dim)
    us = median_us(lambda: gated_rms_norm_triton.gated_rms_norm(out, z, weight, 1e-6, split))
    print(f"{f'{name} gated norm + split':48} {us:7.2f}")
    channels = (2 * key_heads + value_heads) * dim
    mixed, taps, windows = randn(1, channels), randn(channels, 4), randn(8, channels, 3)
    us = median_us(
        lambda: causal_conv1d_triton.causal_conv1d(mixed, taps, windows, slots, query_start)
    )
    print(f"{f'{name} causal conv, {channels} channels':48} {us:7.2f}")
    gate, up = randn(1, 2 * mlp).chunk(2, dim=-1)
    us = median_us(lambda: swiglu_triton.silu_mul(gate, up, split))
    print(f"{f'{name} SwiGLU + split, {mlp} wide':48} {us:7.2f}")


@triton.jit
def _state_tiles_kernel(states_ptr, slots_ptr, stride_slot, stride_head, BLOCK_V: tl.constexpr):
    """Each program loads its [128, BLOCK_V] fp32 tile of a GDN state, as the recurrent
    kernel's does, and stores it back changed: the recurrent kernel's state traffic alone."""
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, 128)
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    tile = states_ptr + slot * stride_slot + tl.program_id(1) * stride_head
    tile += rows[:, None] * 128 + cols[None, :]
    tl.store(tile, tl.load(tile) * 0.5 + 1.0)


def gdn_state_traffic() -> None:
    """The GDN decode kernel at eight sequences of one token (27B shape) against its own state
    traffic: with the gates inside, with them given, a kernel that only loads and stores the
    same state tiles over the same grid, and torch's copy of as many bytes."""
    copy = copy_bandwidth(DEVICE)
    q, k, v, x, ba_weight, A_log, dt_bias, states, slot_sets, query_start = _eight_sequences()
    g, beta = gdn_gates_triton.gdn_gates_from_x(x, ba_weight, A_log, dt_bias)
    moved = _eight_sequences_moved(states)
    rule = gdn_recurrent_triton
    seqs, value_heads, dim = slot_sets[0].shape[0], states.shape[1], states.shape[2]
    sets = len(slot_sets)

    def tiles(slots, block_v, warps):
        grid = (seqs, value_heads, dim // block_v)
        _state_tiles_kernel[grid](
            states, slots, states.stride(0), states.stride(1), BLOCK_V=block_v, num_warps=warps
        )

    rows = [
        (
            "gates inside (as one token runs it)",
            lambda slots: rule.recurrent_gated_delta_rule_from_x(
                q, k, v, x, ba_weight, A_log, dt_bias, states, slots, query_start
            ),
        ),
        (
            "gates given (as eight sequences run it)",
            lambda slots: rule.recurrent_gated_delta_rule(
                q, k, v, g, beta, states, slots, query_start
            ),
        ),
    ]
    for block_v, warps in ((64, 4), (32, 4), (64, 8), (128, 8), (32, 2)):
        label = f"state tiles only, block {block_v}, {warps} warps"
        rows.append((label, partial(tiles, block_v=block_v, warps=warps)))
    copies = torch.empty(sets, moved // 8, device=DEVICE)
    flat = states.view(sets, -1)
    print(f"{'GDN state traffic, 8 sequences, 27B':48} {'us':>7} {'of copy':>8}")
    for label, call in rows:
        us = median_us(rotating([partial(call, slots) for slots in slot_sets]))
        print(f"{label:48} {us:7.2f} {moved / (us * 1e-6) / copy:8.0%}")
    us = median_us(rotating([partial(copies[i].copy_, flat[(i + 1) % sets]) for i in range(sets)]))
    print(f"{'torch copy of as many bytes':48} {us:7.2f} {moved / (us * 1e-6) / copy:8.0%}")


def _without_route_mailbox(route, *args):
    """`route(*args)` with the fused router's routing waiting on its arrival counter."""
    moe_router_triton.ROUTE_MAILBOX = False
    try:
        return route(*args)
    finally:
        moe_router_triton.ROUTE_MAILBOX = True


def router_stages() -> None:
    """35B-A3B's fused router at one token, stage by stage: the kernel with all its stages
    (the routing waiting on the mailbox as shipped, then on the arrival counter), then with
    some left out (the dots, the arrival counter, the routing), the routing kernel alone on
    given logits and cuBLAS's product alone. Where the kernel's time goes
    (docs/performance.md, Measurement 15: 6.7 us per MoE layer in the step; Measurement 33
    for the mailbox)."""
    hidden, experts, top_k = 2048, 256, 8
    x = torch.randn(1, hidden, device=DEVICE, dtype=BF16)
    routers = [
        torch.randn(experts + 1, hidden, device=DEVICE, dtype=BF16) * 0.02 for _ in range(64)
    ]
    logits = torch.nn.functional.linear(x, routers[0])
    rows = []
    for stages in (
        (True, True, True),
        (True, True, False),
        (True, False, False),
        (False, True, True),
        (False, False, True),
        (False, True, False),
        (False, False, False),
    ):
        names = [n for n, on in zip(("dots", "counter", "routing"), stages, strict=True) if on]
        label = ", ".join(names) or "nothing (the launch)"
        route = partial(moe_router_triton.moe_router_route, x, stages=stages)
        if all(stages):  # the shipped kernel, then the same on the counter
            rows.append(
                (
                    "dots, mailbox, routing (shipped)",
                    lambda w, route=route: route(w, experts, top_k, 0, experts, True),
                )
            )
            route = partial(_without_route_mailbox, route)
        rows.append((label, lambda w, route=route: route(w, experts, top_k, 0, experts, True)))
    rows.append(
        (
            "routing kernel alone",
            lambda w: moe_route(logits[:, :experts], top_k, BF16, 0, experts, True),
        )
    )
    rows.append(("cuBLAS product alone", lambda w: torch.nn.functional.linear(x, w)))
    print(f"{'35B-A3B router stages, one token':48} {'us':>7}")
    for label, call in rows:
        us = median_us(rotating([partial(call, w) for w in routers]))
        print(f"{label:48} {us:7.2f}")


def norm_in_router() -> None:
    """35B-A3B's norm before the MoE block and its fused router at one token (the experts' q4
    codes written beside the normed row): the two kernels apart against the router's kernel
    with the norm inside (`moe_router_triton.moe_norm_router_route`), and each alone."""
    hidden, experts, top_k = 2048, 256, 8
    x, residual = (torch.randn(1, hidden, device=DEVICE, dtype=BF16) for _ in range(2))
    norm_weight = torch.randn(hidden, device=DEVICE, dtype=BF16) * 0.1
    routers = [
        torch.randn(experts + 1, hidden, device=DEVICE, dtype=BF16) * 0.02 for _ in range(64)
    ]
    split = SplitRequest.for_format("q4_g64_fp16", 64)
    normed, _ = rms_norm_triton.rms_norm(x, norm_weight, 1e-6, residual, split)
    route = (experts, top_k, 0, experts, True)

    def norm(w):
        return rms_norm_triton.rms_norm(x, norm_weight, 1e-6, residual, split)

    def router(w):
        return moe_router_triton.moe_router_route(normed, w, *route)

    def apart(w):
        norm(w)
        return router(w)

    def inside(w):
        return moe_router_triton.moe_norm_router_route(
            x, residual, norm_weight, 1e-6, w, *route, split
        )

    print(f"{'35B-A3B norm and router, one token':48} {'us':>7}")
    for label, call in (
        ("norm alone", norm),
        ("router alone", router),
        ("norm, then router (two kernels)", apart),
    ):
        us = median_us(rotating([partial(call, w) for w in routers]))
        print(f"{label:48} {us:7.2f}")
    shipped = moe_router_triton.NORM_PART_GROUPS
    try:
        for groups in (16, 2):
            moe_router_triton.NORM_PART_GROUPS = groups
            us = median_us(rotating([partial(inside, w) for w in routers]))
            print(f"{f'norm inside (one kernel), {groups} groups a part':48} {us:7.2f}")
    finally:
        moe_router_triton.NORM_PART_GROUPS = shipped


def down_and_combine() -> None:
    """35B-A3B at one token: the experts' down product over the nine pairs (the SwiGLU inside),
    then the combine kernel, against the down product with the combine inside
    (`groupwise_gemv_triton.grouped_swiglu_combine`, docs/performance.md, Measurement 34), and
    each of the two kernels alone. The pairs' experts rotate over 64 routings (about 5 MB of
    codes and scales a call)."""
    hidden, experts, inter, top_k = 2048, 256, 512, 8
    stacked = Q4.encode(torch.randn((experts + 1) * hidden, inter, device=DEVICE) * inter**-0.5)
    planes = {name: p.reshape(experts + 1, hidden, -1) for name, p in stacked.planes.items()}
    weight = EncodedTensor(stacked.format, stacked.layout, (experts + 1, hidden, inter), planes)
    gate_up = torch.randn(top_k + 1, 2 * inter, device=DEVICE, dtype=BF16)
    shared_gate = torch.randn(1, experts + 1, device=DEVICE, dtype=BF16)[:, experts:]
    routings = [
        moe_route(torch.randn(1, experts, device=DEVICE), top_k, BF16, 0, experts, True)
        for _ in range(64)
    ]
    outputs = groupwise_gemv_triton.grouped_swiglu_linear(
        gate_up, weight, routings[0].pairs, routings[0].pair_experts
    )

    def down(routes):
        return groupwise_gemv_triton.grouped_swiglu_linear(
            gate_up, weight, routes.pairs, routes.pair_experts
        )

    def combine(routes, outputs=outputs):
        return moe_combine_triton.moe_combine(
            outputs[:top_k].view(1, top_k, hidden),
            routes.weights,
            routes.experts,
            0,
            experts,
            outputs[top_k:],
            shared_gate,
        )

    def inside(routes):
        out = groupwise_gemv_triton.grouped_swiglu_combine(
            gate_up, weight, routes, 0, experts, shared_gate
        )
        assert out is not None, "the combine inside the down product did not run"
        return out

    inside(routings[0])  # its mailbox is made outside the graphs the timing captures
    rows = (
        ("down product, then the combine kernel", lambda r: combine(r, down(r))),
        ("down product with the combine (shipped)", inside),
        ("down product alone", down),
        ("combine kernel alone", combine),
    )
    print(f"{'35B-A3B down product and combine, one token':48} {'us':>7}")
    for label, call in rows:
        us = median_us(rotating([partial(call, r) for r in routings]))
        print(f"{label:48} {us:7.2f}")


def moe_decode_settings() -> None:
    """35B-A3B (hidden 2048, 256 experts of 512, the shared expert stacked as a 257th) at one
    token: the fused router and routing by rows per program, then the integer GEMV by rows per
    program, words per step and warps at its expert and dense products, and at the 27B head
    and MLP gate|up, in q4, at the heads in q8 and q6, the formats more rows and one row run
    them in, and at the 35B-A3B GDN in projection with its conv inside. Weights rotated over
    sets larger than the L2; `of copy` counts the codes and scales read."""
    hidden, experts, inter, top_k = 2048, 256, 512, 8
    copy = copy_bandwidth(DEVICE)
    x = torch.randn(1, hidden, device=DEVICE, dtype=BF16)
    routers = [
        torch.randn(experts + 1, hidden, device=DEVICE, dtype=BF16) * 0.02 for _ in range(64)
    ]
    print(f"{'35B-A3B router + routing, one token':48} {'us':>7}")
    default_rows = moe_router_triton.ROWS_PER_PROGRAM
    for rows in (1, 2, 4, 8, 16):
        moe_router_triton.ROWS_PER_PROGRAM = rows
        calls = [
            lambda w=w: moe_router_triton.moe_router_route(x, w, experts, top_k, 0, experts, True)
            for w in routers
        ]
        print(f"{f'{rows} rows per program':48} {median_us(rotating(calls)):7.2f}")
    moe_router_triton.ROWS_PER_PROGRAM = default_rows

    def stacked(count: int, rows: int, k: int) -> EncodedTensor:
        flat = Q4.encode(torch.randn(count * rows, k, device=DEVICE) * 0.02)
        planes = {name: p.reshape(count, rows, -1) for name, p in flat.planes.items()}
        return EncodedTensor(flat.format, flat.layout, (count, rows, k), planes)

    pairs = top_k + 1
    gate_up, down = stacked(experts + 1, 2 * inter, hidden), stacked(experts + 1, hidden, inter)
    choices = [
        torch.randperm(experts + 1, device=DEVICE)[:pairs].to(torch.int32) for _ in range(16)
    ]
    tokens = torch.zeros(pairs, device=DEVICE, dtype=torch.int32)
    rows_in = torch.arange(pairs, device=DEVICE, dtype=torch.int32)
    hidden_in = torch.randn(pairs, inter, device=DEVICE, dtype=BF16)
    gate_up_in = torch.randn(pairs, 2 * inter, device=DEVICE, dtype=BF16)
    swiglu_down = groupwise_gemv_triton.grouped_swiglu_linear
    grouped = groupwise_gemv_triton.grouped_groupwise_linear
    # (name, one weight of the product's shape, the calls rotated over, output columns)
    products = [
        (
            f"experts gate|up, {pairs} x {2 * inter}x{hidden}",
            gate_up,
            [partial(grouped, x, gate_up, tokens, e) for e in choices],
            pairs,
        ),
        (
            f"experts down, {pairs} x {hidden}x{inter}",
            down,
            [partial(grouped, hidden_in, down, rows_in, e) for e in choices],
            pairs,
        ),
        (  # as the step runs it: rows read whole, so the words a step do not change it
            f"experts down, SwiGLU inside, {pairs} x {hidden}x{inter}",
            down,
            [partial(swiglu_down, gate_up_in, down, rows_in, e) for e in choices],
            pairs,
        ),
    ]
    # q4: the model's products; q8: the heads as more than one row runs them (stored q6_g64,
    # widened to q8_g32); q6: as one row does; conv: the GDN in projection with its causal conv
    # over the first 8192 channels (q|k|v)
    for fmt, n, k, channels in (
        (Q4, 12288, 2048, 0),
        (Q4, 12288, 2048, 8192),
        (Q4, 2048, 4096, 0),
        (Q4, 9216, 2048, 0),
        (Q4, 248320, 2048, 0),
        (Q4, 248320, 5120, 0),
        (Q4, 34816, 5120, 0),
        (Q8, 248320, 2048, 0),
        (Q8, 248320, 5120, 0),
        (Q6, 248320, 2048, 0),
        (Q6, 248320, 5120, 0),
    ):
        products.append(_dense_product(fmt, n, k, channels))
    _int_gemv_settings(products, copy)


def dense_decode_settings() -> None:
    """27B at one token: the integer GEMV by rows per program, words per step and warps at
    every q4 product of a layer (the GDN in projection with its conv inside, as the step runs
    it) and at the head, in q8 and q6."""
    products = [
        _dense_product(Q4, 16384, 5120, 10240),  # GDN q|k|v|z, the conv over q|k|v
        _dense_product(Q4, 14336, 5120, 0),  # attention q|gate|k|v
        _dense_product(Q4, 5120, 6144, 0),  # GDN and attention out projections
        _dense_product(Q4, 34816, 5120, 0),  # MLP gate|up
        _dense_product(Q4, 5120, 17408, 0),  # MLP down
        _dense_product(Q8, 248320, 5120, 0),  # the head widened, as more rows run it
        _dense_product(Q6, 248320, 5120, 0),  # the head as one row runs it
    ]
    _int_gemv_settings(products, copy_bandwidth(DEVICE))


def _dense_product(fmt, n: int, k: int, conv_channels: int):
    """(name, one weight, the calls rotated over, output columns) for an [n, k] product at one
    x row; with conv_channels, the causal conv over that many leading outputs inside."""
    sets = max(2, math.ceil(240e6 / fmt.encoded_nbytes((n, k))))
    weights = [fmt.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(sets)]
    x = torch.randn(1, k, device=DEVICE, dtype=BF16)
    if conv_channels:
        slot = torch.tensor([2], device=DEVICE, dtype=torch.int32)
        taps = torch.randn(conv_channels, 4, device=DEVICE, dtype=BF16)
        windows = torch.randn(4, conv_channels, 3, device=DEVICE, dtype=BF16)
        conv_product = groupwise_gemv_triton.integer_linear_conv
        calls = [partial(conv_product, x, w, taps, windows, slot) for w in weights]
        return f"dense q4 {n}x{k} with the conv", weights[0], calls, 1
    # q6 (the heads as stored) at one row: its planes read as stored
    product = (
        groupwise_gemv_triton.integer_linear
        if fmt is Q6
        else groupwise_gemv_triton.groupwise_linear
    )
    calls = [partial(product, x, w) for w in weights]
    return f"dense {fmt.name[:2]} {n}x{k}", weights[0], calls, 1


def _int_gemv_settings(products, copy: float) -> None:
    """Each product timed at every (rows per program, words per step, warps) setting, the
    rule's choice marked; then each product's fastest three beside the chosen one."""
    config = groupwise_gemv_triton._int_config
    heading = f"{'rows':>4} {'words':>5} {'warps':>5} {'us':>7} {'of copy':>8}"
    print(f"{'integer GEMV, one token':40} {heading}")
    summary = []
    for name, weight, calls, out_cols in products:
        rows, k = weight.shape[-2:]
        moved = out_cols * get_format(weight.format).encoded_nbytes((rows, k))
        row_words = weight.planes["codes"].shape[-1] // 4
        bits = groupwise_gemv_triton.ONE_ROW_FORMATS[weight.format][0]
        chosen = config(rows, row_words, out_cols, torch.device(DEVICE), bits)
        timed = []
        for block_n in (4, 8, 16, 32, 64):
            for words in (1024, 2048, 4096):
                for warps in SWEEP_WARPS:
                    setting = block_n, max(8, words // block_n), warps
                    groupwise_gemv_triton._int_config = lambda *shape, setting=setting: setting
                    us = median_us(rotating(calls))
                    timed.append((us, setting))
                    share = moved / (us * 1e-6) / copy
                    mark = " (as chosen)" if setting == chosen else ""
                    row = f"{block_n:4d} {words:5d} {warps:5d} {us:7.2f} {share:8.0%}{mark}"
                    print(f"{name:40} {row}")
        groupwise_gemv_triton._int_config = config
        as_chosen = min((us for us, setting in timed if setting == chosen), default=float("nan"))
        fastest = "; ".join(f"{setting} {us:.2f}" for us, setting in sorted(timed)[:3])
        summary.append(f"{name:40} chosen {chosen} {as_chosen:.2f} us | fastest: {fastest}")
    print("\n".join(summary))


def int4pack(encoded, inner_k_tiles: int):
    """Our q4_g64 planes in the int4pack form: the same codes (value 2j in the high nibble,
    stored as code + 8), bf16 scales, zero points 0."""
    unsigned = encoded.planes["codes"] ^ 0x88
    swapped = ((unsigned & 0xF) << 4) | (unsigned >> 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
    scales = encoded.planes["scales"].to(BF16).t().contiguous()
    return packed, torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


def int4pack_against_ours() -> None:
    copy = copy_bandwidth(DEVICE)
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'q4 product':18} {'tiles':>5} {'M':>3} {'int4pack us':>12} {'ours us':>8}")
    for n, k in GEMV_SHAPES:
        sets = max(2, math.ceil(240e6 / Q4.encoded_nbytes((n, k))))
        weights = [Q4.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(sets)]
        for tiles in (8, 4, 2):
            packs = [int4pack(w, tiles) for w in weights]
            for m in (1, 2, 4, 8, 16):
                x = torch.randn(m, k, device=DEVICE, dtype=BF16)
                theirs = median_us(
                    rotating(
                        [
                            lambda p=p, x=x: torch.ops.aten._weight_int4pack_mm(x, p[0], 64, p[1])
                            for p in packs
                        ]
                    )
                )
                ours = median_us(
                    rotating(
                        [
                            lambda w=w, x=x: groupwise_gemv_triton.groupwise_linear(x, w)
                            for w in weights
                        ]
                    )
                )
                print(f"{f'{n}x{k}':18} {tiles:5d} {m:3d} {theirs:12.1f} {ours:8.1f}")


def one_row_fixed_cost() -> None:
    """The one-row integer GEMV (q4) at K = 6144 and 17408 over output rows from 2112 to 8448:
    its time with the weights rotated beyond the L2, and at the 27B shapes also with one
    weight read again and again (held in the L2)."""
    print(f"{'one-row q4 GEMV':18} {'programs':>8} {'MB':>6} {'DRAM us':>8} {'L2 us':>7}")
    config = groupwise_gemv_triton._int_config
    for k in (6144, 17408):
        for n in (2112, 3968, 4224, 4352, 4608, 5120, 5280, 6336, 8448):
            name, weight, calls, _ = _dense_product(Q4, n, k, 0)
            moved = Q4.encoded_nbytes((n, k))
            row_words = weight.planes["codes"].shape[-1] // 4
            block_n = config(n, row_words, 1, torch.device(DEVICE), 4)[0]
            dram = median_us(rotating(calls))
            held = median_us(calls[0]) if n == 5120 else float("nan")
            print(
                f"{f'{n}x{k}':18} {triton.cdiv(n, block_n):8d} {moved / 1e6:6.1f} "
                f"{dram:8.2f} {held:7.2f}"
            )
            del weight, calls


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_inputs(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask) + 1, mask=mask)


def dependent_launch_floor() -> None:
    """What one more dependent kernel costs a chain inside a CUDA graph: 512 launches of a
    kernel that waits for the one before and copies a 5120-value bf16 row it wrote (x + 1) to
    the other buffer, with 1, 40, 132 and 320 programs, with and without programmatic
    dependent launch."""
    from ninfer.kernels.pdl_triton import pdl_options

    n, launches = 5120, 512
    buffers = [torch.zeros(n, device=DEVICE, dtype=BF16) for _ in range(2)]
    print(f"{'dependent launches':24} {'programs':>8} {'PDL':>4} {'us per launch':>13}")
    for programs in (1, 40, 132, 320):
        block = triton.next_power_of_2(triton.cdiv(n, programs))
        for pdl in (False, True):
            options = pdl_options(torch.device(DEVICE)) if pdl else {"PDL": False}

            def chain(block=block, options=options, programs=programs):
                for i in range(launches):
                    src, dst = buffers[i % 2], buffers[1 - i % 2]
                    _chain_kernel[(programs,)](src, dst, n, BLOCK=block, **options)

            us = median_us(chain) / launches
            print(f"{'copy x + 1 of 5120 bf16':24} {programs:8d} {str(pdl):>4} {us:13.2f}")


# (rows per program, ring slots, programs per SM that K is split for) the Gluon sweeps try
GLUON_SETTINGS = (
    (64, 3, 2),
    (64, 2, 2),
    (64, 4, 2),
    (64, 3, 3),
    (64, 3, 4),
    (128, 2, 1),
    (128, 3, 1),
)


def gluon_q4_settings() -> None:
    """The 27B and 35B-A3B q4 products at 8 and 2 x rows: the Triton tensor-core kernel
    (the dispatch with the Gluon kernel refused), then the Gluon one at each setting."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_q4

    copy = copy_bandwidth(DEVICE)
    shapes = (*GEMV_SHAPES, (12288, 5120), (9216, 2048), (2048, 4096))
    settings = GLUON_SETTINGS
    default = gluon_q4.BLOCK_N, gluon_q4.STAGES, gluon_q4.PROGRAMS_PER_SM
    real_fits, tuned = gluon_q4.fits, gluon_q4.TUNED
    gluon_q4.TUNED = {}  # every product takes the setting swept
    print(f"{'q4 product':18} {'M':>2} {'kernel':>24} {'us':>7} {'of copy':>8}")
    for n, k in shapes:
        nbytes = Q4.encoded_nbytes((n, k))
        weights = [
            Q4.encode(torch.randn(n, k, device=DEVICE) * 0.02)
            for _ in range(max(2, math.ceil(240e6 / nbytes)))
        ]
        for m in (8, 2):
            x = torch.randn(m, k, device=DEVICE, dtype=BF16)
            calls = [partial(groupwise_gemv_triton.groupwise_linear, x, w) for w in weights]
            rows = []
            gluon_q4.fits = lambda x, weight: False
            rows.append(("triton", median_us(rotating(calls))))
            gluon_q4.fits = real_fits
            for block_n, stages, per_sm in settings:
                gluon_q4.BLOCK_N, gluon_q4.STAGES, gluon_q4.PROGRAMS_PER_SM = (
                    block_n,
                    stages,
                    per_sm,
                )
                rows.append((f"gluon {block_n}/{stages}/{per_sm}", median_us(rotating(calls))))
            gluon_q4.BLOCK_N, gluon_q4.STAGES, gluon_q4.PROGRAMS_PER_SM = default
            for label, us in rows:
                share = nbytes / (us * 1e-6) / copy
                print(f"{f'{n}x{k}':18} {m:2d} {label:>24} {us:7.2f} {share:8.1%}")
        del weights
    gluon_q4.TUNED = tuned


def gluon_q4_settings_at_eight_rows() -> None:
    """The 27B q4 products at eight x rows as the C=8 step calls them (the gate|up through
    `q4_swiglu_linear`, the others through `q4_linear`; the in projection without its conv), at
    each Gluon setting set as that product's tuned entry, the device's other entries kept."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_q4

    copy = copy_bandwidth(DEVICE)
    name = torch.cuda.get_device_name(0)
    tuned = dict(gluon_q4.TUNED.get(name, {}))
    print(f"{'q4 product':14} {'setting':>9} {'us':>7} {'of copy':>8}")
    for n, k in (*GEMV_SHAPES, (12288, 5120)):
        nbytes = Q4.encoded_nbytes((n, k))
        weights = [
            Q4.encode(torch.randn(n, k, device=DEVICE) * 0.02)
            for _ in range(max(2, math.ceil(240e6 / nbytes)))
        ]
        x = torch.randn(8, k, device=DEVICE, dtype=BF16)
        product = gluon_q4.q4_swiglu_linear if (n, k) == (34816, 5120) else gluon_q4.q4_linear
        shipped = gluon_q4._config(n, k, torch.device(DEVICE))
        for setting in GLUON_SETTINGS:
            gluon_q4.TUNED[name] = {**tuned, (n, k): setting}
            us = median_us(rotating([partial(product, x, w) for w in weights]))
            label = "/".join(map(str, setting)) + (" *" if setting == shipped else "")
            print(f"{f'{n}x{k}':14} {label:>9} {us:7.2f} {nbytes / (us * 1e-6) / copy:8.1%}")
        gluon_q4.TUNED[name] = tuned
        del weights


def gdn_in_projection_conv_gates() -> None:
    """The 27B and 35B-A3B GDN in projections at eight decode sequences: the Gluon product
    alone, then the conv and gates kernel after it (two launches), against the one kernel
    with the conv in its epilogue, without and with the gates programs in its grid."""
    copy = copy_bandwidth(DEVICE)
    print(f"{'in projection':18} {'form':>30} {'us':>7} {'of copy':>8}")
    for channels, z, heads, hidden in ((10240, 6144, 48, 5120), (8192, 4096, 32, 2048)):
        _in_projection_forms(copy, channels, z, heads, hidden)


def _in_projection_forms(copy: float, channels: int, z: int, heads: int, hidden: int) -> None:
    from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv

    n = channels + z
    nbytes = Q4.encoded_nbytes((n, hidden))
    weights = [
        Q4.encode(torch.randn(n, hidden, device=DEVICE) * 0.02)
        for _ in range(max(2, math.ceil(240e6 / nbytes)))
    ]
    m = 8
    x = torch.randn(m, hidden, device=DEVICE, dtype=BF16)
    taps = torch.randn(channels, 4, device=DEVICE, dtype=BF16)
    windows = torch.randn(m, channels, 3, device=DEVICE, dtype=BF16)
    slots = torch.arange(m, device=DEVICE, dtype=torch.int32)
    starts = torch.arange(m + 1, device=DEVICE, dtype=torch.int32)
    ba = torch.randn(2 * heads, hidden, device=DEVICE, dtype=BF16) * hidden**-0.5
    A_log, dt_bias = torch.randn(heads, device=DEVICE), torch.randn(heads, device=DEVICE)
    conv = gluon_gemv.GdnConv(taps, windows, slots)
    gates = gluon_gemv.GdnGates(ba, A_log, dt_bias)

    def apart(w):
        out = gluon_gemv.q4_linear(x, w)
        causal_conv1d_triton.causal_conv1d_and_gates(
            out[:, :channels], taps, windows, slots, starts, x, ba, A_log, dt_bias
        )

    forms = {
        "product alone": lambda w: gluon_gemv.q4_linear(x, w),
        "product, conv and gates kernel": apart,
        "one kernel, conv": lambda w: gluon_gemv.q4_linear_conv(x, w, conv),
        "one kernel, conv and gates": lambda w: gluon_gemv.q4_linear_conv(x, w, conv, gates),
    }
    for label, form in forms.items():
        us = median_us(rotating([partial(form, w) for w in weights]))
        share = nbytes / (us * 1e-6) / copy
        print(f"{f'{n}x{hidden}':18} {label:>30} {us:7.2f} {share:8.1%}")
    del weights


def gluon_q6_head_settings() -> None:
    """The 27B and 35B-A3B q6 heads at 8 and 2 x rows: the q8 widening through the Triton
    tensor-core kernel, then the q6 weight as stored through the Gluon kernel at each setting."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_q4
    from ninfer.quant.groupwise import widen_to_q8

    copy = copy_bandwidth(DEVICE)
    default, tuned = (gluon_q4.BLOCK_N, gluon_q4.STAGES), gluon_q4.TUNED
    gluon_q4.TUNED = {}  # every product takes the setting swept
    print(f"{'head':14} {'M':>2} {'kernel':>16} {'us':>7} {'of copy':>8} {'GB':>5}")
    for n, k in ((248320, 5120), (248320, 2048)):
        stored = Q6.encode(torch.randn(n, k, device=DEVICE) * 0.02)
        wide = widen_to_q8(stored)
        sizes = [
            sum(p.numel() * p.element_size() for p in w.planes.values()) for w in (wide, stored)
        ]
        for m in (8, 2):
            x = torch.randn(m, k, device=DEVICE, dtype=BF16)
            rows = [
                (
                    "q8 triton",
                    sizes[0],
                    median_us(partial(groupwise_gemv_triton.groupwise_linear, x, wide)),
                )
            ]
            for block_n, stages in ((64, 2), (64, 3), (64, 4), (128, 2)):
                gluon_q4.BLOCK_N, gluon_q4.STAGES = block_n, stages
                us = median_us(partial(gluon_q4.q6_linear, x, stored))
                rows.append((f"q6 gluon {block_n}/{stages}", sizes[1], us))
            gluon_q4.BLOCK_N, gluon_q4.STAGES = default
            for label, nbytes, us in rows:
                share = nbytes / (us * 1e-6) / copy
                print(
                    f"{f'{n}x{k}':14} {m:2d} {label:>16} {us:7.1f} {share:8.1%} {nbytes / 1e9:5.2f}"
                )
        del stored, wide
    gluon_q4.TUNED = tuned


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-int4pack", action="store_true", help="only the one-token sweeps")
    parser.add_argument("--only", help="run this one function of the file (a name)")
    parser.add_argument(
        "--warps", help="the warps the integer GEMV sweeps try, as 1,2 (default 2,4,8)"
    )
    args = parser.parse_args()
    if args.warps:
        global SWEEP_WARPS
        SWEEP_WARPS = tuple(int(w) for w in args.warps.split(","))
    if args.only:
        function = globals().get(args.only)
        own = callable(function) and getattr(function, "__module__", None) == __name__
        if not own or args.only.startswith("_") or args.only == "main":
            parser.error(f"--only: no sweep named {args.only!r} in this file")
        function()
        return
    norm_and_routing_warps()
    gdn_decode_kernels()
    gdn_decode_eight_sequences()
    gdn_seqs_settings()
    gdn_state_traffic()
    router_stages()
    norm_in_router()
    down_and_combine()
    moe_decode_settings()
    dense_decode_settings()
    one_row_fixed_cost()
    dependent_launch_floor()
    if not args.skip_int4pack:
        int4pack_against_ours()


if __name__ == "__main__":
    main()

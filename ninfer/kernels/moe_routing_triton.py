"""MoE routing in Triton: one launch per step for what eager torch runs as about fifteen
(upcast, softmax, top-k, sum, divide, cast, sort, gather, the pair lists), each a separate
kernel launch in a decode step that is launch-bound. One program per token holds its row of
logits: fp32 softmax, k rounds of "take the largest", renormalise, cast, and each choice stored
at its rank among the chosen ids, so the choices come out in id order without a sort.
Of equal probabilities the lowest expert id is taken, as torch.topk on CUDA does (its gather
pass writes values equal to the k-th in index order). A NaN probability ranks above all others,
as in torch.topk, so every id written is a valid expert. Where the shared expert is stacked
with the routed ones, each program also writes its token's pair with it. The routing of a
row is `route_token`, which the fused router and routing kernel (`moe_router_triton`) calls
too, so the two cannot route differently. Its rounds are integer warp reductions over the
probabilities' bits: on the H200 the 35B-A3B q4 C=1 decode step went from 1.59 to 1.50 ms with
them (docs/performance.md, Measurement 35).
Reference: `moe_routing.moe_route` (same signature)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.moe_routing import Routes
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

# Warps per token's program: one keeps the k rounds of reductions inside a warp (3.65 us per
# decode step's routing at 256 experts, top 8, against 4.14 us with four warps on the H200).
ROUTE_WARPS = 1


# A routing key's mark for padding and for experts already taken: below every probability's.
_NO_KEY = tl.constexpr(-1)
# The key of a NaN probability (2.0's bits): above every probability's, so that it ranks first.
_NAN_KEY = tl.constexpr(0x40000000)


@triton.jit
def _ordered(bits):
    """fp32 bits as an int32 that orders as the floats do (-0 just below +0); its own inverse.
    A warp's int32 maximum is one `redux.sync` on the GPU, where a float one is five
    shuffle-and-compare steps."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def route_token(
    logits,
    token,
    num_tokens,
    num_experts,
    weights_ptr,
    experts_ptr,
    pair_tokens_ptr,
    pair_experts_ptr,
    pairs_ptr,
    first,
    count,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    SHARED: tl.constexpr,
):
    """Token `token`'s routing from its row of logits ([BLOCK_E] fp32, the first num_experts
    live): its top-k weights and ids and its pairs, written where `moe_route` returns them.
    Every kernel that routes calls this, so all route alike.

    One warp runs it as a dependent chain, so its length is the cost (Nsight Compute: 1646
    instructions, 2.3 us of the 35B-A3B router's 5.2 on the H200; bench/decode_kernels.md,
    "One warp's chains").
    Each round takes the largest key and the lowest id holding it, two integer reductions;
    the pick's probability is the key's bits, so the sum of the picks needs no third. The k
    picks then go straight to their ranks in id order, a k x k count, with no scan of the
    row and no store of it."""
    ids = tl.arange(0, BLOCK_E)
    live = ids < num_experts
    # the largest logit through its ordered bits (a NaN logit makes every probability NaN
    # either way: the sum below carries it)
    top = _ordered(tl.max(_ordered(logits.to(tl.int32, bitcast=True)), axis=0))
    shifted = tl.exp(logits - top.to(tl.float32, bitcast=True))
    probs = tl.div_rn(shifted, tl.sum(shifted, axis=0))  # IEEE division, as torch's
    # probabilities lie in [0, 1], where fp32 orders as its bits: the keys
    keys = tl.where(
        live, tl.where(probs == probs, probs.to(tl.int32, bitcast=True), _NAN_KEY), _NO_KEY
    )
    slots = tl.arange(0, BLOCK_TOP)  # TOP_K of them are the picks'
    picks = slots + BLOCK_E  # past every id: the slots beyond TOP_K rank no pick
    values = slots * 0.0
    total = 0.0
    for choice in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        pick = tl.min(tl.where(keys == best, ids, BLOCK_E), axis=0)
        value = tl.where(best == _NAN_KEY, float("nan"), best.to(tl.float32, bitcast=True))
        total += value  # in pick order, as the sum of the picks' probabilities was
        picks = tl.where(slots == choice, pick, picks)
        values = tl.where(slots == choice, value, values)
        keys = tl.where(ids == pick, _NO_KEY, keys)
    # each pick's rank among the picks in id order (the ids are distinct)
    rank = tl.sum((picks[None, :] < picks[:, None]).to(tl.int32), axis=1)
    pair = token * TOP_K + rank
    mine = slots < TOP_K
    weights = tl.div_rn(values, total).to(weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + pair, weights, mask=mine)
    tl.store(experts_ptr + pair, picks, mask=mine)
    tl.store(pair_tokens_ptr + pair, picks * 0 + token, mask=mine)
    local = tl.minimum(tl.maximum(picks - first, 0), count - 1)
    tl.store(pair_experts_ptr + pair, local, mask=mine)
    tl.store(pairs_ptr + pair, pair, mask=mine)
    if SHARED:  # token t's pair with the shared expert, local id `count`, after all routed ones
        shared_pair = num_tokens * TOP_K + token
        tl.store(pair_tokens_ptr + shared_pair, token)
        tl.store(pair_experts_ptr + shared_pair, count)
        tl.store(pairs_ptr + shared_pair, shared_pair)


@triton.jit
def _moe_route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    pair_tokens_ptr,
    pair_experts_ptr,
    pairs_ptr,
    num_experts,
    stride_logits,
    first,
    count,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0)
    ids = tl.arange(0, BLOCK_E)
    row = logits_ptr + token.to(tl.int64) * stride_logits
    logits = tl.load(row + ids, mask=ids < num_experts, other=float("-inf")).to(tl.float32)
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


def empty_routes(
    tokens: int, top_k: int, dtype: torch.dtype, device: torch.device, shared: bool
) -> Routes:
    """The outputs a routing kernel writes, allocated."""
    weights = torch.empty(tokens, top_k, dtype=dtype, device=device)
    experts = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    num_pairs = tokens * (top_k + 1 if shared else top_k)
    pair_lists = torch.empty(3, num_pairs, dtype=torch.int32, device=device)
    return Routes(weights, experts, *pair_lists.unbind(0))


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    first: int,
    count: int,
    shared: bool = False,
) -> Routes:
    """logits [T, E] with unit stride along E (rows may be strided, e.g. a view of a stacked
    router product)."""
    tokens, num_experts = logits.shape
    routes = empty_routes(tokens, top_k, dtype, logits.device, shared)
    if tokens:
        _moe_route_kernel[(tokens,)](
            logits,
            *routes,
            num_experts,
            logits.stride(0),
            first,
            count,
            TOP_K=top_k,
            BLOCK_E=next_power_of_2(num_experts),
            BLOCK_TOP=next_power_of_2(top_k),
            SHARED=shared,
            num_warps=ROUTE_WARPS,
            **pdl_options(logits.device),
        )
    return routes

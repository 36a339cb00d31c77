"""The MoE router product and routing in one kernel (`moe_router_triton`) at the 35B-A3B
router (256 experts, top 8, hidden 2048, the shared expert's gate stacked as row 256) in bf16,
against F.linear (cuBLAS) and the routing kernel (`kernel_cases.check_moe_router_route`: the
logits' summation orders differ, so the top-k is held equal away from near-ties), and taken
inside a CUDA graph capture once a call outside it has allocated the counters. With the norm
before the block inside it (`moe_norm_router_route`), against the norm kernel and the router
on the rows it writes (`kernel_cases.check_moe_norm_router_route`)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_moe_norm_router_route, check_moe_router_route

from ninfer.kernels import (
    groupwise_gemv_triton,
    moe_router_triton,
    moe_routing_triton,
    rms_norm_triton,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BF16 = torch.bfloat16
HIDDEN, NUM_EXPERTS, TOP_K = 2048, 256, 8


@pytest.mark.parametrize(("first", "count"), [(0, NUM_EXPERTS), (64, 32)], ids=["all", "ep-rank"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed-pairs", "shared-pairs"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_router_route_matches_the_product_and_the_routing_kernel(tokens, shared, first, count):
    torch.manual_seed(tokens)
    for _ in range(3):  # new inputs each time: the counters reset by each call
        check_moe_router_route(
            moe_router_triton,
            moe_routing_triton.moe_route,
            tokens,
            NUM_EXPERTS,
            TOP_K,
            HIDDEN,
            True,
            (first, count),
            shared,
            BF16,
            "cuda",
        )
    assert not groupwise_gemv_triton._counters[torch.device("cuda", 0)].any()


def route_in_a_graph(x: torch.Tensor, weight: torch.Tensor):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        routes, logits = moe_router_triton.moe_router_route(x, weight, NUM_EXPERTS, TOP_K, 0, 256)
    return graph, routes, logits


def test_the_fused_kernel_is_captured_once_the_counters_exist(monkeypatch):
    """A warm-up call outside the capture allocates the counters; the captured call then
    launches the one kernel (the two-launch path would call the routing kernel), and replays
    on new inputs give what eager calls do."""
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN, device="cuda").to(BF16)
    weight = (torch.randn(NUM_EXPERTS + 1, HIDDEN, device="cuda") * HIDDEN**-0.5).to(BF16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_router_triton.moe_router_route(x, weight, NUM_EXPERTS, TOP_K, 0, 256)
    torch.cuda.current_stream().wait_stream(side)
    with monkeypatch.context() as unfused:
        unfused.setattr(moe_router_triton, "moe_route", None)  # called only without counters
        graph, routes, logits = route_in_a_graph(x, weight)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager, eager_logits = moe_router_triton.moe_router_route(
            x, weight, NUM_EXPERTS, TOP_K, 0, 256
        )
        for captured, fresh in zip(routes, eager):
            assert torch.equal(captured, fresh)
        assert torch.equal(logits, eager_logits)


def test_without_counters_a_capture_takes_the_two_launches(monkeypatch):
    """Counters first asked for inside a capture are not allocated there: the capture holds
    F.linear and the routing kernel, and a replay gives their result."""
    monkeypatch.setattr(groupwise_gemv_triton, "_counters", {})
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN, device="cuda").to(BF16)
    weight = (torch.randn(NUM_EXPERTS + 1, HIDDEN, device="cuda") * HIDDEN**-0.5).to(BF16)
    reference_logits = torch.nn.functional.linear(x, weight)
    moe_routing_triton.moe_route(reference_logits[:, :NUM_EXPERTS], TOP_K, BF16, 0, 256)
    graph, routes, logits = route_in_a_graph(x, weight)
    assert not groupwise_gemv_triton._counters
    x.copy_(torch.randn_like(x))
    graph.replay()
    reference_logits = torch.nn.functional.linear(x, weight)
    ref = moe_routing_triton.moe_route(reference_logits[:, :NUM_EXPERTS], TOP_K, BF16, 0, 256)
    assert torch.equal(logits, reference_logits)
    for captured, fresh in zip(routes, ref):
        assert torch.equal(captured, fresh)


@pytest.mark.parametrize("shared", [False, True], ids=["routed-pairs", "shared-pairs"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_norm_inside_is_the_norm_kernel_then_the_router(tokens, shared):
    torch.manual_seed(tokens)
    for _ in range(3):
        check_moe_norm_router_route(
            moe_router_triton,
            rms_norm_triton,
            moe_routing_triton.moe_route,
            tokens,
            NUM_EXPERTS,
            TOP_K,
            HIDDEN,
            (0, NUM_EXPERTS),
            shared,
            BF16,
            "cuda",
        )
    assert not groupwise_gemv_triton._counters[torch.device("cuda", 0)].any()

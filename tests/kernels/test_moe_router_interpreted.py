"""The MoE router product and routing in one kernel (`moe_router_triton`), run by Triton's CPU
interpreter on tiny shapes against F.linear and the routing reference, fp16 here
(tests/triton_interpreter.py says why). `kernel_cases.check_moe_router_route` states what is
compared: the logits within one rounding of F.linear's (the summation orders differ), the
routes exactly those of the kernel's own logits, and the unfused path's experts away from
near-ties. The token's last program routes it once its mailbox row is full (or, with the
mailbox off, the last to arrive at its counter), and leaves the row (the counter) at zero, so
a second call reuses them, and both give the same bits; without counters (none yet inside a
graph capture) the product and the routing run as two launches. With the norm before the block inside
(`moe_norm_router_route`), its outputs are the norm kernel's and the logits and routes those
of the router on them (up to the logits' summation order); rows wider than one warp holds take
the norm kernel, then the router."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import check_moe_norm_router_route, check_moe_router_route
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import moe_routing as routing_reference
from ninfer.kernels.x_split import SplitRequest, attached

require_interpreter()

DTYPE = torch.float16
CPU = torch.device("cpu")


@pytest.fixture
def router():
    torch.manual_seed(0)
    return load_kernel_module("moe_router_triton")


@pytest.fixture
def counters():
    """The arrival counters the kernel shares with the split-K GEMV."""
    return importlib.import_module("ninfer.kernels.groupwise_gemv_triton")._counters


@pytest.mark.parametrize("stacked", [True, False], ids=["shared-gate-row", "router-only"])
@pytest.mark.parametrize("shared", [False, True], ids=["routed-pairs", "shared-pairs"])
@pytest.mark.parametrize("part", ["all", "ep-rank"])
@pytest.mark.parametrize("hidden", [200, 600])  # one partial step of the dot product; two
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(("num_experts", "top_k"), [(8, 2), (40, 8), (64, 4)], ids=str)
def test_router_route_matches_the_product_and_the_routing(
    router, counters, num_experts, top_k, tokens, hidden, part, shared, stacked
):
    held = (0, num_experts) if part == "all" else (num_experts // 4, num_experts // 2)
    check_moe_router_route(
        router,
        routing_reference.moe_route,
        tokens,
        num_experts,
        top_k,
        hidden,
        stacked,
        held,
        shared,
        DTYPE,
        CPU,
    )
    assert not counters[CPU].any()


@pytest.mark.parametrize("norm", [False, True], ids=["router", "norm-inside"])
def test_the_mailbox_routes_as_the_counter_and_is_left_at_zero(router, counters, norm):
    """The routing waiting on the mailbox (`ROUTE_MAILBOX`) gives the counter path's routes
    and logits bit for bit, leaves the mailbox at zero for the next call, and leaves the
    counters untouched; with the mailbox off the counters are used and reset."""
    x, residual = torch.randn(2, 3, 200).to(DTYPE)
    norm_weight = torch.randn(200).to(DTYPE)
    weight = (torch.randn(41, 200) * 200**-0.5).to(DTYPE)

    def call():
        if norm:
            return router.moe_norm_router_route(
                x, residual, norm_weight, 1e-6, weight, 40, 8, 10, 20, True
            )[:2]
        return router.moe_router_route(x, weight, 40, 8, 10, 20, True)

    routes, logits = call()
    mailbox = router._mailboxes[CPU]
    assert not mailbox.any() and not counters[CPU].any()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(router, "ROUTE_MAILBOX", False)
        counted, counted_logits = call()
    assert not counters[CPU].any() and not mailbox.any()
    assert torch.equal(logits, counted_logits)
    assert all(torch.equal(a, b) for a, b in zip(routes, counted, strict=True))
    again, _ = call()  # the same mailbox, zero again
    assert router._mailboxes[CPU] is mailbox and not mailbox.any()
    assert all(torch.equal(a, b) for a, b in zip(routes, again, strict=True))


def test_a_second_call_reuses_the_reset_counters(router, counters):
    case = (routing_reference.moe_route, 3, 40, 8, 200, True, (0, 40), False, DTYPE, CPU)
    check_moe_router_route(router, *case)
    allocated = counters[CPU]
    assert not allocated.any()
    check_moe_router_route(router, *case)  # new inputs, the same counters
    assert counters[CPU] is allocated and not allocated.any()


def test_without_counters_the_product_and_the_routing_run_apart(router, counters, monkeypatch):
    """No counters to be had (as for a first call inside a graph capture): F.linear's logits
    routed by the routing kernel, exactly the unfused path."""
    gemv = importlib.import_module("ninfer.kernels.groupwise_gemv_triton")
    monkeypatch.setattr(gemv, "_counters", {})
    monkeypatch.setattr(gemv, "TILE_COUNTERS", 0)
    x = torch.randn(3, 200).to(DTYPE)
    weight = (torch.randn(41, 200) * 200**-0.5).to(DTYPE)
    routes, logits = router.moe_router_route(x, weight, 40, 8, 10, 20, True)
    assert not gemv._counters
    assert torch.equal(logits, F.linear(x, weight))
    ref = routing_reference.moe_route(logits[:, :40], 8, DTYPE, 10, 20, True)
    for name in ("experts", "pair_tokens", "pair_experts", "pairs"):
        assert torch.equal(getattr(routes, name), getattr(ref, name)), name
    torch.testing.assert_close(routes.weights, ref.weights, rtol=torch.finfo(DTYPE).eps, atol=0)


def test_stages_left_out_for_timing_do_what_they_say(router, counters, monkeypatch):
    """`stages` (for bench/decode_variants.py's timing): without the routing the logits are
    still the product's, the counters end at zero and the routes stay as allocated; with all
    three, the routes are the shipped call's."""
    x = torch.randn(2, 64).to(DTYPE)
    weight = torch.randn(9, 64).to(DTYPE)
    full, full_logits = router.moe_router_route(x, weight, 8, 2, 0, 8)
    allocate = router.empty_routes
    monkeypatch.setattr(
        router, "empty_routes", lambda *a: type(full)(*(t.zero_() for t in allocate(*a)))
    )
    routes, logits = router.moe_router_route(x, weight, 8, 2, 0, 8, stages=(True, True, False))
    assert torch.equal(logits, full_logits) and not counters[CPU].any()
    assert not any(t.any() for t in routes)
    routes, _ = router.moe_router_route(x, weight, 8, 2, 0, 8, stages=(True, True, True))
    assert all(torch.equal(a, b) for a, b in zip(routes, full, strict=True))


@pytest.mark.parametrize("shared", [False, True], ids=["routed-pairs", "shared-pairs"])
@pytest.mark.parametrize("hidden", [192, 2112])  # one part; three parts of 16 groups, one partial
@pytest.mark.parametrize("tokens", [1, 3])
def test_norm_inside_is_the_norm_kernel_then_the_router(router, counters, tokens, hidden, shared):
    norm = load_kernel_module("rms_norm_triton")
    case = (tokens, 40, 8, hidden, (10, 20), shared, DTYPE, CPU)
    check_moe_norm_router_route(router, norm, routing_reference.moe_route, *case)
    assert not counters[CPU].any()


def test_norm_inside_without_counters_runs_the_norm_then_the_router(router, monkeypatch):
    gemv = importlib.import_module("ninfer.kernels.groupwise_gemv_triton")
    monkeypatch.setattr(gemv, "_counters", {})
    monkeypatch.setattr(gemv, "TILE_COUNTERS", 0)
    norm = load_kernel_module("rms_norm_triton")
    case = (routing_reference.moe_route, 2, 40, 8, 256, (0, 40), True, DTYPE, CPU)
    check_moe_norm_router_route(router, norm, *case)
    assert not gemv._counters


def test_norm_inside_refuses_what_it_cannot_norm(router):
    x = torch.randn(2, 64).to(DTYPE)
    weight = torch.randn(9, 64).to(DTYPE)
    norm_weight = torch.zeros(64)
    with pytest.raises(ValueError, match="residual"):
        router.moe_norm_router_route(x, x[:1], norm_weight, 1e-6, weight, 8, 2, 0, 8)
    with pytest.raises(ValueError, match="norm weight"):
        router.moe_norm_router_route(x, x, norm_weight[:32], 1e-6, weight, 8, 2, 0, 8)


def test_rows_wider_than_one_warp_holds_take_the_norm_kernel_then_the_router(
    router, counters, monkeypatch
):
    norm = load_kernel_module("rms_norm_triton")
    calls = []
    monkeypatch.setattr(router, "NORM_MAX_HIDDEN", 128)
    monkeypatch.setattr(
        router, "rms_norm", lambda *args: calls.append(args) or norm.rms_norm(*args)
    )
    case = (routing_reference.moe_route, 2, 40, 8, 192, (0, 40), False, DTYPE, CPU)
    check_moe_norm_router_route(router, norm, *case)
    assert len(calls) == 1


@pytest.mark.parametrize(("part_groups", "rows_per_program"), [(1, 1), (2, 1), (1, 2)])
def test_norm_parts_grow_until_the_programs_cover_them(
    router, counters, monkeypatch, part_groups, rows_per_program
):
    """Ten groups of 64 values and five router rows: parts of one or two groups would need
    more programs than there are (five, or three at two rows a program), so each part takes
    two (or four)."""
    monkeypatch.setattr(router, "NORM_PART_GROUPS", part_groups)
    monkeypatch.setattr(router, "ROWS_PER_PROGRAM", rows_per_program)
    norm = load_kernel_module("rms_norm_triton")
    case = (routing_reference.moe_route, 2, 4, 2, 640, (0, 4), True, DTYPE, CPU)
    check_moe_norm_router_route(router, norm, *case)


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16"])
def test_norm_inside_attaches_the_codes_of_every_row(router, counters, fmt):
    """Up to the experts' decode rows (a request of 64 rows, as the layer's), every normed
    row's codes are the split kernel's of that row."""
    gemv = load_kernel_module("groupwise_gemv_triton")
    request = SplitRequest.for_format(fmt, 64)
    x, residual = torch.randn(3, 256).to(DTYPE), torch.randn(3, 256).to(DTYPE)
    weight = (torch.randn(9, 256) * 256**-0.5).to(DTYPE)
    *_, normed, _ = router.moe_norm_router_route(
        x, residual, torch.randn(256) * 0.1, 1e-6, weight, 8, 2, 0, 8, True, request
    )
    bits, group = request.bits, request.group
    split = attached(normed, bits, group, 256 // group)
    codes, corr, steps = gemv.split_x(normed.contiguous(), bits, group, 256)
    assert torch.equal(split.codes, codes) and torch.equal(split.steps, steps)
    if bits == 4:
        assert torch.equal(split.corr, corr)

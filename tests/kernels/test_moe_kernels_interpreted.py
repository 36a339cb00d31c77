"""The MoE routing and output kernels run by Triton's CPU interpreter on tiny shapes, against
their torch references (half precision in fp16 here: tests/triton_interpreter.py says why).
Routing: the same experts in id order and pair lists, weights within one rounding of the model
dtype; of tied probabilities the lowest ids. Output: the reference's roundings, so equal but
for the sigmoid's own rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import relative_error
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import moe_combine as combine_reference
from ninfer.kernels import moe_routing as routing_reference

require_interpreter()

HELD = [(0, 40), (6, 5)]  # all of 40 experts; an expert-parallel rank holding 6..10


@pytest.fixture
def routing():
    torch.manual_seed(0)
    return load_kernel_module("moe_routing_triton")


@pytest.fixture
def combine():
    torch.manual_seed(0)
    return load_kernel_module("moe_combine_triton")


def assert_same_routes(ours, ref, dtype: torch.dtype) -> None:
    for name in ("experts", "pair_tokens", "pair_experts", "pairs"):
        assert getattr(ours, name).dtype == torch.int32
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ours.weights.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps  # one rounding step
    torch.testing.assert_close(ours.weights, ref.weights, rtol=rtol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("first", "count"), HELD, ids=str)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (5, 3), (3, 8)], ids=str)
def test_routing_matches_the_reference(routing, dtype, first, count, tokens, top_k):
    logits = torch.randn(tokens, 40).to(dtype)
    ours = routing.moe_route(logits, top_k, dtype, first, count)
    assert_same_routes(ours, routing_reference.moe_route(logits, top_k, dtype, first, count), dtype)


@pytest.mark.parametrize(("first", "count"), HELD, ids=str)
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 1), (5, 3)], ids=str)
def test_routing_appends_a_pair_per_token_for_a_stacked_shared_expert(
    routing, first, count, tokens, top_k
):
    """With the shared expert stacked as local expert `count`: the routed pairs as without it,
    then pair T * k + t is token t with that expert."""
    logits = torch.randn(tokens, 40).to(torch.float16)
    ours = routing.moe_route(logits, top_k, torch.float16, first, count, True)
    ref = routing_reference.moe_route(logits, top_k, torch.float16, first, count, True)
    assert_same_routes(ours, ref, torch.float16)
    plain = routing_reference.moe_route(logits, top_k, torch.float16, first, count)
    routed = tokens * top_k
    for name in ("pair_tokens", "pair_experts", "pairs"):
        assert torch.equal(getattr(ref, name)[:routed], getattr(plain, name)), name
    assert ref.pair_tokens[routed:].tolist() == list(range(tokens))
    assert ref.pair_experts[routed:].tolist() == [count] * tokens
    assert ref.pairs.tolist() == list(range(routed + tokens))


def test_routing_reads_strided_logit_rows(routing):
    """The router and the shared expert's gate stacked in one product: logits are a view."""
    stacked = torch.randn(4, 41, dtype=torch.float16)
    logits = stacked[:, :40]
    ours = routing.moe_route(logits, 8, torch.float16, 0, 40)
    ref = routing_reference.moe_route(logits.contiguous(), 8, torch.float16, 0, 40)
    assert_same_routes(ours, ref, torch.float16)


def test_routing_takes_the_lowest_ids_of_tied_probabilities(routing):
    logits = torch.randint(0, 3, (6, 40)).float()
    logits[0] = 0  # every expert tied
    ours = routing.moe_route(logits, 8, torch.float32, 0, 40)
    probs = torch.softmax(logits, dim=-1)
    lowest_first = probs.sort(dim=-1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(ours.experts, lowest_first.sort(dim=-1).values.int())
    assert torch.equal(ours.experts[0], torch.arange(8, dtype=torch.int32))
    chosen = probs.gather(1, ours.experts.long())
    torch.testing.assert_close(ours.weights, chosen / chosen.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("nan", [float("nan"), -float("nan")], ids=["nan", "negative nan"])
def test_routing_of_a_nan_logit_still_names_valid_experts(routing, nan):
    logits = torch.randn(2, 40)
    logits[1, 7] = nan
    ours = routing.moe_route(logits, 4, torch.float32, 0, 40)
    assert torch.equal(ours.experts[1], torch.arange(4, dtype=torch.int32))
    assert ours.pair_experts.min() >= 0 and ours.pair_experts.max() < 40
    # the NaN is in the renormalising sum, as in the reference: every weight of its token
    ref = routing_reference.moe_route(logits, 4, torch.float32, 0, 40)
    assert ours.weights[1].isnan().all() and ref.weights[1].isnan().all()
    torch.testing.assert_close(ours.weights[0], ref.weights[0])


def test_routing_of_logits_all_far_below_zero_matches_the_reference(routing):
    """The kernel finds the largest logit by its bits, read as ordered integers: a row of
    negative logits, whose smallest one taken for the largest would overflow the softmax."""
    logits = -50 - 100 * torch.rand(3, 40)
    ours = routing.moe_route(logits, 8, torch.float32, 0, 40)
    ref = routing_reference.moe_route(logits, 8, torch.float32, 0, 40)
    assert_same_routes(ours, ref, torch.float32)


def combine_inputs(tokens: int, top_k: int, hidden: int, dtype: torch.dtype) -> dict:
    """Outputs of experts chosen from 40, the shared gate a column of a stacked product."""
    experts = torch.stack([torch.randperm(40)[:top_k].sort().values for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k), dim=-1)
    return dict(
        choices=torch.randn(tokens, top_k, hidden).to(dtype),
        weights=weights.to(dtype),
        experts=experts.int(),
        shared=torch.randn(tokens, hidden).to(dtype),
        shared_gate=torch.randn(tokens, 41).to(dtype)[:, 40:],
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("first", "count"), HELD, ids=str)
@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 40), (3, 3, 600)], ids=str)
def test_combine_matches_the_reference(combine, dtype, first, count, tokens, top_k, hidden):
    inputs = combine_inputs(tokens, top_k, hidden, dtype)
    ours = combine.moe_combine(first=first, count=count, **inputs)
    ref = combine_reference.moe_combine(first=first, count=count, **inputs)
    assert ours.dtype == dtype and ours.shape == (tokens, hidden)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    else:
        assert (ours == ref).float().mean() > 0.99
        assert relative_error(ours, ref) < torch.finfo(dtype).eps


def test_combine_adds_nothing_for_another_ranks_experts(combine):
    """Choices outside the held range add zero even where their outputs are not finite."""
    inputs = combine_inputs(2, 4, 40, torch.float32)
    inputs["choices"][:, :] = float("inf")
    inputs["shared"] = torch.zeros(2, 40)
    ours = combine.moe_combine(first=100, count=8, **inputs)
    assert torch.equal(ours, torch.zeros(2, 40))

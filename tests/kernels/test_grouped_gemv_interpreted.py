"""The grouped group-wise GEMV of MoE decode (`groupwise_gemv_triton.grouped_groupwise_linear`)
run by Triton's CPU interpreter on tiny shapes, against its torch reference and inside
`GroupwiseExperts`, in fp16 (tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_grouped_groupwise_linear, moe_block, relative_error
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import dispatch
from ninfer.models.layers import moe
from ninfer.models.layers.moe import GATHERED_MAX_TOKENS, Experts, GroupwiseExperts
from ninfer.quant import get_format

require_interpreter()


@pytest.fixture
def gemv_triton():
    torch.manual_seed(0)
    return load_kernel_module("groupwise_gemv_triton")


@pytest.mark.parametrize(
    ("format_name", "n", "k"),
    [("q4_g64_fp16", 40, 300), ("q8_g32_fp16", 40, 200), ("q4_g64_fp16", 24, 96)],
)
@pytest.mark.parametrize(("tokens", "pairs"), [(1, 3), (4, 12)])
def test_grouped_gemv_matches_the_dequantized_experts(
    gemv_triton, format_name, n, k, tokens, pairs
):
    check_grouped_groupwise_linear(
        gemv_triton, format_name, 5, n, k, tokens, pairs, torch.float16, "cpu", 2e-3
    )


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("held", [range(6), range(2, 5)], ids=["all", "ep-rank"])
def test_groupwise_experts_decode_with_the_grouped_kernel(
    gemv_triton, monkeypatch, format_name, held
):
    """Both GEMVs of the decode path through the interpreted kernel; choices outside the
    rank's experts add nothing."""
    monkeypatch.setattr(moe, "grouped_groupwise_linear", gemv_triton.grouped_groupwise_linear)
    hidden, width, top_k, tokens = 128, 96, 3, 4
    fmt = get_format(format_name)
    gate_up = fmt.encode(torch.randn(6, 2 * width, hidden) * hidden**-0.5)
    down = fmt.encode(torch.randn(6, hidden, width) * width**-0.5)
    dense = Experts(held, hidden, width)
    dense.gate_up_proj.data = gate_up.decode(torch.float32)[held.start : held.stop]
    dense.down_proj.data = down.decode(torch.float32)[held.start : held.stop]
    encoded = GroupwiseExperts.from_stored(held, gate_up, down)
    x = torch.randn(tokens, hidden)
    weights, experts = torch.softmax(torch.randn(tokens, 6), -1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    assert tokens <= GATHERED_MAX_TOKENS
    out = encoded(x.half(), experts, weights.half())
    assert out.dtype == torch.float16
    assert relative_error(out, dense(x, experts, weights)) < 3e-3


@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_block_with_the_shared_expert_stacked_runs_the_kernels(
    gemv_triton, monkeypatch, tokens
):
    """A block whose shared expert is stacked with the routed ones, with the routing, grouped
    GEMV and output kernels interpreted: the shared pairs read the stack's last expert, and the
    block computes what the unstacked block does on the torch references."""
    block = moe_block(128, 6, 2, 64, encoded=True)
    block.fuse_projections()
    block = block.half()
    x = torch.randn(tokens, 128).half()
    reference = block(x)
    assert block.stack_shared_expert()
    monkeypatch.setattr(moe, "grouped_groupwise_linear", gemv_triton.grouped_groupwise_linear)
    monkeypatch.setattr(dispatch, "routing_reference", load_kernel_module("moe_routing_triton"))
    monkeypatch.setattr(dispatch, "combine_reference", load_kernel_module("moe_combine_triton"))
    out = block(x)
    assert out.dtype == torch.float16
    assert relative_error(out, reference) < 3e-3

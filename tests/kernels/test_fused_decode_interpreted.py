"""The kernels behind the fused decode projections, run by Triton's CPU interpreter on tiny
shapes: the GDN gates kernel against its torch reference, the GEMV over encoded weights
stacked by rows against the GEMV over each, and the norm reading q/k heads in place inside the
fused q/k/v product. Half precision is fp16 (tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_fused_groupwise_linear, check_gdn_gates, relative_error
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import gdn_gates as gates_reference
from ninfer.kernels import rms_norm as norm_reference

require_interpreter()


@pytest.fixture
def interpreted():
    torch.manual_seed(0)
    return load_kernel_module


@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("heads", [48, 5])
def test_gdn_gates_match_the_reference_in_fp32(interpreted, tokens, heads):
    check_gdn_gates(interpreted("gdn_gates_triton"), tokens, heads, torch.float32, "cpu", 1e-6, 2)


@pytest.mark.parametrize("tokens", [1, 37])
def test_gdn_gates_match_the_reference_in_fp16_within_rounding(interpreted, tokens):
    check_gdn_gates(interpreted("gdn_gates_triton"), tokens, 48, torch.float16, "cpu", 1e-5, 1)


def test_gdn_gates_read_b_and_a_with_their_own_row_strides(interpreted):
    """b and a from two separate (unfused) projections: any row stride each."""
    module = interpreted("gdn_gates_triton")
    b = torch.randn(6, 16)[:, :5]
    a = torch.randn(6, 9)[:, 2:7]
    A_log, dt_bias = torch.randn(5), torch.randn(5)
    g, beta = module.gdn_gates(b, a, A_log, dt_bias)
    ref_g, ref_beta = gates_reference.gdn_gates(b, a, A_log, dt_bias)
    assert torch.allclose(g, ref_g, rtol=1e-6, atol=0.0)
    assert torch.allclose(beta, ref_beta, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize(
    ("format_name", "sizes", "k"),
    [("q4_g64_fp16", [40, 24], 300), ("q8_g32_fp16", [24, 8, 8], 200)],
    ids=["gate_up-like", "qkv-like"],
)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_over_stacked_weights_gives_each_weights_product(
    interpreted, format_name, sizes, k, m
):
    """m = 1 takes the one-row kernel, m = 3 the tensor-core kernel."""
    module = interpreted("groupwise_gemv_triton")
    check_fused_groupwise_linear(module, format_name, m, sizes, k, torch.float16, "cpu", 2e-3)


def test_rms_norm_reads_heads_inside_the_fused_qkv_product_in_place(interpreted):
    """q heads of each token inside a wider row: [T, heads, d] with two strides, no copy."""
    module = interpreted("rms_norm_triton")
    tokens, heads, dim = 4, 3, 16
    fused = torch.randn(tokens, 2 * heads * dim + 40) * 3
    query = fused[:, : 2 * heads * dim].view(tokens, heads, 2 * dim)[..., :dim]
    weight = torch.randn(dim) * 0.1
    out = module.rms_norm(query, weight, 1e-6)
    assert out.shape == query.shape and out.is_contiguous()
    assert relative_error(out, norm_reference.rms_norm(query, weight, 1e-6)) < 1e-6

"""The gated-attention output gate kernel under Triton's CPU interpreter against its torch
reference: the gate read in place from the gate half of each head of q_proj's output (fp16
here: tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import output_gate as gate_reference

require_interpreter()


@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(1, 3, 20), (5, 24, 256)])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(torch.float16, torch.finfo(torch.float16).eps, id="fp16"),
        pytest.param(torch.float32, 1e-6, id="fp32"),
    ],
)
def test_sigmoid_gate_matches_reference_within_one_rounding_step(
    tokens, heads, head_dim, dtype, tol
):
    """Passes when |out - ref| <= tol * |ref| at every element: Triton's exp differs from
    torch's in the last fp32 bits, which can flip the rounding of sigmoid (then of the
    product) by one step. (5, 24, 256) is the 27B attention width, 6144: six blocks."""
    torch.manual_seed(heads)
    module = load_kernel_module("output_gate_triton")
    query_gate = (torch.randn(tokens, heads, 2 * head_dim) * 3).to(dtype)
    gate = query_gate[..., head_dim:]
    attn = torch.randn(tokens, heads, head_dim).to(dtype)
    out = module.sigmoid_gate(attn, gate)
    ref = gate_reference.sigmoid_gate(attn, gate)
    assert out.dtype == dtype and out.shape == (tokens, heads * head_dim)
    bound = tol * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.float() - ref.float()).abs() <= bound).all()

"""The GDN gates kernel that computes the b|a product itself (`gdn_gates_from_x`), run by
Triton's CPU interpreter on tiny shapes, and its torch reference (the product, then the
gates), each within one rounding step of b and a of the exact product (fp16 for half
precision: tests/triton_interpreter.py says why; bf16 runs in tests/gpu)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_gdn_gates_from_x
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import gdn_gates as gates_reference

require_interpreter()


@pytest.mark.parametrize("tokens", [1, 3, 16])
@pytest.mark.parametrize("hidden", [96, 300, 2500])
@pytest.mark.parametrize(
    ("dtype", "g_tol", "beta_ulps"),
    [
        pytest.param(torch.float16, 1e-5, 1, id="fp16"),
        pytest.param(torch.float32, 1e-6, 2, id="fp32"),
    ],
)
@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_gates_from_x_within_one_rounding_of_b_and_a(
    implementation, tokens, hidden, dtype, g_tol, beta_ulps
):
    """Hidden sizes within one column block (96, 300: masked) and over three (2500); the gate
    tolerances are those of the gates kernel alone (test_fused_decode_interpreted.py). The
    reference meeting the same bounds makes kernel and reference agree within them."""
    torch.manual_seed(tokens * hidden)
    module = gates_reference
    if implementation == "triton":
        module = load_kernel_module("gdn_gates_triton")
    check_gdn_gates_from_x(module, tokens, 6, hidden, dtype, "cpu", g_tol, beta_ulps)

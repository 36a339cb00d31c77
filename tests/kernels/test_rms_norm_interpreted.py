"""The fused RMSNorm(+residual) kernel under Triton's CPU interpreter at the 27B hidden size, as a
decoder layer calls it: the sum written bit for bit as torch's add rounds it, the norm of that
sum within one rounding step of the reference (fp16 here: tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import rms_norm as norm_reference

require_interpreter()

HIDDEN_27B = 5120


def within_relative(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """|out - ref| <= tol * |ref| elementwise. With tol = finfo.eps of a half-precision output
    that is one rounding step at each element's own scale: the fp32 sum of squares and rsqrt
    differ from torch's in the last bits (a few fp32 steps), which can flip a rounding."""
    bound = tol * ref.float().abs().clamp_min(torch.finfo(ref.dtype).tiny)
    return bool(((out.float() - ref.float()).abs() <= bound).all())


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(torch.float16, torch.finfo(torch.float16).eps, id="fp16"),
        pytest.param(torch.float32, 1e-5, id="fp32"),
    ],
)
def test_residual_sum_is_exact_and_norm_within_one_rounding_step(tokens, dtype, tol):
    torch.manual_seed(tokens)
    module = load_kernel_module("rms_norm_triton")
    mixer_out = torch.randn(tokens, HIDDEN_27B).to(dtype)
    residual = (torch.randn(tokens, HIDDEN_27B) * 4).to(dtype)
    weight = (torch.randn(HIDDEN_27B) * 0.1).to(dtype)
    normed, stream = module.rms_norm(mixer_out, weight, 1e-6, residual)
    ref_normed, ref_stream = norm_reference.rms_norm(mixer_out, weight, 1e-6, residual)
    assert torch.equal(stream, residual + mixer_out)
    assert torch.equal(stream, ref_stream)
    assert normed.dtype == dtype and normed.shape == mixer_out.shape
    assert within_relative(normed, ref_normed, tol)


def test_residual_left_unchanged_and_sum_written_to_a_new_tensor():
    """The decoder layer keeps the stream it passed in for nothing else, but a caller may: the
    kernel writes the sum out of place."""
    module = load_kernel_module("rms_norm_triton")
    mixer_out = torch.randn(3, 64).to(torch.float16)
    residual = torch.randn(3, 64).to(torch.float16)
    kept = residual.clone()
    _, stream = module.rms_norm(mixer_out, torch.zeros(64, dtype=torch.float16), 1e-6, residual)
    assert torch.equal(residual, kept)
    assert stream.data_ptr() not in (residual.data_ptr(), mixer_out.data_ptr())

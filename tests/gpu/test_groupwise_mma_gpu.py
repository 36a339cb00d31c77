"""The q4 GEMV that loads its codes into the tensor cores' operand registers
(`groupwise_mma_triton`) against the exact product, at the 27B and 35B-A3B shapes and at
shapes whose groups do not fill its warps' turns."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


def _exact_bound_holds(out: torch.Tensor, x: torch.Tensor, encoded) -> torch.Tensor:
    decoded = encoded.decode(torch.float32).double()  # code * scale is exact in fp32
    exact = x.double() @ decoded.T
    magnitude = x.double().abs() @ decoded.abs().T
    error = (out.double() - exact).abs()
    return error <= 2**-8 * exact.abs() + 1e-5 * magnitude


@pytest.mark.parametrize(
    ("offset_in_mma", "prefetch", "tiles", "slots"),
    [(False, False, 4, 2), (True, False, 4, 2), (False, True, 2, 2), (False, False, 1, 4)],
)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize(
    ("n", "k"),
    [
        (34816, 5120),
        (5120, 17408),
        (5120, 6144),
        (16384, 5120),
        (9216, 2048),
        (2048, 4096),
        (16, 64),
        (48, 64 * 7),
        (32, 64 * 37),
    ],
    ids=str,
)
def test_the_product_is_the_exact_product(
    monkeypatch, n, k, m, offset_in_mma, prefetch, tiles, slots
):
    """Within the output's rounding and fp32 sums of the exact product (fp64), with scales of
    both signs over five decades, whatever the x rows (rows past M repeat the last one)."""
    from ninfer.kernels import groupwise_mma_triton
    from ninfer.quant import get_format

    monkeypatch.setattr(groupwise_mma_triton, "OFFSET_IN_MMA", offset_in_mma)
    monkeypatch.setattr(groupwise_mma_triton, "PREFETCH", prefetch)
    monkeypatch.setattr(groupwise_mma_triton, "TILES", tiles)
    monkeypatch.setattr(groupwise_mma_triton, "SLOTS", slots)
    torch.manual_seed(n + k + m)
    weight = torch.randn(n, k, device="cuda") * torch.logspace(-4, 1, n, device="cuda")[:, None]
    encoded = get_format("q4_g64_fp16").encode(weight)
    encoded.planes["scales"][1::7] *= -1
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert groupwise_mma_triton.prepare(encoded) and groupwise_mma_triton.fits(x, encoded)
    out = groupwise_mma_triton.mma_linear(x, encoded)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _exact_bound_holds(out, x, encoded).all()


def test_a_strided_x_row_view():
    """x as a view with a row stride wider than K (a slice of a wider buffer)."""
    from ninfer.kernels import groupwise_mma_triton
    from ninfer.quant import get_format

    encoded = get_format("q4_g64_fp16").encode(torch.randn(256, 1024, device="cuda") * 0.02)
    wide = torch.randn(8, 1024 + 64, device="cuda", dtype=torch.bfloat16)
    x = wide[:5, 64:]
    assert groupwise_mma_triton.prepare(encoded) and groupwise_mma_triton.fits(x, encoded)
    out = groupwise_mma_triton.mma_linear(x, encoded)
    assert _exact_bound_holds(out, x.contiguous(), encoded).all()

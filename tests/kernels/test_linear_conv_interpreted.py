"""The GDN in projection with the causal conv in the integer GEMV's kernel
(`groupwise_gemv_triton.integer_linear_conv`), run by Triton's CPU interpreter: bit for bit the
GEMV followed by the conv kernel, the window of the step's slot shifted as the conv kernel
shifts it and every other slot untouched. fp16 (tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.quant import get_format

require_interpreter()

DTYPE = torch.float16


@pytest.fixture
def kernels():
    torch.manual_seed(0)
    return load_kernel_module("groupwise_gemv_triton"), load_kernel_module("causal_conv1d_triton")


def check_conv_in_the_gemv(kernels, format_name: str, rows: int, k: int, channels: int):
    """The product with the conv of its first `channels` outputs in the kernel against the
    GEMV followed by the conv kernel: bit for bit, the windows of slot 1 shifted alike and
    left changed. Returns (x, weight, the product alone)."""
    gemv, conv = kernels
    weight = get_format(format_name).encode(torch.randn(rows, k) * 0.1)
    x = torch.randn(1, k).to(DTYPE)
    taps = torch.randn(channels, 4).to(DTYPE)
    windows = torch.randn(3, channels, 3).to(DTYPE)
    slot, query_start = (
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    unfused_windows = windows.clone()
    out = gemv.integer_linear_conv(x, weight, taps, windows, slot)
    product = gemv.integer_linear(x, weight)
    mixed = conv.causal_conv1d(product[:, :channels], taps, unfused_windows, slot, query_start)
    assert out.shape == (1, rows)
    assert torch.equal(out[:, :channels], mixed)
    assert torch.equal(out[:, channels:], product[:, channels:])
    assert torch.equal(windows, unfused_windows)
    assert not torch.equal(windows[1], windows.new_zeros(channels, 3))
    return x, weight, product


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize(("rows", "channels"), [(160, 96), (136, 72)], ids=["whole", "straddled"])
def test_conv_in_the_gemv_gives_the_two_kernels_bit_for_bit(kernels, format_name, rows, channels):
    """72 conv channels: a program holds conv and z rows both."""
    check_conv_in_the_gemv(kernels, format_name, rows, 192, channels)


@pytest.mark.parametrize("setting", [(32, 64, 4), (16, 64, 4), (16, 64, 2)], ids=str)
def test_conv_in_the_gemv_at_the_tuned_settings(kernels, monkeypatch, setting):
    """Settings `INT_TUNED` gives products on the H200 (32 rows by 64 words a step, 16 by 64,
    with four warps or two), over several steps of K and a partial last block of rows: still
    the GEMV then the conv kernel bit for bit, and the product within the GEMV's tolerance of
    the fp32 product of the dequantized weight."""
    monkeypatch.setattr(kernels[0], "_int_config", lambda *shape: setting)
    x, weight, product = check_conv_in_the_gemv(kernels, "q4_g64_fp16", 80, 1024, 48)
    exact = x.float() @ weight.decode(torch.float32).T
    assert (product.float() - exact).abs().max() <= 2e-3 * exact.abs().max()


def test_the_conv_in_the_gemv_takes_one_token_and_width_four_taps(kernels):
    gemv, _ = kernels
    weight = get_format("q8_g32_fp16").encode(torch.randn(64, 64))
    windows, slot = torch.zeros(2, 32, 3).to(DTYPE), torch.tensor([0], dtype=torch.int32)
    x = torch.randn(2, 64).to(DTYPE)
    with pytest.raises(ValueError, match="one token"):
        gemv.integer_linear_conv(x, weight, torch.zeros(32, 4).to(DTYPE), windows, slot)
    with pytest.raises(ValueError, match=r"\[C, 4\]"):
        gemv.integer_linear_conv(x[:1], weight, torch.zeros(32, 3).to(DTYPE), windows, slot)

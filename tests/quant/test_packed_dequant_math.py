"""The arithmetic behind the tensor-core GEMV's packed dequantization
(`groupwise_gemv_triton._BF16_PAIRS_PTX`), checked in torch for every finite fp16 scale and every
q4 code: the scale splits into bf16 parts hi + lo exactly, code * lo is exact in bf16, and
code * hi + code * lo is code * scale exactly, so one rounding of that sum to bf16 (the PTX's
fused multiply-add) gives what rounding the fp32 product does (`EncodedTensor.decode`)."""

from __future__ import annotations

import torch


def test_two_bf16_parts_give_code_times_scale_rounded_once():
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    scales = bits.view(torch.float16).double()
    scales = scales[torch.isfinite(scales)]
    hi = scales.float().to(torch.bfloat16).double()
    lo_bf16 = (scales - hi).float().to(torch.bfloat16)
    lo = lo_bf16.double()
    assert torch.equal(hi + lo, scales)  # the split is exact
    for code in range(-8, 8):
        low_part = code * lo
        assert torch.equal(low_part.float().to(torch.bfloat16).double(), low_part)
        exact = code * hi + low_part
        assert torch.equal(exact, code * scales)
        reference = (torch.tensor(float(code)) * scales.float()).to(torch.bfloat16)
        assert torch.equal(exact.float().to(torch.bfloat16), reference)


def test_the_nibble_placed_under_0x4300_is_128_plus_the_nibble():
    nibbles = torch.arange(16, dtype=torch.int32)
    values = (0x4300 | nibbles).to(torch.int16).view(torch.bfloat16).double()
    assert torch.equal(values, 128.0 + nibbles.double())
    assert torch.equal(
        torch.tensor(0xC308, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
        torch.tensor(-136.0, dtype=torch.bfloat16),
    )

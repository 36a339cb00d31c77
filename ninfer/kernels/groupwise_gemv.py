"""x @ W.T for a weight stored in a group-wise int format (`q8_g32_fp16`, `q4_g64_fp16`; see
`ninfer.quant.groupwise`) (torch reference): dequantize to the activation dtype, then matmul,
which is what a model that loads the weight dequantized computes. The Triton form, which
dequantizes in registers, is in `groupwise_gemv_triton.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.quant import EncodedTensor


def groupwise_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x: [M, K]; weight: an encoded [N, K] tensor. Returns [M, N] in x's dtype."""
    return F.linear(x, weight.decode(x.dtype))

"""A group-wise int weight (`q8_g32_fp16`, `q4_g64_fp16`; see `ninfer.quant.groupwise`) decoded
to a dense tensor (torch reference): fp32(code) * fp32(scale), rounded once to the requested
dtype. The Triton form, which prefill runs before its dense matmul, is in
`groupwise_dequant_triton.py`."""

from __future__ import annotations

import torch

from ninfer.quant import EncodedTensor


def groupwise_dequant(weight: EncodedTensor, dtype: torch.dtype) -> torch.Tensor:
    """weight: an encoded [N, K] tensor. Returns the dense [N, K] weight in `dtype`."""
    return weight.decode(dtype)

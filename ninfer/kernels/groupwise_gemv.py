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


def swiglu_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """silu(gate) * up for an encoded [2F, K] weight stacking gate's rows over up's: [M, F]
    (`groupwise_gemv_gluon.q4_swiglu_linear` in one kernel)."""
    gate, up = groupwise_linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_groupwise_linear(
    x: torch.Tensor, weight: EncodedTensor, x_rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """MoE form: x [T, K]; weight: encoded stacked experts [E, N, K] with planes [E, N, ...];
    x_rows, experts: [P]. Returns [P, N]: row p is W[experts[p]] @ x[x_rows[p]]. Decodes each
    expert that occurs once, reading the ids on the host."""
    _, n, k = weight.shape
    out = x.new_empty(experts.shape[0], n)
    for expert in experts.unique().tolist():
        pairs = (experts == expert).nonzero()[:, 0]
        planes = {name: plane[expert] for name, plane in weight.planes.items()}
        dense = EncodedTensor(weight.format, weight.layout, (n, k), planes).decode(x.dtype)
        out[pairs] = F.linear(x[x_rows[pairs]], dense)
    return out

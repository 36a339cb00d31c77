"""Gated DeltaNet gates from the b and a projections (torch reference):
    beta = sigmoid(b)                                      in b's dtype
    g    = -exp(A_log_f32) * softplus(a_f32 + dt_bias)     fp32 (log decay per token and head)
The arithmetic the GDN layer has always done (transformers' Qwen3.5); the one-kernel Triton
forms (from b and a, or from the layer input with the b|a product inside) are in
`gdn_gates_triton.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a: [T, H] (e.g. the two halves of the fused b|a projection); A_log, dt_bias: [H].
    Returns (g [T, H] fp32, beta [T, H] in b's dtype)."""
    beta = torch.sigmoid(b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gdn_gates_from_x(
    x: torch.Tensor, w_ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, hidden]; w_ba: [2H, hidden], the b rows stacked over the a rows (the fused b|a
    projection's weight). The product in x's dtype, as the linear returns it, then `gdn_gates`
    on its halves."""
    b, a = F.linear(x, w_ba).chunk(2, dim=-1)
    return gdn_gates(b, a, A_log, dt_bias)

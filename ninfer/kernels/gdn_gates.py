"""Gated DeltaNet gates from the b and a projections (torch reference):
    beta = sigmoid(b)                                      in b's dtype
    g    = -exp(A_log_f32) * softplus(a_f32 + dt_bias)     fp32 (log decay per token and head)
The arithmetic the GDN layer has always done (transformers' Qwen3.5); the one-kernel Triton
form is in `gdn_gates_triton.py`."""

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

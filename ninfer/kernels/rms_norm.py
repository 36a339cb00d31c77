"""The Qwen (1 + w) RMSNorm, optionally fused with the residual add before it (torch reference):
    h = x + residual (rounded to the activation dtype, as an unfused add is)
    y = (h_f32 * rsqrt(mean(h_f32^2) + eps) * (1 + w_f32)).to(dtype)
The arithmetic of `models.layers.norms.RMSNorm`; the Triton form is in `rms_norm_triton.py`.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Returns y, or (y, x + residual) when `residual` is given."""
    total = x if residual is None else x + residual
    xf = total.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * (1.0 + weight.float())).to(
        x.dtype
    )
    return y if residual is None else (y, total)

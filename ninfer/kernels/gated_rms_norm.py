"""The GDN output norm (torch reference), the arithmetic of `models.layers.norms.GatedRMSNorm`:
    normed = x_f32 * rsqrt(mean(x_f32^2) + eps), rounded to x's dtype
    scaled = w * normed (in the dtype torch promotes w and x to: x's dtype for the model)
    y = (scaled_f32 * silu(z_f32)).to(dtype)
The Triton form is in `gated_rms_norm_triton.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, z: [..., dim] of one shape (one row per head); weight: [dim]. Returns y in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    scaled = weight * normed.to(x.dtype)
    return (scaled.float() * F.silu(z.float())).to(x.dtype)

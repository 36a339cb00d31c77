"""Qwen3.5 norms. `RMSNorm` stores an offset w and scales by (1 + w), multiplying in fp32 and
casting once; `GatedRMSNorm` (GDN output) scales by plain w in the model dtype, then by silu(z)
in fp32, as the reference does."""

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.kernels.dispatch import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        scaled = self.weight * normed.to(x.dtype)
        return (scaled.float() * F.silu(z.float())).to(x.dtype)

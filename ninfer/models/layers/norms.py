"""Qwen3.5 norms. `RMSNorm` stores an offset w and scales by (1 + w), multiplying in fp32 and
casting once, optionally adding the residual first (`kernels/rms_norm.py`); `GatedRMSNorm`
(GDN output) scales by plain w in the model dtype, then by silu(z) in fp32, as the reference
does."""

import torch
from torch import nn

from ninfer.kernels.dispatch import gated_rms_norm, rms_norm
from ninfer.kernels.x_split import SplitRequest


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        # the integer-GEMV codes the output's consumer wants beside it (`request_x_splits`)
        self.split_request: SplitRequest | None = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or (norm(x + residual), x + residual): the residual add of a decoder
        layer fused into the norm that follows it."""
        return rms_norm(x, self.weight, self.eps, residual, self.split_request)


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.split_request: SplitRequest | None = None  # as RMSNorm's

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, self.split_request)

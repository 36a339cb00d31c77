"""SwiGLU activation: silu(gate) * up (torch reference)."""

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [..., n] of one shape; returns silu(gate) * up in gate's dtype."""
    return F.silu(gate) * up

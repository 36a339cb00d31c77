"""Partial half-split (NeoX) rotary embedding on the first `rot` dims (torch reference).

cos and sin ([T, rot], model dtype) already hold each token's angles (M-RoPE's interleaving of
T/H/W positions happens when they are built, in models/layers/rotary.py); dims rot.. pass
through."""

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; returns the rotated tensor (the reference leaves x alone)."""
    rot_dim = cos.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    rot = rot * cos[:, None] + rotated * sin[:, None]
    return torch.cat([rot, rest], dim=-1)

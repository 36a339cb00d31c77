"""The gated-attention output gate (torch reference): attn * sigmoid(gate), flattened over the
heads for o_proj; sigmoid rounded to the activation dtype, then the product, as eager torch
rounds them. The Triton form is in `output_gate_triton.py`."""

from __future__ import annotations

import torch


def sigmoid_gate(attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """attn, gate: [T, heads, head_dim] (gate may be a strided view, e.g. the gate half of each
    head of q_proj's output); returns [T, heads * head_dim] in attn's dtype."""
    tokens = attn.shape[0]
    return attn.reshape(tokens, -1) * torch.sigmoid(gate.reshape(tokens, -1))

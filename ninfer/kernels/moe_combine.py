"""MoE output (torch reference): each token's k expert outputs weighted and added in expert id
order, plus the shared expert scaled by its sigmoid gate, rounded to the model dtype after every
operation as the eager module computes it."""

from __future__ import annotations

import torch


def moe_combine(
    choices: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first: int,
    count: int,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
) -> torch.Tensor:
    """choices [T, k, H] (token t's expert outputs in expert id order); weights, experts
    [T, k]; shared [T, H]; shared_gate [T, 1] (the logit). Choices of experts outside
    first..first + count - 1 (another rank's) add zero. Returns [T, H] in choices' dtype."""
    held = (experts >= first) & (experts < first + count)
    weighted = choices * weights[:, :, None]
    weighted.masked_fill_(~held[:, :, None], 0)
    routed = weighted[:, 0]
    for choice in range(1, weighted.shape[1]):
        routed = routed + weighted[:, choice]
    return routed + torch.sigmoid(shared_gate) * shared

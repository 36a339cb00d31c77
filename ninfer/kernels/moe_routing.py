"""MoE routing (torch reference): router logits -> fp32 softmax over the experts -> top-k ->
renormalised weights in the model dtype, each token's choices in expert id order, and the
(token, expert) pair lists the grouped expert GEMV reads."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Routes(NamedTuple):
    """Each token's top-k choices in expert id order, and those choices as pairs
    p = t * k + c (token t's c-th choice). With `shared`, T more pairs follow: p = T * k + t is
    token t with local expert `count`, the shared expert stacked after the held ones."""

    weights: torch.Tensor  # [T, k] renormalised, in the model dtype
    experts: torch.Tensor  # [T, k] int32 global expert ids, ascending per token
    pair_tokens: torch.Tensor  # [P] int32: t
    pair_experts: torch.Tensor  # [P] int32: the expert's local id, clamped into the held range
    pairs: torch.Tensor  # [P] int32: p itself (the row of a pair's own activations)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    dtype: torch.dtype,
    first: int,
    count: int,
    shared: bool = False,
) -> Routes:
    """logits [T, E] (any float dtype, rows may be strided); this rank holds experts
    first..first + count - 1. Which of equal probabilities top-k keeps is torch.topk's choice.
    P = T * k pairs, or T * (k + 1) with `shared`."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(dtype)
    experts, order = experts.sort(dim=-1)
    weights = weights.gather(1, order)
    tokens = logits.shape[0]
    device = logits.device
    routed = tokens * top_k
    pairs = torch.arange(routed + (tokens if shared else 0), dtype=torch.int32, device=device)
    local = (experts - first).clamp(0, count - 1).to(torch.int32).reshape(-1)
    pair_tokens = pairs // top_k
    if shared:
        pair_tokens[routed:] = pairs[routed:] - routed
        local = torch.cat([local, local.new_full((tokens,), count)])
    return Routes(weights, experts.to(torch.int32), pair_tokens, local, pairs)

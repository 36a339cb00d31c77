"""MoE router product and routing (torch reference): the router's logits x @ W.T in x's dtype
as F.linear computes them, then `moe_routing.moe_route` on the first num_experts of them. With
the shared expert's gate stacked as row num_experts of W, its logit is that column of the
product. `moe_norm_router_route` is the RMSNorm(+residual) before the router (`rms_norm`),
then the router, for a MoE block that takes its input from that norm alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.moe_routing import Routes, moe_route
from ninfer.kernels.rms_norm import rms_norm


def check_router(x: torch.Tensor, router_weight: torch.Tensor, num_experts: int) -> None:
    rows, hidden = router_weight.shape
    if hidden != x.shape[1] or rows not in (num_experts, num_experts + 1):
        raise ValueError(
            f"router weight {tuple(router_weight.shape)} is not {num_experts} experts' rows "
            f"(and a shared gate's) over hidden size {x.shape[1]}"
        )


def moe_router_route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
) -> tuple[Routes, torch.Tensor]:
    """x [T, H]; router_weight [E, H], or [E + 1, H] with the shared expert's gate stacked
    last. Returns the routes (weights in x's dtype; `first`, `count`, `shared` as for
    `moe_route`) and the router's logits [T, E or E + 1] in x's dtype: column E, where there
    is one, is the shared gate's logit."""
    check_router(x, router_weight, num_experts)
    logits = F.linear(x, router_weight)
    return moe_route(logits[:, :num_experts], top_k, x.dtype, first, count, shared), logits


def moe_norm_router_route(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    first: int,
    count: int,
    shared: bool = False,
) -> tuple[Routes, torch.Tensor, torch.Tensor, torch.Tensor]:
    """normed, total = rms_norm(x, norm_weight, eps, residual), then `moe_router_route` of
    normed. Returns (routes, logits, normed, total)."""
    normed, total = rms_norm(x, norm_weight, eps, residual)
    routes, logits = moe_router_route(
        normed, router_weight, num_experts, top_k, first, count, shared
    )
    return routes, logits, normed, total

"""MoE router product and routing (torch reference): the router's logits x @ W.T in x's dtype
as F.linear computes them, then `moe_routing.moe_route` on the first num_experts of them. A
router stacked with the shared expert's gate (row num_experts of W) also gives that logit."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.kernels.moe_routing import Routes, moe_route


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
) -> tuple[Routes, torch.Tensor | None]:
    """x [T, H]; router_weight [E, H], or [E + 1, H] with the shared expert's gate stacked
    last. Returns the routes (weights in x's dtype; `first`, `count`, `shared` as for
    `moe_route`) and the shared gate's logit [T, 1] in x's dtype, or None without its row."""
    check_router(x, router_weight, num_experts)
    logits = F.linear(x, router_weight)
    routes = moe_route(logits[:, :num_experts], top_k, x.dtype, first, count, shared)
    return routes, shared_gate_of(logits, num_experts)


def shared_gate_of(logits: torch.Tensor, num_experts: int) -> torch.Tensor | None:
    """The stacked shared gate's column of a router product [T, E or E + 1], or None."""
    return logits[:, num_experts:] if logits.shape[1] > num_experts else None

"""MoE output in Triton: the k weighted expert outputs, their sum in expert id order, the
shared expert's sigmoid gate and product, and the final sum in one launch where eager torch
runs about fourteen (a launch-bound decode step pays each). Every intermediate is rounded to the
model dtype where the eager module rounds it, so the result is the eager result bit for bit
except where the sigmoid itself rounds differently (the GPU's approximate fp32 exp). Contraction
into fused multiply-adds is off: it would drop the rounding of a product.
Reference: `moe_combine.moe_combine` (same signature)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

BLOCK_H = 512


@triton.jit
def _moe_combine_kernel(
    choices_ptr,
    weights_ptr,
    experts_ptr,
    shared_ptr,
    shared_gate_ptr,
    out_ptr,
    hidden,
    first,
    count,
    stride_choice_t,
    stride_choice_c,
    stride_weights,
    stride_experts,
    stride_shared,
    stride_gate,
    stride_out,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    routed = tl.zeros([BLOCK_H], tl.float32)
    for choice in tl.static_range(TOP_K):
        expert = tl.load(experts_ptr + token * stride_experts + choice)
        weight = tl.load(weights_ptr + token * stride_weights + choice).to(tl.float32)
        y = tl.load(
            choices_ptr + token * stride_choice_t + choice * stride_choice_c + cols,
            mask=mask,
            other=0.0,
        ).to(tl.float32)
        held = (expert >= first) & (expert < first + count)
        weighted = tl.where(held, (y * weight).to(dtype).to(tl.float32), 0.0)
        if choice == 0:
            routed = weighted
        else:
            routed = (routed + weighted).to(dtype).to(tl.float32)
    gate = tl.load(shared_gate_ptr + token * stride_gate).to(tl.float32)
    # torch's sigmoid: 1 / (1 + exp(-x)) with an IEEE division (tl.sigmoid's is approximate)
    scale = tl.div_rn(1.0, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    shared = tl.load(shared_ptr + token * stride_shared + cols, mask=mask, other=0.0)
    scaled = (scale * shared.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, (routed + scaled).to(dtype), mask=mask)


def moe_combine(
    choices: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first: int,
    count: int,
    shared: torch.Tensor,
    shared_gate: torch.Tensor,
) -> torch.Tensor:
    """choices [T, k, H] and shared [T, H] with unit stride along H; shared_gate [T, 1] (rows
    may be strided, e.g. a column of a stacked router product)."""
    tokens, top_k, hidden = choices.shape
    out = torch.empty(tokens, hidden, dtype=choices.dtype, device=choices.device)
    if tokens:
        block_h = min(BLOCK_H, next_power_of_2(hidden))
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
            choices,
            weights,
            experts,
            shared,
            shared_gate,
            out,
            hidden,
            first,
            count,
            choices.stride(0),
            choices.stride(1),
            weights.stride(0),
            experts.stride(0),
            shared.stride(0),
            shared_gate.stride(0),
            out.stride(0),
            TOP_K=top_k,
            BLOCK_H=block_h,
            num_warps=4,
            enable_fp_fusion=False,  # a fused multiply-add would skip the product's rounding
            **pdl_options(choices.device),
        )
    return out

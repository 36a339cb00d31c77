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
        y = tl.load(
            choices_ptr + token * stride_choice_t + choice * stride_choice_c + cols,
            mask=mask,
            other=0.0,
        )
        routed = add_choice(
            routed,
            y,
            tl.load(weights_ptr + token * stride_weights + choice).to(tl.float32),
            tl.load(experts_ptr + token * stride_experts + choice),
            first,
            count,
            choice == 0,
            dtype,
            False,
        )
    shared = tl.load(shared_ptr + token * stride_shared + cols, mask=mask, other=0.0)
    gate = tl.load(shared_gate_ptr + token * stride_gate).to(tl.float32)
    out = with_shared(routed, shared, gate, dtype, False)
    tl.store(out_ptr + token * stride_out + cols, out, mask=mask)


@triton.jit
def mul_rn(a, b, MUL_RN: tl.constexpr):
    """a * b in fp32, never contracted into a fused multiply-add with a later addition: PTX's
    `mul.rn` where MUL_RN (a kernel compiled with fp fusion on; on the H200 the compiler fused
    the shared expert's scaled row into the final sum through its rounding to bf16), else the
    plain product (fusion off, or Triton's interpreter)."""
    if MUL_RN:
        a, b = tl.broadcast(a, b)
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a * b


@triton.jit
def add_choice(
    routed,
    y,
    weight,
    expert,
    first,
    count,
    FIRST: tl.constexpr,
    dtype,
    MUL_RN: tl.constexpr,
):
    """The routed sum so far (fp32 holding `dtype` values) plus one choice's expert output y
    times its weight (fp32), each rounded to `dtype` as the eager module rounds it; a choice of
    an expert (its global id) outside first..first + count - 1 adds zero. Shared with the
    experts' down product that combines in its kernel
    (`groupwise_gemv_triton.grouped_swiglu_combine`), so that both round alike (`mul_rn`); the
    callers read the routes, so that the down product can ask for them early."""
    held = (expert >= first) & (expert < first + count)
    product = mul_rn(y.to(tl.float32), weight, MUL_RN)
    weighted = tl.where(held, product.to(dtype).to(tl.float32), 0.0)
    if FIRST:
        return weighted
    else:
        return (routed + weighted).to(dtype).to(tl.float32)


@triton.jit
def with_shared(routed, shared, gate, dtype, MUL_RN: tl.constexpr):
    """The block's output in `dtype`: the routed sum plus the shared expert's output scaled
    by the sigmoid of its gate logit (fp32), torch's 1 / (1 + exp(-x)) with an IEEE division
    (tl.sigmoid's is approximate)."""
    scale = tl.div_rn(1.0, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    shared = shared.to(tl.float32)
    scaled = mul_rn(scale, shared, MUL_RN).to(dtype).to(tl.float32)
    return (routed + scaled).to(dtype)


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

"""The gated-attention output gate in Triton: attn * sigmoid(gate) in one pass, gate read in
place from its [T, heads, head_dim] view inside q_proj's output. Eager torch launches three
kernels here (a copy to flatten the strided gate, sigmoid, the product), a decode step one per
attention layer. Reference: `output_gate.sigmoid_gate` (same signature and roundings).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.groupwise_gemv_triton import split_block
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.x_split import SplitRequest, attach, producer_buffers, split_launch_args

BLOCK = 1024


@triton.jit
def _sigmoid_gate_kernel(
    attn_ptr,
    gate_ptr,
    out_ptr,
    width,
    head_dim,
    stride_attn,
    stride_gate_token,
    stride_gate_head,
    stride_out,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    BLOCK: tl.constexpr,
    SPLIT_BITS: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate_offsets = (cols // head_dim) * stride_gate_head + cols % head_dim
    gate = tl.load(gate_ptr + token * stride_gate_token + gate_offsets, mask=mask, other=0.0)
    attn = tl.load(attn_ptr + token * stride_attn + cols, mask=mask, other=0.0)
    # rounded to the activation dtype before the product, as torch.sigmoid's output is
    sig = tl.sigmoid(gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    out = (attn.to(tl.float32) * sig.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + cols, out, mask=mask)
    if SPLIT_BITS != 0:  # this block's integer-GEMV codes (x_split.py)
        split_block(
            out,
            width,
            tl.program_id(1),
            token,
            xq_ptr,
            corr_ptr,
            xscale_ptr,
            BLOCK,
            SPLIT_BITS,
            SPLIT_GROUP,
        )


def sigmoid_gate(
    attn: torch.Tensor, gate: torch.Tensor, split: SplitRequest | None = None
) -> torch.Tensor:
    """Same contract as `output_gate.sigmoid_gate`; gate needs unit stride on head_dim only,
    attn is flattened over its heads (copied where it cannot be viewed so). With `split`, the
    output carries its integer-GEMV codes (`x_split`)."""
    tokens, heads, head_dim = gate.shape
    width = heads * head_dim
    attn_rows = attn.reshape(tokens, width)
    if attn_rows.stride(-1) != 1:
        attn_rows = attn_rows.contiguous()
    out = torch.empty(tokens, width, dtype=attn.dtype, device=attn.device)
    buffers = producer_buffers(split, tokens, width, out.device, BLOCK)
    split_args, split_constants = split_launch_args(split, buffers, out, BLOCK)
    if out.numel():
        _sigmoid_gate_kernel[(tokens, triton.cdiv(width, BLOCK))](
            attn_rows,
            gate,
            out,
            width,
            head_dim,
            attn_rows.stride(0),
            gate.stride(0),
            gate.stride(1),
            out.stride(0),
            *split_args,
            BLOCK=BLOCK,
            **split_constants,
            num_warps=4,
            **pdl_options(attn_rows.device),
        )
    if buffers is not None:
        attach(out, split, buffers)
    return out

"""Group-wise int weights (`q8_g32_fp16`, `q4_g64_fp16`) decoded to a dense [N, K] tensor in
Triton, for prefill's dense matmul. Our own for speed: no library decodes our layout, and this
runs before every quantized linear at every prefill chunk (the torch reference, through int16
and fp32 temporaries, is about 20x slower), so it must move bytes at close to the copy rate.

Codes are read as 32-bit words. A code becomes a float without an int -> float conversion:
with its sign bit flipped it is u = c + 2^(bits-1) in [0, 2^bits), the fp32 whose bits are
0x4B000000 | u is 2^23 + u exactly, and subtracting 2^23 + 2^(bits-1) leaves c. The values of a
word are interleaved back into order in registers, so each thread stores a run of contiguous
outputs. fp32(code) * fp32(scale) is exact (at most 8 + 11 significant bits) and is rounded
once to the output dtype, as the reference does, so the result is bit-identical to it.
Reference: `groupwise_dequant.groupwise_dequant`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.quant import EncodedTensor

SUPPORTED = {"q8_g32_fp16": (8, 32), "q4_g64_fp16": (4, 64)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Flips the sign bit of every code in a word, mapping code c to the unsigned c + 2^(bits-1);
# written as the signed int32 of the same bits.
_SIGN_FLIP = {4: 0x88888888 - (1 << 32), 8: 0x80808080 - (1 << 32)}
# The fastest robust tile on the GPU machine at 17408x5120: q4 80-84%, q8 83-86% of the copy
# rate (plain launches / graph replay), where a kernel moving the same bytes without decoding
# reaches 85% and plain writes (fill_) 73%.
BLOCK_N = 8  # weight rows per program
BLOCK_K = 1024  # weight columns per program
NUM_WARPS = 4


@triton.jit
def _scaled_code(flipped, shift: tl.constexpr, BITS: tl.constexpr, scale, dtype: tl.constexpr):
    """The code at bit `shift` of each (sign-flipped) word, times its scale, in `dtype`."""
    mantissa = ((flipped >> shift) & ((1 << BITS) - 1)) | 0x4B000000
    code = mantissa.to(tl.float32, bitcast=True) - (8388608.0 + (1 << (BITS - 1)))
    return (code * scale).to(dtype)


@triton.jit
def _in_order(flipped, base: tl.constexpr, BITS: tl.constexpr, scale, dtype: tl.constexpr):
    """The codes at bits base, base + 8, base + 16, base + 24 of each word, in that order along
    the last axis (interleave(a, b) puts a[i] at 2i and b[i] at 2i + 1)."""
    return tl.interleave(
        tl.interleave(
            _scaled_code(flipped, base, BITS, scale, dtype),
            _scaled_code(flipped, base + 16, BITS, scale, dtype),
        ),
        tl.interleave(
            _scaled_code(flipped, base + 8, BITS, scale, dtype),
            _scaled_code(flipped, base + 24, BITS, scale, dtype),
        ),
    )


@triton.jit
def _groupwise_dequant_kernel(
    words_ptr,
    scales_ptr,
    out_ptr,
    N,
    K,
    num_words,
    stride_words,
    stride_scales,
    stride_out,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    SIGN_FLIP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    row_offsets = rows.to(tl.int64)[:, None]
    row_mask = (rows < N)[:, None]
    mask = row_mask & (words < num_words)[None, :]
    packed = tl.load(words_ptr + row_offsets * stride_words + words[None, :], mask=mask, other=0)
    flipped = packed ^ SIGN_FLIP
    group = words // (GROUP // PER_WORD)
    scale = tl.load(
        scales_ptr + row_offsets * stride_scales + group[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if BITS == 4:
        # nibble j of a word is value j: the even ones sit at bits 0, 8, 16, 24, the odd at 4 + those
        values = tl.interleave(
            _in_order(flipped, 0, BITS, scale, dtype), _in_order(flipped, 4, BITS, scale, dtype)
        )
    else:
        values = _in_order(flipped, 0, BITS, scale, dtype)
    cols = tl.program_id(1) * (BLOCK_W * PER_WORD) + tl.arange(0, BLOCK_W * PER_WORD)
    tl.store(
        out_ptr + row_offsets * stride_out + cols[None, :],
        values,
        mask=row_mask & (cols < K)[None, :],
    )


def groupwise_dequant(weight: EncodedTensor, dtype: torch.dtype) -> torch.Tensor:
    """weight: an encoded [N, K] tensor in a SUPPORTED format; dtype one of DTYPES. Returns the
    dense [N, K] weight in `dtype` on the planes' device."""
    bits, group = SUPPORTED[weight.format]
    num_rows, k = weight.shape
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    if codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("groupwise dequantization needs unit stride along K")
    words = codes.view(torch.int32)
    out = torch.empty(num_rows, k, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    block_w = BLOCK_K * bits // 32
    grid = (triton.cdiv(num_rows, BLOCK_N), triton.cdiv(words.shape[1], block_w))
    _groupwise_dequant_kernel[grid](
        words,
        scales,
        out,
        num_rows,
        k,
        words.shape[1],
        words.stride(0),
        scales.stride(0),
        out.stride(0),
        BITS=bits,
        GROUP=group,
        SIGN_FLIP=_SIGN_FLIP[bits],
        BLOCK_N=BLOCK_N,
        BLOCK_W=block_w,
        num_warps=NUM_WARPS,
        **pdl_options(words.device),
    )
    return out

"""Group-wise int GEMV/small-M GEMM in Triton for `q8_g32_fp16` and `q4_g64_fp16` weights.
Our own because no library reads this layout, and decode time is these kernels' time.

Decode reads every weight once per step, so the codes are read straight from their stored
planes and dequantized in registers. Two kernels:
- one x row per program (M <= `VECTOR_MAX_ROWS`, and the grouped expert form for MoE decode):
  the codes are read as 32-bit words and turned into fp32 without int-to-float instructions
  (a quarter-rate unit on the GPU): or-ing a code u (0..2^b-1, after flipping its sign bit)
  at bit position b*p into the mantissa of 2^23 gives the float 2^23 + u*2^(b*p) exactly, so
  one logic op and one subtraction give (u - 2^(b-1)) * 2^(b*p), and x is pre-scaled by
  2^(-b*p). Products accumulate in fp32 per group and are scaled once per group and row.
- several x rows (x padded to 16 rows): codes are exact in bf16/fp16, so each group's product
  x_g · codes_g runs on the tensor cores and is scaled once per group and row afterwards. The
  q4 nibbles of a byte are values 2j and 2j+1, so they meet x's even and odd columns. Split-K
  fills the GPU when N is small; the splits' fp32 partials are summed at the end.
Reference: `groupwise_gemv.groupwise_linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton_support import next_power_of_2, num_sms
from ninfer.quant import EncodedTensor

SUPPORTED = {"q8_g32_fp16": (8, 32), "q4_g64_fp16": (4, 64)}
GROUPS_PER_STEP = 4
# Up to this many x rows each run the one-row kernel (the weight is read once per row, from
# the L2 after the first); beyond it the tensor-core kernel reads it once for all rows.
VECTOR_MAX_ROWS = 1
# One-row kernel: weight rows per program and 32-bit code words per step along K, the fastest
# at the Qwen3.5-27B shapes on the GPU machine (bench/decode_kernels.md); fewer rows per
# program where N is small, so the grid still fills the GPU.
VECTOR_BLOCK_N, VECTOR_BLOCK_WORDS = 16, 128
# Weight rows per program, per format: the faster of 64 and 128 at M = 1..8 on the GPU machine
# (bench/decode_kernels.md).
BLOCK_N = {"q8_g32_fp16": 64, "q4_g64_fp16": 128}


@triton.jit
def _groupwise_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    partial_ptr,
    M,
    N,
    K,
    num_groups,
    groups_per_split,
    stride_xm,
    stride_codes,
    stride_scales,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    STEP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_rows = x_ptr + ms[:, None] * stride_xm
    code_rows = codes_ptr + rows[:, None].to(tl.int64) * stride_codes
    scale_rows = scales_ptr + rows.to(tl.int64) * stride_scales
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, num_groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(first, last, STEP):
        for i in tl.static_range(STEP):
            group = step + i
            # masks must be tensors in the interpreter, so "group < last" is asked per element
            if BITS == 8:
                ks = group * GROUP + tl.arange(0, GROUP)
                live = ks < last * GROUP
                codes = tl.load(
                    code_rows + ks[None, :], mask=row_mask[:, None] & live[None, :], other=0
                )
                xs = tl.load(
                    x_rows + ks[None, :],
                    mask=m_mask[:, None] & (live & (ks < K))[None, :],
                    other=0.0,
                )
                part = tl.dot(xs, tl.trans(codes.to(xs.dtype)))
            else:
                cols = group * (GROUP // 2) + tl.arange(0, GROUP // 2)
                live = cols < last * (GROUP // 2)
                packed = tl.load(
                    code_rows + cols[None, :], mask=row_mask[:, None] & live[None, :], other=0
                ).to(tl.int32)
                low = ((packed & 15) ^ 8) - 8
                high = ((packed >> 4) ^ 8) - 8
                even = 2 * cols
                x_even = tl.load(
                    x_rows + even[None, :],
                    mask=m_mask[:, None] & (live & (even < K))[None, :],
                    other=0.0,
                )
                x_odd = tl.load(
                    x_rows + even[None, :] + 1,
                    mask=m_mask[:, None] & (live & (even + 1 < K))[None, :],
                    other=0.0,
                )
                part = tl.dot(x_even, tl.trans(low.to(x_even.dtype)))
                part = tl.dot(x_odd, tl.trans(high.to(x_odd.dtype)), part)
            scale_mask = row_mask & (rows * 0 + group < last)
            scale = tl.load(scale_rows + group, mask=scale_mask, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
    out = partial_ptr + (split * M + ms[:, None]) * N + rows[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def _word_position(words, xs, BITS: tl.constexpr, P: tl.constexpr):
    """(code at bit BITS*P of each sign-flipped word) * 2^(BITS*P) * xs, in fp32, exactly:
    the code or-ed into the mantissa of 2^23 is 2^23 + u * 2^(BITS*P)."""
    field = words & (((1 << BITS) - 1) << (BITS * P))
    value = (field | 0x4B000000).to(tl.float32, bitcast=True)
    value -= 8388608.0 + (1 << (BITS - 1)) * (1 << (BITS * P))
    return value * xs


@triton.jit
def _x_position(x_base, first, K, S: tl.constexpr, BITS: tl.constexpr):
    """x at the S-th code of each word (`first`: the K index of each word's first code),
    pre-scaled by 2^-(BITS * (S mod half a word)); zero in the padding past K."""
    half: tl.constexpr = 16 // BITS
    xs = tl.load(x_base + first + S, mask=first + S < K, other=0.0).to(tl.float32)
    return (xs * (1.0 / (1 << (BITS * (S % half)))))[None, :]


@triton.jit
def _groupwise_gemv_rows_kernel(
    x_ptr,
    words_ptr,
    scales_ptr,
    out_ptr,
    x_rows_ptr,
    experts_ptr,
    N,
    K,
    num_words,
    stride_xm,
    stride_we,
    stride_words,
    stride_se,
    stride_scales,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    GATHER: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    """out[r, rows] = W[e] x[i] for output row r, with (i, e) = (r, 0) or, when GATHER, read
    from x_rows / experts (one MoE token-expert pair per output row). With SPLITS = 2 the two
    halves of K are added into a zeroed fp32 `out` (0 + a + b = 0 + b + a: deterministic)."""
    pid_n = tl.program_id(0)
    r = tl.program_id(1)
    split = tl.program_id(2)
    if GATHER:
        x_row = tl.load(x_rows_ptr + r).to(tl.int64)
        expert = tl.load(experts_ptr + r).to(tl.int64)
    else:
        x_row = r.to(tl.int64)
        expert = 0
    per_word: tl.constexpr = 32 // BITS
    words_per_group: tl.constexpr = GROUP // per_word
    sign_flip: tl.constexpr = -0x77777778 if BITS == 4 else -0x7F7F7F80  # 0x88888888, 0x80808080
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    word_rows = words_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_words
    scale_rows = scales_ptr + expert * stride_se + rows[:, None].to(tl.int64) * stride_scales
    x_base = x_ptr + x_row * stride_xm
    acc = tl.zeros([BLOCK_N], tl.float32)
    split_words = tl.cdiv(tl.cdiv(num_words, SPLITS), BLOCK_WORDS) * BLOCK_WORDS
    last = tl.minimum((split + 1) * split_words, num_words)
    for start in tl.range(split * split_words, last, BLOCK_WORDS, num_stages=2):
        cols = start + tl.arange(0, BLOCK_WORDS)
        col_mask = cols < num_words
        words = tl.load(word_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :])
        words = words ^ sign_flip
        high = words >> 16
        first = cols * per_word
        part = _word_position(words, _x_position(x_base, first, K, 0, BITS), BITS, 0)
        if BITS == 4:
            part += _word_position(words, _x_position(x_base, first, K, 1, BITS), BITS, 1)
            part += _word_position(words, _x_position(x_base, first, K, 2, BITS), BITS, 2)
            part += _word_position(words, _x_position(x_base, first, K, 3, BITS), BITS, 3)
            part += _word_position(high, _x_position(x_base, first, K, 4, BITS), BITS, 0)
            part += _word_position(high, _x_position(x_base, first, K, 5, BITS), BITS, 1)
            part += _word_position(high, _x_position(x_base, first, K, 6, BITS), BITS, 2)
            part += _word_position(high, _x_position(x_base, first, K, 7, BITS), BITS, 3)
        else:
            part += _word_position(words, _x_position(x_base, first, K, 1, BITS), BITS, 1)
            part += _word_position(high, _x_position(x_base, first, K, 2, BITS), BITS, 0)
            part += _word_position(high, _x_position(x_base, first, K, 3, BITS), BITS, 1)
        groups = start // words_per_group + tl.arange(0, BLOCK_WORDS // words_per_group)
        group_sums = tl.sum(
            tl.reshape(part, [BLOCK_N, BLOCK_WORDS // words_per_group, words_per_group]), axis=2
        )
        scales = tl.load(
            scale_rows + groups[None, :],
            mask=row_mask[:, None] & (groups * words_per_group < num_words)[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(group_sums * scales, axis=1)
    out = out_ptr + r.to(tl.int64) * stride_om + rows
    if SPLITS == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        tl.atomic_add(out, acc, mask=row_mask, sem="relaxed")


def _vector_grid(num_rows: int, out_rows: int, num_words: int, device: torch.device):
    """(rows per program, K splits): VECTOR_BLOCK_N, halved while the grid would not give every
    SM two programs; and K split in two where the grid stays under three programs per SM and K
    is long, which measured 1.4-1.5x faster at N = 5120 (bench/decode_kernels.md)."""
    sms = num_sms(device)
    block_n = VECTOR_BLOCK_N
    while block_n > 4 and triton.cdiv(num_rows, block_n) * out_rows < 2 * sms:
        block_n //= 2
    programs = triton.cdiv(num_rows, block_n) * out_rows
    splits = 2 if programs < 3 * sms and num_words >= 4 * VECTOR_BLOCK_WORDS else 1
    return block_n, splits


def _rows_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    num_rows: int,
    bits: int,
    group: int,
    x_rows: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one-row kernel over codes [(E,) N, Kp*bits/8] and scales [(E,) N, Kp/group]."""
    words = codes.view(torch.int32)
    gather = experts is not None
    out_rows = experts.shape[0] if gather else x.shape[0]
    num_words = words.shape[-1]
    block_n, splits = _vector_grid(num_rows, out_rows, num_words, x.device)
    if out_rows == 0 or splits == 1:
        out = torch.empty(out_rows, num_rows, dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros(out_rows, num_rows, dtype=torch.float32, device=x.device)
    if out_rows == 0:
        return out
    # words per step: at most the words of a row, and a whole number of groups
    block_words = min(VECTOR_BLOCK_WORDS, next_power_of_2(num_words))
    block_words = max(block_words, group * bits // 32)
    grid = (triton.cdiv(num_rows, block_n), out_rows, splits)
    _groupwise_gemv_rows_kernel[grid](
        x,
        words,
        scales,
        out,
        x_rows if gather else out,
        experts if gather else out,
        num_rows,
        x.shape[1],
        num_words,
        x.stride(0),
        words.stride(0) if words.dim() == 3 else 0,
        words.stride(-2),
        scales.stride(0) if scales.dim() == 3 else 0,
        scales.stride(-2),
        out.stride(0),
        BITS=bits,
        GROUP=group,
        GATHER=gather,
        SPLITS=splits,
        BLOCK_N=block_n,
        BLOCK_WORDS=block_words,
        num_warps=4,
    )
    return out if splits == 1 else out.to(x.dtype)


def _unit_stride_planes(x: torch.Tensor, weight: EncodedTensor):
    """(bits, group, codes, scales) of a SUPPORTED weight, checking unit stride along K."""
    bits, group = SUPPORTED[weight.format]
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    if x.stride(-1) != 1 or codes.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("groupwise GEMV needs unit stride along K")
    return bits, group, codes, scales


def grouped_groupwise_linear(
    x: torch.Tensor, weight: EncodedTensor, x_rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """MoE decode: x [T, K]; weight: encoded stacked experts [E, N, K]; x_rows, experts: [P]
    int32/int64 on x's device. Returns [P, N]: row p is W[experts[p]] @ x[x_rows[p]]. The
    expert ids are read on the device, so the call has fixed shapes (CUDA-graph safe)."""
    bits, group, codes, scales = _unit_stride_planes(x, weight)
    return _rows_linear(x, codes, scales, weight.shape[1], bits, group, x_rows, experts)


def groupwise_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x: [M, K] bf16/fp16; weight: an encoded [N, K] tensor in a SUPPORTED format, planes on
    x's device. Returns [M, N] in x's dtype."""
    bits, group, codes, scales = _unit_stride_planes(x, weight)
    num_rows, k = weight.shape
    m = x.shape[0]
    if m <= VECTOR_MAX_ROWS:
        return _rows_linear(x, codes, scales, num_rows, bits, group)
    num_groups = scales.shape[1]
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = BLOCK_N[weight.format]
    n_blocks = triton.cdiv(num_rows, block_n) * triton.cdiv(m, block_m)
    steps = triton.cdiv(num_groups, GROUPS_PER_STEP)
    splits = max(1, min(steps, triton.cdiv(2 * num_sms(x.device), n_blocks)))
    groups_per_split = triton.cdiv(steps, splits) * GROUPS_PER_STEP
    splits = triton.cdiv(num_groups, groups_per_split)
    partial = torch.empty(splits, m, num_rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(m, block_m), splits)
    _groupwise_gemv_kernel[grid](
        x,
        codes,
        scales,
        partial,
        m,
        num_rows,
        k,
        num_groups,
        groups_per_split,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        BITS=bits,
        GROUP=group,
        STEP=GROUPS_PER_STEP,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return partial.sum(dim=0).to(x.dtype)

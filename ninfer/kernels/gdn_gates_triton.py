"""Gated DeltaNet gates in Triton: beta and g of a block of tokens in one program, from b and
a or (`gdn_gates_from_x`) from the layer input with the b|a product inside.

Eager torch spends about eight elementwise kernels per GDN layer on them (casts, exp, neg,
add, softplus, mul, sigmoid), each a launch of almost no work in a decode step; this reads b
and a (the halves of the fused b|a projection, any row stride) once and writes both results.
fp32 inside; softplus as torch computes it (x above 20 passes through, else log1p(exp(x)),
log1p in the accurate form log(u) * x / (u - 1), u = 1 + x, since Triton has no log1p).
Reference: `gdn_gates.gdn_gates` (same signature).

`gdn_gates_from_x` also computes b and a, the dot products of the layer input with the b|a
weight, for decode-sized batches: cuBLAS runs that tiny product (2H rows) as a split-K GEMM
and a reduce, so b|a product and gates took three launches; here they take one. It lives here
to share the gate arithmetic with the kernel above. Reference: `gdn_gates.gdn_gates_from_x`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.norm_fold import SQUARE_COLUMNS, NormedRows
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import next_power_of_2

# Tokens per program at most (decode steps take fewer: the next power of two of T).
BLOCK_T = 16

# gdn_gates_from_x: one program per token and b|a weight row. beta needs only b and g only a,
# so a row is a whole job; 2H rows per token spread over 96 programs at the 27B shape (48
# heads) and 64 at 35B-A3B (32), against 132 SMs, each reading hidden x 2 bytes (10 KB at
# hidden 5120). Two rows per program would halve that spread for no saving: x is shared
# through L1/L2 anyway.
ROWS_PER_PROGRAM = 1
# Columns per step of the dot product: with 4 warps one 16-byte load of bf16 per thread and
# row. The hidden size is a compile-time constant and the steps are unrolled, so all of a
# row's loads can be in flight at once (5 steps at hidden 5120, 2 at 2048) instead of one
# memory round trip per step.
BLOCK_K = 1024
PROJ_NUM_WARPS = 4
_SQUARE_COLUMNS = tl.constexpr(SQUARE_COLUMNS)


@triton.jit
def _log_decay(a, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), all fp32."""
    x = a + dt_bias
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u == 1.0  # e below half an ulp of 1: log1p(e) is e
    log1p = tl.where(rounded, e, tl.log(u) * (e / tl.where(rounded, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    return -tl.exp(A_log) * softplus


@triton.jit
def _x_dot_rows(
    x_row,
    w_rows,
    row_mask,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_THROUGH_L2: tl.constexpr = False,
):
    """The dot products of one row of x (x_row points at it) with BLOCK_ROWS weight rows
    (w_rows: [BLOCK_ROWS, 1] pointers to their starts): fp32 sums over hidden, rounded to x's
    dtype as the linear's output is, so the gates see the reference's b and a up to the fp32
    summation order. Every kernel taking b and a from x sums here, so all sum in one order
    (the fused MoE router, `moe_router_triton`, sums its logits here too). X_THROUGH_L2: x is
    read from the L2, for a kernel that reads it before its PDL wait."""
    return _x_dot_rows_scaled(
        x_row, w_rows, row_mask, 1.0, HIDDEN, BLOCK_ROWS, BLOCK_K, X_THROUGH_L2
    )


@triton.jit
def _x_dot_rows_scaled(
    x_row,
    w_rows,
    row_mask,
    scale,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_THROUGH_L2: tl.constexpr = False,
):
    """`_x_dot_rows` with the sums multiplied by `scale` (fp32) before they are rounded: x's
    row is then a folded norm's weighted row and scale its factor (`norm_fold`)."""
    acc = tl.zeros([BLOCK_ROWS, BLOCK_K], dtype=tl.float32)
    for start in tl.static_range(0, HIDDEN, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_mask = cols < HIDDEN
        if X_THROUGH_L2:
            x = tl.load(x_row + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
        else:
            x = tl.load(x_row + cols, mask=col_mask, other=0.0)
        x = x.to(tl.float32)
        w = tl.load(
            w_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += w * x[None, :]
    return (tl.sum(acc, axis=1) * scale).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _gdn_gates_kernel(
    b_ptr,
    a_ptr,
    A_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    T,
    H,
    stride_b,
    stride_a,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < H
    mask = (tokens < T)[:, None] & head_mask[None, :]
    rows = tokens.to(tl.int64)[:, None]
    b = tl.load(b_ptr + rows * stride_b + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + rows * stride_a + heads[None, :], mask=mask, other=0.0).to(tl.float32)
    A_log = tl.load(A_log_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    g = _log_decay(a, A_log[None, :], dt_bias[None, :])
    beta = tl.sigmoid(b)
    out = rows * H + heads[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta.to(beta_ptr.dtype.element_ty), mask=mask)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gdn_gates.gdn_gates`; b and a need unit stride along the heads."""
    tokens, heads = b.shape
    if b.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError("gdn gates need unit stride along the heads")
    g = torch.empty(tokens, heads, dtype=torch.float32, device=b.device)
    beta = torch.empty(tokens, heads, dtype=b.dtype, device=b.device)
    if tokens:
        block_t = min(BLOCK_T, next_power_of_2(tokens))
        block_h = next_power_of_2(heads)
        _gdn_gates_kernel[(triton.cdiv(tokens, block_t),)](
            b,
            a,
            A_log,
            dt_bias,
            g,
            beta,
            tokens,
            heads,
            b.stride(0),
            a.stride(0),
            BLOCK_T=block_t,
            BLOCK_H=block_h,
            num_warps=max(1, min(4, block_t * block_h // 256)),
            **pdl_options(b.device),
        )
    return g, beta


@triton.jit
def _gates_from_x_program(
    token,
    row_block,
    x_ptr,
    w_ptr,
    A_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    H,
    stride_x,
    stride_w,
    squares_ptr,
    square_blocks,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SQUARE_BLOCKS: tl.constexpr,
):
    """One program's part of `gdn_gates_from_x`: token `token`'s b|a rows of block
    `row_block` and their gates (also run by `causal_conv1d_triton.causal_conv1d_and_gates`).
    With SQUARE_BLOCKS, x is a folded norm's weighted rows (`norm_fold.NormedRows`) and the
    token's factor comes from the square_blocks sums of squares at squares_ptr."""
    token = token.to(tl.int64)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < 2 * H
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    scale = 1.0
    if SQUARE_BLOCKS > 0:
        blocks = tl.arange(0, SQUARE_BLOCKS)
        squares = tl.load(
            squares_ptr + blocks * _SQUARE_COLUMNS + token, mask=blocks < square_blocks, other=0.0
        )
        scale = tl.rsqrt(tl.sum(squares, axis=0) / HIDDEN + eps)
    x_row = x_ptr + token * stride_x
    ba = _x_dot_rows_scaled(x_row, w_rows, row_mask, scale, HIDDEN, BLOCK_ROWS, BLOCK_K)
    is_b = rows < H
    is_a = row_mask & ~is_b
    heads = tl.where(is_b, rows, rows - H)
    out = token * H + heads
    tl.store(beta_ptr + out, tl.sigmoid(ba).to(beta_ptr.dtype.element_ty), mask=is_b)
    A_log = tl.load(A_log_ptr + heads, mask=is_a, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + heads, mask=is_a, other=0.0).to(tl.float32)
    tl.store(g_ptr + out, _log_decay(ba, A_log, dt_bias), mask=is_a)


@triton.jit
def _gdn_gates_from_x_kernel(
    x_ptr,
    w_ptr,
    A_log_ptr,
    dt_bias_ptr,
    g_ptr,
    beta_ptr,
    H,
    stride_x,
    stride_w,
    squares_ptr,
    square_blocks,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SQUARE_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    _gates_from_x_program(
        tl.program_id(0),
        tl.program_id(1),
        x_ptr,
        w_ptr,
        A_log_ptr,
        dt_bias_ptr,
        g_ptr,
        beta_ptr,
        H,
        stride_x,
        stride_w,
        squares_ptr,
        square_blocks,
        eps,
        HIDDEN,
        BLOCK_ROWS,
        BLOCK_K,
        SQUARE_BLOCKS,
    )


def normed_rows_args(x: torch.Tensor | NormedRows) -> tuple[torch.Tensor, tuple, dict]:
    """(x's rows, the sums-of-squares launch arguments, their compile-time constant) of a
    gates-from-x input that may be a folded norm's rows: for a plain x, unused arguments and
    SQUARE_BLOCKS 0."""
    if not isinstance(x, NormedRows):
        return x, (x, 0, 0.0), {"SQUARE_BLOCKS": 0}
    blocks = x.squares.shape[0]
    if x.squares.shape[1] != SQUARE_COLUMNS or not x.squares.is_contiguous():
        raise ValueError(
            f"sums of squares {tuple(x.squares.shape)}, not [blocks, {SQUARE_COLUMNS}]"
        )
    constants = {"SQUARE_BLOCKS": max(16, next_power_of_2(blocks))}
    return x.weighted, (x.squares, blocks, x.eps), constants


def check_gates_from_x(x: torch.Tensor, w_ba: torch.Tensor) -> None:
    """Raise ValueError unless `gdn_gates_from_x`'s kernel takes x and w_ba."""
    hidden = x.shape[1]
    if w_ba.shape[1] != hidden or w_ba.shape[0] % 2:
        raise ValueError(f"b|a weight {tuple(w_ba.shape)} does not match hidden size {hidden}")
    if x.stride(1) != 1 or w_ba.stride(1) != 1:
        raise ValueError("gdn gates from x need unit stride along hidden")
    if w_ba.dtype != x.dtype:
        raise ValueError(f"b|a weight in {w_ba.dtype}, input in {x.dtype}")


def gates_outputs(x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty g (fp32) and beta (x's dtype), [T, heads]."""
    g = torch.empty(x.shape[0], heads, dtype=torch.float32, device=x.device)
    return g, torch.empty(x.shape[0], heads, dtype=x.dtype, device=x.device)


def gdn_gates_from_x(
    x: torch.Tensor | NormedRows, w_ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `gdn_gates.gdn_gates_from_x`; x and w_ba of one dtype with unit
    stride along hidden. Meant for decode-sized T: each token re-reads the whole weight. x may
    be a folded norm's rows, each token's factor applied to its sums (`norm_fold`)."""
    x, square_args, square_constants = normed_rows_args(x)
    check_gates_from_x(x, w_ba)
    tokens, hidden = x.shape
    rows = w_ba.shape[0]
    heads = rows // 2
    g, beta = gates_outputs(x, heads)
    if tokens:
        _gdn_gates_from_x_kernel[(tokens, triton.cdiv(rows, ROWS_PER_PROGRAM))](
            x,
            w_ba,
            A_log,
            dt_bias,
            g,
            beta,
            heads,
            x.stride(0),
            w_ba.stride(0),
            *square_args,
            HIDDEN=hidden,
            BLOCK_ROWS=ROWS_PER_PROGRAM,
            BLOCK_K=BLOCK_K,
            **square_constants,
            num_warps=PROJ_NUM_WARPS,
            **pdl_options(x.device),
        )
    return g, beta

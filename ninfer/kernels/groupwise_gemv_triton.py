"""Group-wise int GEMV/small-M GEMM in Triton for `q8_g32_fp16` and `q4_g64_fp16` weights.
Our own because no library reads this layout, and decode time is these kernels' time.

Decode reads every weight once per step, so the codes are read straight from their stored
planes and never leave registers as floats. Two kernels:
- one x row (`INT_MAX_ROWS`; and the grouped expert form for MoE decode): integer dot
  products. Each group of x is first split into two int8 codes per value, x ~ s * (254 * coarse
  + fine) with s = max|x_group| / (254 * 127), which represents x to 1/64516 of its group's
  largest value (finer than bf16's own rounding). The kernel then multiplies four weight codes
  by four x codes in one dp4a instruction and sums the group in int32 exactly; a float
  multiply-add per group and row applies both scales. Turning every code into a float costs
  about three instructions per weight, which made the float form issue-bound at a third of
  the copy rate. Here q4 codes enter the dp4a as signed bytes times 16 (a low nibble shifted
  up, a high one in place: three instructions a word, and no correction for an offset), each
  thread's run of four words is one dp4a chain, and a row's sums over a step's groups are
  kept per group and added once after the loop, so that no step sums its groups across
  threads (a group's two 16-byte loads still meet by a shuffle): the q4 loop compiles to 237
  instructions per 128 weights a thread at sm_90, from 308 (docs/performance.md, Measurement
  21). A program computes rows of one x row (a second
  dimension over x rows held them in three-dimensional tiles and ran 20-30 % slower at one
  row, bench/decode_kernels.md); `integer_linear` takes more rows by reading the weight
  once per row, so only one row takes it in decode. For a GDN layer's in projection the
  kernel also runs the causal conv of the q|k|v outputs (`integer_linear_conv`): each program
  reads its channels' taps and window before the product and finishes its rows alone. A
  program that reads its rows in one step asks for its codes and scales before it waits for
  the kernel before it (`INT_WEIGHTS_BEFORE_WAIT`), so that their memory round trip overlaps
  that kernel instead of following it. The MoE experts' down product takes the SwiGLU before
  it (`grouped_swiglu_linear`) and, at one token, the block's output after it too
  (`grouped_swiglu_combine`, `INT_COMBINE_INSIDE`).
- more x rows (x padded to 16 rows), on the tensor cores; a q4 product with two to eight bf16
  rows on Hopper goes to the Gluon kernel instead where it fits (`groupwise_gemv_gluon`,
  1.25-1.5x faster at the 27B products). By default (`TC_SCALE_AFTER`) each
  group's codes enter the product as exact integers in x's dtype (q4 with bf16 x through inline
  PTX, three instructions per two values) and each group's product is multiplied by its scale
  in fp32, so the weight is never rounded; the tile's scales come in one load, which the
  pipeline stages with the codes (loaded a group at a time they cost a pass through shared
  memory and a barrier per group, and an earlier form that also summed x per group ran 2.3 ms
  slower at 27B C=8). The other form dequantizes each tile as `EncodedTensor.decode` does
  (fp32 code * scale, rounded to x's dtype; for q4 with bf16 x, two values per PTX
  instruction, `_bf16_halves`) and multiplies the whole tile. A q4 byte's nibbles are values
  2j and 2j + 1, so a q4 product is two, over the even columns and over the odd ones: no
  interleaving join stands between the codes and the tensor cores' operand layout. Both are
  bound by instruction issue at M = 8 (bench/decode_kernels.md). Split-K
  fills the GPU when N is small: every split writes an fp32 partial and bumps its output
  tile's counter, and the split that arrives last adds the partials up and writes the result,
  so a split product is still one launch.
Reference: `groupwise_gemv.groupwise_linear`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ninfer.kernels import groupwise_gemv_gluon
from ninfer.kernels.moe_combine_triton import add_choice, with_shared
from ninfer.kernels.pdl_triton import COUNTER_RESET_SEM, await_inputs, pdl_options
from ninfer.kernels.triton_support import device_name, next_power_of_2, num_sms
from ninfer.kernels.x_split import (
    INT_FORMATS,
    INT_MAX_ROWS,
    SPLIT_BLOCK_GROUPS,
    attached,
    split_buffers,
)
from ninfer.quant import EncodedTensor

SUPPORTED = INT_FORMATS
# ... and what `integer_linear` (one x row) also reads: q6_g64 (the head of the groupwise-int
# profile), its low plane as q4's plus its two high bits, 6.25 bits a weight instead of the
# 8.5 of the q8_g32 it widens to for the tensor-core kernel.
ONE_ROW_FORMATS = {**INT_FORMATS, "q6_g64_fp16": (6, 64)}
# Integer kernel: weight rows per program (fewer where N is small), code words a program reads
# per step (over its rows: 8 KiB of codes, the fastest at the 27B shapes on the GPU machine,
# bench/decode_kernels.md), warps; groups of x per program of the split.
INT_BLOCK_N, INT_STEP_WORDS, INT_WARPS = 16, 2048, 4
# ... INT_BLOCK_N halved while the grid would give an SM fewer programs than this. At two,
# the 27B products with 5120 outputs keep 16 rows (320 programs on 132 SMs; at four they took
# 8): 8.9 -> 8.5 us at K = 6144 and 17.9 -> 17.1 us at K = 17408 on the GPU machine, and the
# 27B C=1 step 0.08 ms faster (bench/decode_kernels.md, "Integer GEMV at the 27B shapes").
INT_MIN_PROGRAMS_PER_SM = 2
# Rows of at most this many code words (the 35B-A3B experts' down projection, K = 512) are read
# whole, in one step, by programs of INT_SHORT_ROWS_WORDS words: a program's fixed cost
# outweighed the parallelism of small ones (4.8 against 5.8 us at nine pairs on the GPU
# machine; bench/decode_kernels.md, "Integer GEMV and fused router at the 35B-A3B shapes").
INT_SHORT_ROW_WORDS, INT_SHORT_ROWS_WORDS = 128, 4096
# Products whose fastest setting on a device differs from the rule's, as (rows per program,
# words per row and step, warps) by device name, then (bits, rows, code words per row, x rows
# or token-expert pairs). From the sweeps of `python bench/decode_variants.py`
# (bench/decode_kernels.md, "Integer GEMV at the 27B shapes", "... at the 35B-A3B shapes" and
# "Two warps a program"): no rule over rows or programs per SM separates these from the
# products where their settings are slower. A product takes its setting with the GDN conv
# inside or not, so that the two stay bit for bit alike.
INT_TUNED: dict[str, dict[tuple[int, int, int, int], tuple[int, int, int]]] = {
    "NVIDIA H200": {
        (4, 16384, 640, 1): (16, 64, 4),  # 27B GDN q|k|v|z with its conv: 16.2 -> 15.4 us
        (4, 14336, 640, 1): (32, 64, 4),  # 27B attention q|gate|k|v: 14.2 -> 13.9 us
        (4, 5120, 768, 1): (8, 256, 2),  # 27B out projections: 8.1 -> 7.6 us
        (4, 34816, 640, 1): (16, 128, 2),  # 27B MLP gate|up: 26.3 -> 25.9 us
        (4, 5120, 2176, 1): (8, 128, 2),  # 27B MLP down: 16.1 -> 15.7 us
        (4, 12288, 256, 1): (16, 64, 2),  # 35B-A3B GDN q|k|v|z with its conv: 7.1 -> 6.8 us
        (4, 9216, 256, 1): (16, 64, 2),  # 35B-A3B attention q|gate|k|v: 6.1 -> 5.7 us
        (4, 2048, 512, 1): (8, 256, 2),  # 35B-A3B out projections: 5.0 -> 4.1 us
        (4, 1024, 256, 9): (8, 256, 2),  # 35B-A3B experts' gate|up, nine pairs: 6.5 -> 5.9 us
        (6, 248320, 640, 1): (32, 64, 2),  # the q6 head at hidden 5120: 265 -> 237 us
        (6, 248320, 256, 1): (32, 64, 2),  # ... at hidden 2048: 122 -> 99 us
    },
}
# The MoE experts' down projection takes the SwiGLU before it inside its kernel where its rows
# are read whole (`grouped_swiglu_linear`): one launch fewer per MoE layer.
INT_SWIGLU_INSIDE = True
# ... and, for one token whose shared expert is its last pair, the MoE block's output (the
# combine, `moe_combine_triton`) too (`grouped_swiglu_combine`): the routed pairs' programs post
# their rows over a mark into a mailbox kept at zero, by relaxed atomic exchange, and each
# row block's shared-pair program, the last by index, polls its rows of the mailbox, zeroes
# them and combines. A poller spins only on programs that wait on nothing, so it cannot hold
# back what it waits for (as in `moe_router_triton`); under Triton's interpreter, which runs
# programs one by one in order, it finds its rows full. Like the counters, a device's mailbox
# serves one kernel at a time.
INT_COMBINE_INSIDE = True
COMBINE_MAILBOX_WORDS = 1 << 16
# The combine's poller given the routes read before the product, not after its poll (with
# the GDN kernel's two early reads, `gdn_recurrent_triton.GATES_BEFORE_WAIT`: the 35B-A3B q4
# C=1 step 1.41 -> 1.36-1.38 ms; docs/performance.md, Measurement 36).
COMBINE_ROUTES_EARLY = True
_combine_mailboxes: dict[torch.device, torch.Tensor] = {}
# Registers per thread the plain q4 integer kernel takes for sm_90 (ptxas -v).
INT_REGISTERS = 64
# Loads of code words in flight per program: three stages ran 2-20 % faster than two at the
# 27B shapes on the GPU machine, four no faster (bench/decode_kernels.md).
INT_STAGES = 3
# ... and the products of INT_TUNED whose fastest count differs, by device name and the same
# key. The 27B out projections' programs take three steps of 256 words: at four stages all
# three are asked for before the first is computed, where at three the last waited for it
# (docs/performance.md, Measurement 31, products alone with x split beforehand: 7.93 -> 6.71
# us; MLP down, 17 steps: 13.96 -> 13.61 us; every other listed product was slower at four).
INT_TUNED_STAGES: dict[str, dict[tuple[int, int, int, int], int]] = {
    "NVIDIA H200": {
        (4, 5120, 768, 1): 4,  # 27B out projections
        (4, 5120, 2176, 1): 4,  # 27B MLP down
    },
}
# A program that reads its rows in one step reads its codes and scales before it waits for the
# kernel before it (`pdl_triton.READ_BEFORE_WAIT`; no kernel writes weights), in a dense
# product or the experts' down one (its pairs come from the routing two kernels back): the
# 35B-A3B q4 C=1 step 1.78-1.79 -> 1.74 ms on the GPU machine. Where the loop has later steps
# this held up the loop's first loads behind the first step's arithmetic (the 27B C=1 step
# 5.30 -> 5.58 ms; computing that step after the loop instead took 96-152 registers against
# 56-80 and was slower still; docs/performance.md, Measurement 18).
INT_WEIGHTS_BEFORE_WAIT = True
# Split-K arrival counters per device (a split's last program finds its tile's counter at
# splits - 1 and resets it): allocated once, never moved, because graphs keep the address.
# Products that split K, the fused router (`moe_router_triton`, a counter per token) and the GDN
# recurrent kernel running the output norm (a counter per head) share them, so they must not
# run at once on one device (the engine runs its forward on one stream).
TILE_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}
# x ~ s * (FINE * coarse + fine), both codes in [-FINE_MAX, FINE_MAX].
FINE = tl.constexpr(254)
FINE_MAX = tl.constexpr(127.0)
# Triton's CPU interpreter runs no inline assembly: there the dp4a is spelled out in shifts.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tensor-core kernel, per format: (weight rows, weight columns per tile, warps, pipeline
# stages), and K is split while the grid would give an SM fewer than TC_PROGRAMS_PER_SM
# programs. With each group scaled after its product (TC_SCALE_AFTER), 64 rows by 256 columns
# (q4) and 64 by 128 (q8) were the fastest of 24 settings swept at M = 8 at the 27B products
# and the q8 head on the GPU machine, 1-12 % faster than 128/128, and the 27B C=8 step was
# 0.67 ms faster (bench/decode_kernels.md). A q8 tile holds at most four groups.
TC_CONFIG = {"q8_g32_fp16": (64, 128, 4, 3), "q4_g64_fp16": (64, 256, 4, 3)}
TC_PROGRAMS_PER_SM = 6
# ... and while the splits' fp32 partials (written and read back) move at most this share of
# the weight's bytes: with 128/128 tiles at M = 8, 5120x6144 split 12 ways, not 16 (the 27B
# C=8 step 0.14 ms faster, bench/decode_kernels.md); with 64/256 tiles it binds from M = 16.
TC_PARTIAL_SHARE = 0.3
# Registers per thread for the tensor-core kernel (None: ptxas's choice). Compiled for sm_90,
# the split-K form takes 159-161, three programs per SM; capped at 128 it fits four with no
# spill, and the 27B C=8 step was 0.11 ms faster (bench/decode_kernels.md).
TC_MAX_REGISTERS: int | None = 128
# q4 tiles for bf16 x dequantized two values per instruction (`_bf16_halves`, inline PTX for
# sm_90; the interpreter runs the fp32 form): the products are the same bit for bit, and the
# C=8 step is faster (bench/decode_kernels.md).
TC_PACKED_DEQUANT = True
# Tiles as exact integer codes (exact in bf16 and fp16), one product per group, each group's
# product scaled after it: for q4 three instructions per two values instead of five, for q8
# no multiply, and no rounding of the weight to x's dtype (the result is nearer the exact
# product than the dequantized weight's, not bit for bit it).
TC_SCALE_AFTER = True
# ... and at up to eight x rows, the weight as the product's first operand and x as its
# second, eight wide: the m16n8k16 MMA then holds no padding rows of x, and each group's scale
# multiplies half the accumulator. Compiled for sm_90 at M = 8 the loop takes, for q4 (64/256
# tiles), 370 instructions a tile against 450 with x first and padded to 16 rows (432 with x
# first at 8 rows); for q8 (64/128), 248 against 317, and 80 registers against 119. At 16 rows
# this order takes wgmma (q4: 598), so it stops at eight. On the GPU machine the 27B C=8 step
# went 9.28-9.30 -> 8.77 ms (q4) and 13.43-13.44 -> 13.21 ms (q8, docs/performance.md
# Measurement 16).
TC_WEIGHTS_FIRST = True


@triton.jit
def _groupwise_gemv_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    M,
    N,
    K,
    num_groups,
    tiles_per_split,
    stride_xm,
    stride_codes,
    stride_scales,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PACKED: tl.constexpr,
    WHOLE_TILES: tl.constexpr,
    SCALE_AFTER: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[ms, rows] = x[ms] @ W[rows].T over tiles of BLOCK_K columns. SCALE_AFTER: each
    group's product over its exact codes times its scale (`_group_scaled_after`); otherwise
    each tile's codes dequantized in registers exactly as `EncodedTensor.decode` does (the
    fp32 product of code and scale, rounded to x's dtype) and multiplied on the tensor cores,
    bit for bit the dequantized weight's product. With SPLIT_K, program
    (n, m, s) sums split s's tiles into partial[s]; the last split of an output tile to arrive
    (a counter per tile, reset by it) adds up all partials and writes out. WHOLE_TILES: N and
    K are multiples of BLOCK_N and BLOCK_K, so the loop's loads need no masks but x's rows."""
    await_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = ms < M
    x_rows = x_ptr + ms[:, None] * stride_xm
    code_rows = codes_ptr + rows[:, None, None].to(tl.int64) * stride_codes
    scale_rows = scales_ptr + rows[:, None].to(tl.int64) * stride_scales
    # A group's codes fill 32 bytes in both formats (q8: 32 values, q4: 64 nibbles).
    group_bytes: tl.constexpr = GROUP * BITS // 8
    groups_per_tile: tl.constexpr = BLOCK_K // GROUP
    in_group = tl.arange(0, group_bytes)
    num_tiles = tl.cdiv(num_groups, groups_per_tile)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    if WEIGHTS_FIRST:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if SCALE_AFTER:
        tl.static_assert(
            groups_per_tile == 1 or groups_per_tile == 2 or groups_per_tile == 4,
            "scaled after: one, two or four groups per tile",
        )
        row_codes = codes_ptr + rows[:, None].to(tl.int64) * stride_codes
        for tile in tl.range(first, last, num_stages=STAGES):
            # the tile's scales in one load, which the pipeline stages with the codes: loaded
            # a group at a time, each took a pass through shared memory and a barrier to reach
            # the accumulator's layout
            groups = tile * groups_per_tile + tl.arange(0, groups_per_tile)
            if WHOLE_TILES:
                scales = tl.load(scale_rows + groups[None, :])
            else:
                live = row_mask[:, None] & (groups < num_groups)[None, :]
                scales = tl.load(scale_rows + groups[None, :], mask=live, other=0.0)
            s0, s1, s2, s3 = _four_columns(scales.to(tl.float32), BLOCK_N, groups_per_tile)
            for g in tl.static_range(groups_per_tile):
                acc = _group_scaled_after(
                    acc,
                    tile * groups_per_tile + g,
                    row_codes,
                    s0 if g == 0 else (s1 if g == 1 else (s2 if g == 2 else s3)),
                    x_rows,
                    row_mask,
                    m_mask,
                    num_groups,
                    K,
                    BITS,
                    GROUP,
                    BLOCK_M,
                    PACKED,
                    WHOLE_TILES,
                    WEIGHTS_FIRST,
                )
        if WEIGHTS_FIRST:
            acc = tl.trans(acc)
    else:
        for tile in tl.range(first, last, num_stages=STAGES):
            groups = tile * groups_per_tile + tl.arange(0, groups_per_tile)
            live = groups < num_groups
            byte_cols = groups[:, None] * group_bytes + in_group[None, :]
            if WHOLE_TILES:
                raw = tl.load(code_rows + byte_cols[None, :, :])
                scale = tl.load(scale_rows + groups[None, :])
            else:
                raw = tl.load(
                    code_rows + byte_cols[None, :, :],
                    mask=row_mask[:, None, None] & live[None, :, None],
                    other=0,
                )
                scale = tl.load(
                    scale_rows + groups[None, :], mask=row_mask[:, None] & live[None, :], other=0.0
                )
            packed = raw.to(tl.int32)
            scale = scale.to(tl.float32)[:, :, None]
            ks = tile * BLOCK_K + tl.arange(0, BLOCK_K)
            if WHOLE_TILES:
                xs = tl.load(x_rows + ks[None, :], mask=m_mask[:, None], other=0.0)
            else:
                x_mask = m_mask[:, None] & (ks < K)[None, :]
                xs = tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)
            dtype = x_ptr.dtype.element_ty
            if BITS == 8:
                w = (packed.to(tl.float32) * scale).to(dtype)
                acc = tl.dot(xs, tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K])), acc)
            else:
                # byte j's low nibble is value 2j, its high nibble value 2j + 1: the tile is two
                # products, over its even columns and over its odd ones (no interleaving join)
                if PACKED:
                    w_even, w_odd = _bf16_halves(raw, scale)
                else:
                    w_even = ((((packed & 15) ^ 8) - 8).to(tl.float32) * scale).to(dtype)
                    w_odd = ((((packed >> 4) ^ 8) - 8).to(tl.float32) * scale).to(dtype)
                x_even, x_odd = tl.split(tl.reshape(xs, [BLOCK_M, BLOCK_K // 2, 2]))
                half: tl.constexpr = BLOCK_K // 2
                acc = tl.dot(x_even, tl.trans(tl.reshape(w_even, [BLOCK_N, half])), acc)
                acc = tl.dot(x_odd, tl.trans(tl.reshape(w_odd, [BLOCK_N, half])), acc)
    out_mask = m_mask[:, None] & row_mask[None, :]
    at = ms[:, None] * N + rows[None, :]
    if SPLIT_K:
        splits = tl.num_programs(2)
        tl.store(partial_ptr + split * M * N + at, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival counts
        counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, splits):
                # .cg reads from L2, where the other programs' partials are
                total += tl.load(
                    partial_ptr + s * M * N + at, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter, 0, sem=COUNTER_RESET_SEM)
    else:  # the result, or (split-K without counters) this split's partial
        tl.store(out_ptr + split * M * N + at, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# Four q4 bytes (one 32-bit register) to their eight bf16 values, each code * scale rounded
# once to bf16, two values per instruction: the low nibbles' values (2j of byte j) into two
# registers, the high nibbles' (2j + 1) into two more. A nibble n holds its code in two's
# complement, so n ^ 8 = code + 8, and 0x4300 | (n ^ 8) = (n & 0xF) ^ 0x4308 (one lop3) is the
# bf16 of 136 + code; one fma with (1, -136) then gives the code exactly. The fp16 scale is
# the sum of two bf16 parts hi + lo (lo has at most three significant bits), so code * lo is
# exact and fma(code, hi, code * lo) rounds code * scale once, as the fp32 product's rounding
# to bf16 does. Operands: $0, $1 the low values of bytes 0-1 and 2-3, $2, $3 the high values;
# $4 the bytes; $5, $6 the hi parts of bytes 0-1 and 2-3, $7, $8 their lo parts.
# tests/quant/test_packed_dequant_math.py runs this text through an emulator of its five
# instructions.
def _nibbles_ptx(scaled: bool) -> str:
    """The constants and the shift, then the same steps for each of the four output registers
    (prmt selector 0x7170: the source's bytes 0-1, 0x7372: bytes 2-3; source $4 for the low
    nibbles, $4 >> 4 for the high ones): the bf16 136 + code, less 136, then, `scaled`, times
    the scale's two parts (`_BF16_HALVES_PTX`), else that exact code (`_BF16_CODES_PTX`)."""
    steps = ""
    for out, (src, half, sel) in enumerate(
        (("$4", 0, "0x7170"), ("$4", 1, "0x7372"), ("w4", 0, "0x7170"), ("w4", 1, "0x7372"))
    ):
        steps += f"prmt.b32 x, {src}, 0, {sel};\nlop3.b32 t, x, 0x000F000F, 0x43084308, 0x6A;\n"
        if scaled:
            steps += (
                "fma.rn.bf16x2 c, t, one, m136;\n"
                f"fma.rn.bf16x2 r, c, ${7 + half}, nz;\n"
                f"fma.rn.bf16x2 ${out}, c, ${5 + half}, r;\n"
            )
        else:
            steps += f"fma.rn.bf16x2 ${out}, t, one, m136;\n"
    registers = "w4, x, t, c, r, one, m136, nz" if scaled else "w4, x, t, one, m136"
    head = (
        f"{{\n.reg .b32 {registers};\nmov.b32 one, 0x3F803F80;\nmov.b32 m136, 0xC308C308;\n"
        + ("mov.b32 nz, 0x80008000;\n" if scaled else "")
        + "shr.b32 w4, $4, 4;\n"
    )
    return head + steps + "}"


_BF16_HALVES_PTX = tl.constexpr(_nibbles_ptx(scaled=True))

# Four q4 bytes to their eight codes as exact bf16 integers: `_BF16_HALVES_PTX`'s steps up to
# the exact code, the fma writing the output register. Operands: $0, $1 the low nibbles' codes
# of bytes 0-1 and 2-3, $2, $3 the high nibbles'; $4 the bytes.
# tests/quant/test_packed_dequant_math.py runs it through the same emulator.
_BF16_CODES_PTX = tl.constexpr(_nibbles_ptx(scaled=False))


@triton.jit
def _four_columns(scales, BLOCK_N: tl.constexpr, COLUMNS: tl.constexpr):
    """The columns of scales [BLOCK_N, COLUMNS] (1, 2 or 4) as four [BLOCK_N] tensors, split in
    registers (those past COLUMNS repeat the first)."""
    if COLUMNS == 4:
        even, odd = tl.split(tl.reshape(scales, [BLOCK_N, 2, 2]))  # columns 0, 2 and 1, 3
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
    elif COLUMNS == 2:
        s0, s1 = tl.split(scales)
        s2, s3 = s0, s0
    else:
        s0 = tl.reshape(scales, [BLOCK_N])
        s1, s2, s3 = s0, s0, s0
    return s0, s1, s2, s3


@triton.jit
def _group_scaled_after(
    acc,
    group,
    code_rows,
    scale,
    x_rows,
    row_mask,
    m_mask,
    num_groups,
    K,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PACKED: tl.constexpr,
    WHOLE_TILES: tl.constexpr,
    WEIGHTS_FIRST: tl.constexpr,
):
    """acc [BLOCK_M, rows] ([rows, BLOCK_M] with WEIGHTS_FIRST: the weight the product's first
    operand) plus group `group`'s product: its codes as exact integers in x's dtype on the
    tensor cores (q4: two products, even and odd columns), then times the group's scale in
    fp32. code_rows [rows, 1] points at the rows' codes; scale [rows] is the group's
    scales in fp32 (0 past the rows and groups)."""
    group_bytes: tl.constexpr = GROUP * BITS // 8
    in_group = tl.arange(0, group_bytes)
    cols = group * GROUP + tl.arange(0, GROUP)
    if WHOLE_TILES:
        raw = tl.load(code_rows + group * group_bytes + in_group[None, :])
        xs = tl.load(x_rows + cols[None, :], mask=m_mask[:, None], other=0.0)
    else:
        # the group's liveness as a tensor of the rows' shape (the interpreter takes no scalar
        # mask in a tensor's)
        live = row_mask & (group + tl.zeros_like(row_mask.to(tl.int32)) < num_groups)
        raw = tl.load(
            code_rows + group * group_bytes + in_group[None, :], mask=live[:, None], other=0
        )
        x_mask = m_mask[:, None] & (cols < K)[None, :]
        xs = tl.load(x_rows + cols[None, :], mask=x_mask, other=0.0)
    if BITS == 8:  # |code| <= 127: exact in bf16 and fp16
        codes = raw.to(tl.float32).to(xs.dtype)
        if WEIGHTS_FIRST:
            product = tl.dot(codes, tl.trans(xs))
        else:
            product = tl.dot(xs, tl.trans(codes))
    else:
        half: tl.constexpr = GROUP // 2
        if PACKED:
            low, high = tl.inline_asm_elementwise(
                _BF16_CODES_PTX,
                "=r,=r,=r,=r,r",
                [raw],
                dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True,
                pack=4,
            )
        else:
            packed = raw.to(tl.int32)
            low = (((packed & 15) ^ 8) - 8).to(tl.float32).to(xs.dtype)
            high = ((((packed >> 4) & 15) ^ 8) - 8).to(tl.float32).to(xs.dtype)
        # byte j's low nibble is value 2j of the group, its high nibble value 2j + 1
        x_even, x_odd = tl.split(tl.reshape(xs, [BLOCK_M, half, 2]))
        if WEIGHTS_FIRST:
            product = tl.dot(low, tl.trans(x_even))
            product = tl.dot(high, tl.trans(x_odd), product)
        else:
            product = tl.dot(x_even, tl.trans(low))
            product = tl.dot(x_odd, tl.trans(high), product)
    if WEIGHTS_FIRST:
        out = acc + product * scale[:, None]
    else:
        out = acc + product * scale[None, :]
    return out


@triton.jit
def _bf16_halves(raw, scale):
    """q4 bytes [R, G, B] and their groups' fp32 scales (of fp16 values) [R, G, 1]: the bf16
    values of the bytes' low nibbles and of their high nibbles, two [R, G, B] tensors,
    `EncodedTensor.decode`'s values 2j and 2j + 1 bit for bit, through `_BF16_HALVES_PTX` four
    bytes at a time. Except the sign of a zero: code 0 may give +0 where the reference gives
    -0 (a negative scale). The product cannot tell: its sums start at +0, and +0 + -0 = +0."""
    hi = scale.to(tl.bfloat16)
    lo = (scale - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.inline_asm_elementwise(
        _BF16_HALVES_PTX,
        "=r,=r,=r,=r,r,r,r,r,r",
        [raw, tl.broadcast_to(hi, raw.shape), tl.broadcast_to(lo, raw.shape)],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def swiglu_values(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of fp32 gate and up, rounded once to `dtype`: the SwiGLU kernel's
    arithmetic, which the experts' down product repeats (`grouped_swiglu_linear`)."""
    return (gate * tl.sigmoid(gate) * up).to(dtype)


@triton.jit
def split_codes(x, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """The split of the values x [BLOCK_G, GROUP] (fp32; a group per row) into coarse + fine
    int8 codes, x ~ s * (254 * coarse + fine), packed in the weight words' value order: word
    t of parity p holds bytes i = 0..3 of values t * per_word + i * stride + p (q4: the low
    nibbles of a word are its even values, the high nibbles its odd ones), so the group's
    values are [words, 4, parities] in order and a word is a sum over its four bytes.
    Returns (coarse words, fine words) [BLOCK_G, words per group, parities], the fine unit s
    per group and, for q4, 8 times the group's sum of codes (q6's GEMV, which reads q4's
    split and its codes as code + 32, subtracts four times it), else zeros."""
    amax = tl.max(tl.abs(x), axis=1)
    step = amax * (1.0 / (FINE * FINE_MAX))  # one fine unit; a coarse unit is FINE of them
    inv_fine = tl.where(amax > 0, (FINE * FINE_MAX) / tl.where(amax > 0, amax, 1.0), 0.0)
    inv_coarse = inv_fine * (1.0 / FINE)
    coarse_step = step * FINE
    per_word: tl.constexpr = 32 // BITS
    parities: tl.constexpr = 2 if BITS == 4 else 1
    words_per_group: tl.constexpr = GROUP // per_word
    v = tl.reshape(x, [BLOCK_G, words_per_group, 4, parities])
    coarse = tl.floor(v * inv_coarse[:, None, None, None] + 0.5)
    coarse = tl.minimum(tl.maximum(coarse, -FINE_MAX), FINE_MAX)
    rest = v - coarse * coarse_step[:, None, None, None]
    fine = tl.floor(rest * inv_fine[:, None, None, None] + 0.5)
    fine = tl.minimum(tl.maximum(fine, -FINE_MAX), FINE_MAX)
    c = coarse.to(tl.int32)
    f = fine.to(tl.int32)
    shifts = (8 * tl.arange(0, 4))[None, None, :, None]
    packed_coarse = tl.sum((c & 0xFF) << shifts, axis=2)  # [BLOCK_G, words, parities]
    packed_fine = tl.sum((f & 0xFF) << shifts, axis=2)
    if BITS == 4:
        corr = 8 * tl.sum(tl.reshape(c * FINE + f, [BLOCK_G, GROUP]), axis=1)
    else:
        corr = tl.zeros([BLOCK_G], tl.int32)
    return packed_coarse, packed_fine, step, corr


@triton.jit
def split_values(
    x,
    groups,
    num_groups,
    m,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """Split the values x [BLOCK_G, GROUP] (fp32; zeros past the row's end) of groups `groups`
    of x row m (`split_codes`) and write them to row m of the split buffers
    (`x_split.split_buffers`)."""
    group_mask = groups < num_groups
    packed_coarse, packed_fine, step, corr = split_codes(x, BITS, GROUP, BLOCK_G)
    parities: tl.constexpr = 2 if BITS == 4 else 1
    words_per_group: tl.constexpr = GROUP * BITS // 32
    words = groups[:, None] * words_per_group + tl.arange(0, words_per_group)[None, :]
    words_per_row = num_groups * words_per_group
    level = parities * words_per_row
    out = xq_ptr + m * (2 * level) + words
    live = group_mask[:, None]
    if parities == 2:
        coarse_even, coarse_odd = tl.split(packed_coarse)
        fine_even, fine_odd = tl.split(packed_fine)
        tl.store(out, coarse_even, mask=live)
        tl.store(out + words_per_row, coarse_odd, mask=live)
        tl.store(out + level, fine_even, mask=live)
        tl.store(out + level + words_per_row, fine_odd, mask=live)
    else:
        tl.store(out, tl.reshape(packed_coarse, [BLOCK_G, words_per_group]), mask=live)
        tl.store(out + level, tl.reshape(packed_fine, [BLOCK_G, words_per_group]), mask=live)
    x_groups = m * num_groups + groups
    tl.store(xscale_ptr + x_groups, step, mask=group_mask)
    if BITS == 4:
        # q6's codes are read as u = code + 32: sum(u * x) - 32 * sum(x) = sum(code * x)
        tl.store(corr_ptr + x_groups, corr, mask=group_mask)


@triton.jit
def split_block(
    values,
    width,
    block_index,
    m,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    BLOCK: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """For a kernel that writes columns [block_index * BLOCK, + BLOCK) of x row m: their split,
    from `values`, those columns as stored (rounded to x's dtype; zeros past the row's end)
    in any shape of BLOCK values in column order. BLOCK holds a power of two of whole groups
    (`x_split.blocks_hold_groups`)."""
    per_block: tl.constexpr = BLOCK // GROUP
    groups = block_index * per_block + tl.arange(0, per_block)
    split_values(
        tl.reshape(values.to(tl.float32), [per_block, GROUP]),
        groups,
        width // GROUP,
        m,
        xq_ptr,
        corr_ptr,
        xscale_ptr,
        BITS,
        GROUP,
        per_block,
    )


@triton.jit
def _quantize_x_kernel(
    x_ptr,
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    K,
    num_groups,
    stride_xm,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    PDL: tl.constexpr,
):
    await_inputs(PDL)
    m = tl.program_id(1).to(tl.int64)
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    live = (groups < num_groups)[:, None] & (ks < K)
    x = tl.load(x_ptr + m * stride_xm + ks, mask=live, other=0.0).to(tl.float32)
    split_values(x, groups, num_groups, m, xq_ptr, corr_ptr, xscale_ptr, BITS, GROUP, BLOCK_G)


@triton.jit
def _int_dot(a, b, acc, SIGNED_A: tl.constexpr, ASM: tl.constexpr):
    """acc + the dot product of the four bytes of a (unsigned, or signed if SIGNED_A) with the
    four signed bytes of b: one dp4a instruction on the GPU, shifts in the interpreter."""
    if ASM:
        result = tl.inline_asm_elementwise(
            "dp4a.s32.s32 $0, $1, $2, $3;" if SIGNED_A else "dp4a.u32.s32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, acc],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        result = acc + tl.zeros_like(a * b)
        for i in tl.static_range(4):
            if SIGNED_A:
                a_byte = (a << (24 - 8 * i)) >> 24
            else:
                a_byte = (a >> (8 * i)) & 0xFF
            result += a_byte * ((b << (24 - 8 * i)) >> 24)
    return result


@triton.jit
def _q6_words(low_words, high_halves):
    """q6 codes as the dp4a's unsigned bytes u = code + 32 (0..63): low plane words (four
    bytes, each the low four bits of values 2j and 2j + 1 in its nibbles, q4's layout) and the
    16 high-plane bits of each word's eight values (value 4i + j of a high byte at bits 2j).
    Returns (u of the even values, u of the odd ones), byte j of each value 2j (+1)."""
    h = high_halves.to(tl.int32) & 0xFFFF
    # nibble j of h (the high bits of values 2j and 2j + 1) into the low nibble of byte j; the
    # high nibbles are left as they fall, the masks below never read them
    bytes_02 = (h | (h << 8)) & 0x00FF00FF
    spread = bytes_02 | (bytes_02 << 4)
    # two's complement high bits s to s ^ 2 = s + 2, at bits 4-5: u = low + 16 * (s + 2)
    even_high = ((spread << 4) ^ 0x20202020) & 0x30303030
    odd_high = ((spread << 2) ^ 0x20202020) & 0x30303030
    return (low_words & 0x0F0F0F0F) | even_high, ((low_words >> 4) & 0x0F0F0F0F) | odd_high


@triton.jit
def _program_pair(
    col, rows, N, x_rows_ptr, experts_ptr, GATHER: tl.constexpr, THROUGH_L2: tl.constexpr
):
    """(x row, expert, row mask) of the integer kernel's program column `col`: with GATHER its
    token-expert pair (a padding pair, x row < 0, reads row 0 of x and writes nothing), read
    through the L2 when THROUGH_L2 (before the wait: an SM's L1 may hold the lists of a step
    ago); else x row `col` of a dense weight."""
    if GATHER:
        if THROUGH_L2:
            m = tl.load(x_rows_ptr + col, cache_modifier=".cg").to(tl.int64)
            expert = tl.load(experts_ptr + col, cache_modifier=".cg").to(tl.int64)
        else:
            m = tl.load(x_rows_ptr + col).to(tl.int64)
            expert = tl.load(experts_ptr + col).to(tl.int64)
        row_mask = (rows < N) & (m + tl.zeros_like(rows).to(tl.int64) >= 0)
        m = tl.maximum(m, 0)
    else:
        m = col.to(tl.int64)
        expert = tl.zeros_like(m)
        row_mask = rows < N
    return m, expert, row_mask


@triton.jit
def _weight_step(
    word_rows,
    high_rows,
    scale_rows,
    start,
    row_mask,
    num_words,
    num_groups,
    BITS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    WORDS_PER_GROUP: tl.constexpr,
):
    """The weight's part of the integer kernel's step at code word `start`: (code words,
    q6's high halves or the words again, the groups' scales in fp32)."""
    cols = start + tl.arange(0, BLOCK_WORDS)
    mask = row_mask[:, None] & (cols < num_words)[None, :]
    w = tl.load(word_rows + cols[None, :], mask=mask)
    high = tl.load(high_rows + cols[None, :], mask=mask) if BITS == 6 else w
    groups = start // WORDS_PER_GROUP + tl.arange(0, BLOCK_WORDS // WORDS_PER_GROUP)
    g_mask = row_mask[:, None] & (groups < num_groups)[None, :]
    w_scale = tl.load(scale_rows + groups[None, :], mask=g_mask, other=0.0).to(tl.float32)
    return w, high, w_scale


@triton.jit
def _int_step(
    acc,
    w,
    high_w,
    w_scale,
    start,
    m,
    x_words,
    level,
    num_words,
    num_groups,
    corr_ptr,
    xscale_ptr,
    even_coarse,
    even_fine,
    odd_coarse,
    odd_fine,
    own_step,
    BITS: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    WORDS_PER_GROUP: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc [BLOCK_N, groups per step] + the integer kernel's step at code word `start` over
    the weight's part (`_weight_step`) and x's codes (read per step, or with SWIGLU the row's
    own split): each row's sum over each of the step's groups, scaled. The sums over groups
    are left to the end of the loop, so that a step does not sum its groups across threads.
    q4's sums are 16 times their value (`_signed_nibbles`)."""
    cols = start + tl.arange(0, BLOCK_WORDS)
    col_mask = cols < num_words
    if SWIGLU:
        x_coarse = tl.reshape(even_coarse, [BLOCK_WORDS])[None, :]
        x_fine = tl.reshape(even_fine, [BLOCK_WORDS])[None, :]
    else:
        x_coarse = tl.load(x_words + cols, mask=col_mask, other=0)[None, :]
        x_fine = tl.load(x_words + level + cols, mask=col_mask, other=0)[None, :]
    if BITS != 8:
        if SWIGLU:
            xo_coarse = tl.reshape(odd_coarse, [BLOCK_WORDS])[None, :]
            xo_fine = tl.reshape(odd_fine, [BLOCK_WORDS])[None, :]
        else:
            odd = x_words + num_words + cols
            xo_coarse = tl.load(odd, mask=col_mask, other=0)[None, :]
            xo_fine = tl.load(odd + level, mask=col_mask, other=0)[None, :]
        if BITS == 4:
            low, high = _signed_nibbles(w)
        else:
            low, high = _q6_words(w, high_w)
        signed: tl.constexpr = BITS == 4
        coarse = _quad_chain(low, high, x_coarse, xo_coarse, True, signed, ASM)
        fine = _quad_chain(low, high, x_fine, xo_fine, True, signed, ASM)
    else:
        coarse = _quad_chain(w, w, x_coarse, x_coarse, False, True, ASM)
        fine = _quad_chain(w, w, x_fine, x_fine, False, True, ASM)
    per_quad = coarse * FINE + fine  # [BLOCK_N, BLOCK_WORDS // 4]
    group_sums = tl.sum(
        tl.reshape(per_quad, [BLOCK_N, BLOCK_WORDS // WORDS_PER_GROUP, WORDS_PER_GROUP // 4]),
        axis=2,
    )
    groups = start // WORDS_PER_GROUP + tl.arange(0, BLOCK_WORDS // WORDS_PER_GROUP)
    g_mask = groups < num_groups
    x_groups = m * num_groups + groups
    if SWIGLU:
        x_scale = own_step
    else:
        if BITS == 6:  # u = code + 32: four times the correction q4's split carries
            group_sums -= 4 * tl.load(corr_ptr + x_groups, mask=g_mask, other=0)[None, :]
        x_scale = tl.load(xscale_ptr + x_groups, mask=g_mask, other=0.0)
    return acc + group_sums.to(tl.float32) * (x_scale[None, :] * w_scale)


@triton.jit
def _quads(t):
    """t [rows, words] as four [rows, words / 4]: each run of four consecutive words' first,
    second, third and fourth (a thread's four words of a 16-byte load: no data moves)."""
    rows: tl.constexpr = t.shape[0]
    quads: tl.constexpr = t.shape[1] // 4
    a, b = tl.split(tl.reshape(t, [rows, quads, 2, 2]))
    t0, t1 = tl.split(a)
    t2, t3 = tl.split(b)
    return t0, t2, t1, t3


@triton.jit
def _quad_chain(low, high, x_low, x_high, PAIRED: tl.constexpr, SIGNED: tl.constexpr, ASM):
    """The integer dot products of each run of four words, [rows, words / 4], summed in one
    chain of dp4a (no additions): low with x_low and, when PAIRED, high with x_high (q4 and
    q6's even and odd values)."""
    l0, l1, l2, l3 = _quads(low)
    x0, x1, x2, x3 = _quads(x_low)
    acc = _int_dot(l0, x0, 0, SIGNED, ASM)
    acc = _int_dot(l1, x1, acc, SIGNED, ASM)
    acc = _int_dot(l2, x2, acc, SIGNED, ASM)
    acc = _int_dot(l3, x3, acc, SIGNED, ASM)
    if PAIRED:
        h0, h1, h2, h3 = _quads(high)
        y0, y1, y2, y3 = _quads(x_high)
        acc = _int_dot(h0, y0, acc, SIGNED, ASM)
        acc = _int_dot(h1, y1, acc, SIGNED, ASM)
        acc = _int_dot(h2, y2, acc, SIGNED, ASM)
        acc = _int_dot(h3, y3, acc, SIGNED, ASM)
    return acc


@triton.jit
def _signed_nibbles(w):
    """A q4 word's codes as signed bytes times 16 (exact): its low nibbles (even values)
    shifted into the high half of their bytes, its high nibbles (odd values) kept there.
    Three instructions a word, against five for codes plus 8 and a correction per group."""
    high_halves = -0x0F0F0F10  # 0xF0F0F0F0
    return (w << 4) & high_halves, w & high_halves


@triton.jit
def _groupwise_gemv_int_kernel(
    xq_ptr,
    corr_ptr,
    xscale_ptr,
    words_ptr,
    scales_ptr,
    out_ptr,
    x_rows_ptr,
    experts_ptr,
    N,
    num_words,
    num_groups,
    stride_we,
    stride_words,
    stride_se,
    stride_scales,
    stride_om,
    swiglu_ptr,
    stride_swiglu,
    conv_weight_ptr,
    windows_ptr,
    state_slots_ptr,
    conv_channels,
    stride_conv_weight,
    stride_window_slot,
    stride_window_c,
    high_ptr,
    stride_high,
    mailbox_ptr,
    route_weights_ptr,
    route_experts_ptr,
    shared_gate_ptr,
    first,
    count,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    CONV: tl.constexpr,
    COMBINE: tl.constexpr,
    ROUTES_EARLY: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
    WEIGHTS_BEFORE_WAIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[c, rows] = W x[c] for x row c = program column, or, when GATHER, out[c, rows] =
    W[experts[c]] x[x_rows[c]] (one MoE token-expert pair per column; x_rows[c] < 0 writes
    nothing). Per group, the integer sum over codes * (FINE * coarse + fine) is exact; it is
    scaled once per group by the weight's and x's scales.
    CONV (one x row, one sequence; taps of width 4): rows below conv_channels are a GDN layer's
    q|k|v channels, and the program writes silu(conv) of each instead of the product, the
    causal conv over the channel's window (state slot state_slots[0]) and the product rounded
    to out's dtype, in `causal_conv1d_triton`'s arithmetic, then shifts the product into the
    window. Taps and window are read before the product, so that their latency hides behind
    it; each channel is one program's alone.
    SWIGLU (with GATHER; the whole row in one step of BLOCK_WORDS words): x row m is silu(gate)
    * up of row m of swiglu_ptr's [gate | up] rows, rounded to their dtype and split here, in
    `swiglu_triton`'s and `split_codes`' arithmetic; xq, corr and xscale are not read.
    BITS 6 (q6_g64; not with GATHER, SWIGLU or CONV): words_ptr is the low plane, laid out
    as q4's, and high_ptr the two high bits of each value, 16 bits per low word; x is split as
    for q4.
    COMBINE (with SWIGLU; one token: columns 0..TOP_K - 1 its routed pairs in expert id
    order, column TOP_K its shared expert's; a 16-bit dtype): out[0, rows] is the MoE block's
    output, `moe_combine_triton`'s arithmetic over the pairs' products, the routes' weights
    and ids (route_weights_ptr, route_experts_ptr; ids outside first..first + count - 1 add
    zero) and the shared gate's logit (shared_gate_ptr). A routed pair's program writes its
    rows, as stored, over a mark into its row of the mailbox; the shared pair's program waits
    until its rows of all TOP_K are marked, zeroes them and combines."""
    pid_n = tl.program_id(0)
    col = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # q6's low plane is q4's: x is split as for q4 and the words hold eight values
    parities: tl.constexpr = 1 if BITS == 8 else 2
    words_per_group: tl.constexpr = GROUP * (4 if BITS == 6 else BITS) // 32
    word_rows = words_ptr + rows[:, None].to(tl.int64) * stride_words
    high_rows = high_ptr + rows[:, None].to(tl.int64) * stride_high
    scale_rows = scales_ptr + rows[:, None].to(tl.int64) * stride_scales
    if WEIGHTS_BEFORE_WAIT:
        # No kernel writes the weights, and a gathered product's pairs come from the routing
        # two kernels back (the experts' down product, after their gate|up one): the first
        # step's codes and scales are read before the wait (`pdl_triton.READ_BEFORE_WAIT`),
        # so that their memory round trip overlaps the kernel before this one.
        m, expert, row_mask = _program_pair(col, rows, N, x_rows_ptr, experts_ptr, GATHER, True)
        word_rows += expert * stride_we
        scale_rows += expert * stride_se
        first_w, first_high, first_scale = _weight_step(
            word_rows, high_rows, scale_rows, 0, row_mask, num_words, num_groups,
            BITS, BLOCK_WORDS, words_per_group,
        )  # fmt: skip
        await_inputs(PDL)
    else:
        await_inputs(PDL)
        m, expert, row_mask = _program_pair(col, rows, N, x_rows_ptr, experts_ptr, GATHER, False)
        word_rows += expert * stride_we
        scale_rows += expert * stride_se
    if CONV:
        conv_rows = row_mask & (rows < conv_channels)
        slot = tl.load(state_slots_ptr).to(tl.int64)
        window = windows_ptr + slot * stride_window_slot + rows.to(tl.int64) * stride_window_c
        taps = conv_weight_ptr + rows.to(tl.int64) * stride_conv_weight
        window_0 = tl.load(window, mask=conv_rows, other=0.0).to(tl.float32)
        window_1 = tl.load(window + 1, mask=conv_rows, other=0.0).to(tl.float32)
        window_2 = tl.load(window + 2, mask=conv_rows, other=0.0).to(tl.float32)
        tap_0 = tl.load(taps, mask=conv_rows, other=0.0).to(tl.float32)
        tap_1 = tl.load(taps + 1, mask=conv_rows, other=0.0).to(tl.float32)
        tap_2 = tl.load(taps + 2, mask=conv_rows, other=0.0).to(tl.float32)
        tap_3 = tl.load(taps + 3, mask=conv_rows, other=0.0).to(tl.float32)
    level = parities * num_words
    x_words = xq_ptr + m * (2 * level)
    if SWIGLU:
        row_groups: tl.constexpr = BLOCK_WORDS // words_per_group
        values = tl.arange(0, row_groups * GROUP)
        gate_row = swiglu_ptr + m * stride_swiglu
        gate = tl.load(gate_row + values).to(tl.float32)
        up = tl.load(gate_row + row_groups * GROUP + values).to(tl.float32)
        hidden = swiglu_values(gate, up, swiglu_ptr.dtype.element_ty).to(tl.float32)
        own_coarse, own_fine, own_step, _ = split_codes(
            tl.reshape(hidden, [row_groups, GROUP]), BITS, GROUP, row_groups
        )
        if BITS == 4:
            even_coarse, odd_coarse = tl.split(own_coarse)
            even_fine, odd_fine = tl.split(own_fine)
        else:
            even_coarse = tl.reshape(own_coarse, [row_groups, words_per_group])
            even_fine = tl.reshape(own_fine, [row_groups, words_per_group])
            odd_coarse, odd_fine = 0, 0
    else:  # x's codes are read per step
        even_coarse, even_fine, odd_coarse, odd_fine, own_step = 0, 0, 0, 0, 0
    # [BLOCK_N, groups per step], made as a reduction of a reshaped [BLOCK_N, BLOCK_WORDS]
    # tile: compiled for sm_90, the experts' SwiGLU form then takes 96 registers, against 128
    # with `tl.zeros` of that shape
    acc = tl.sum(
        tl.reshape(
            tl.zeros([BLOCK_N, BLOCK_WORDS], tl.float32),
            [BLOCK_N, BLOCK_WORDS // words_per_group, words_per_group],
        ),
        axis=2,
    )
    if COMBINE and ROUTES_EARLY:
        # the poller's routes, asked for before the product, not after its poll: the weights
        # and ids of the token's choices, [1, TOP_K] as the mailbox tile's columns, and the
        # shared expert's gate logit
        choices = tl.arange(0, TOP_K)[None, :]
        early_routes = (
            tl.load(route_weights_ptr + choices).to(tl.float32),
            tl.load(route_experts_ptr + choices),
            tl.load(shared_gate_ptr).to(tl.float32),
        )
    else:
        early_routes = (0.0, 0, 0.0)
    if WEIGHTS_BEFORE_WAIT:
        acc = _int_step(
            acc, first_w, first_high, first_scale, 0, m, x_words, level, num_words,
            num_groups, corr_ptr, xscale_ptr, even_coarse, even_fine, odd_coarse, odd_fine,
            own_step, BITS, SWIGLU, BLOCK_N, BLOCK_WORDS, words_per_group, ASM,
        )  # fmt: skip
    for start in tl.range(
        BLOCK_WORDS if WEIGHTS_BEFORE_WAIT else 0, num_words, BLOCK_WORDS, num_stages=STAGES
    ):
        w, high_w, w_scale = _weight_step(
            word_rows, high_rows, scale_rows, start, row_mask, num_words, num_groups,
            BITS, BLOCK_WORDS, words_per_group,
        )  # fmt: skip
        acc = _int_step(
            acc, w, high_w, w_scale, start, m, x_words, level, num_words,
            num_groups, corr_ptr, xscale_ptr, even_coarse, even_fine, odd_coarse, odd_fine,
            own_step, BITS, SWIGLU, BLOCK_N, BLOCK_WORDS, words_per_group, ASM,
        )  # fmt: skip
    total = tl.sum(acc, axis=1)
    if BITS == 4:
        total = total * 0.0625  # q4's codes were read as 16 times their value
    out = total.to(out_ptr.dtype.element_ty)
    if CONV:
        # the conv kernel's sum: taps in order, the window's three entries then the new input
        new = out.to(tl.float32)
        conv = tl.zeros([BLOCK_N], tl.float32)
        conv += window_0 * tap_0
        conv += window_1 * tap_1
        conv += window_2 * tap_2
        conv += new * tap_3
        out = tl.where(conv_rows, (conv * tl.sigmoid(conv)).to(out.dtype), out)
        tl.debug_barrier()  # every thread has read the window before any rewrites it
        kind = windows_ptr.dtype.element_ty
        tl.store(window, window_1.to(kind), mask=conv_rows)
        tl.store(window + 1, window_2.to(kind), mask=conv_rows)
        tl.store(window + 2, new.to(kind), mask=conv_rows)
    if COMBINE:
        if col < TOP_K:  # a routed pair: its rows as stored, over a mark
            word = (out.to(tl.int16, bitcast=True).to(tl.int32) << 16) | 1
            box = mailbox_ptr + rows * TOP_K + col  # row-major: a row's choices side by side
            tl.atomic_xchg(box, word, mask=row_mask, sem="relaxed")
        else:  # the shared pair, the last by index
            _combine_rows(
                out,
                rows,
                row_mask,
                mailbox_ptr,
                route_weights_ptr,
                route_experts_ptr,
                shared_gate_ptr,
                early_routes,
                first,
                count,
                out_ptr,
                TOP_K,
                ROUTES_EARLY,
                ASM,
            )
    else:
        tl.store(out_ptr + col * stride_om + rows, out, mask=row_mask)


@triton.jit
def _combine_rows(
    shared,
    rows,
    row_mask,
    mailbox_ptr,
    route_weights_ptr,
    route_experts_ptr,
    shared_gate_ptr,
    early_routes,
    first,
    count,
    out_ptr,
    TOP_K: tl.constexpr,
    ROUTES_EARLY: tl.constexpr,
    ASM: tl.constexpr,
):
    """The COMBINE poller's part (`_groupwise_gemv_int_kernel`): once the TOP_K routed pairs'
    `rows` are all marked in the mailbox, zero them and write the block's output of those rows
    to out's row 0, the shared expert's product (`shared`) included. With ROUTES_EARLY the
    routes come read (`early_routes`: weights and ids [1, TOP_K], the shared gate's logit),
    else they are read here, after the poll."""
    choices = tl.arange(0, TOP_K)
    # [rows, choices]: a row's choices are contiguous, so a thread holds them together and the
    # picks below add within a thread, not across warps
    box = mailbox_ptr + rows[:, None] * TOP_K + choices[None, :]
    live = row_mask[:, None] & (choices < TOP_K)[None, :]
    words = tl.load(box, mask=live, other=1, volatile=True)
    while tl.min(tl.min(words & 1, axis=1), axis=0) == 0:
        words = tl.load(box, mask=live, other=1, volatile=True)
    tl.store(box, tl.zeros_like(words), mask=live)  # for the next call
    values = words >> 16  # each pair's rows as stored, sign-extended
    dtype = out_ptr.dtype.element_ty
    routed = tl.zeros(rows.shape, tl.float32)
    for choice in tl.static_range(TOP_K):
        # choice's row of the tile, exactly: an integer sum over one nonzero term (its weight
        # and id likewise, a weight being a probability, never -0)
        pick = choices[None, :] == choice
        stored = tl.sum(tl.where(pick, values, 0), axis=1)
        y = stored.to(tl.int16).to(dtype, bitcast=True)
        if ROUTES_EARLY:
            weight = tl.sum(tl.where(pick, early_routes[0], 0.0), axis=1)
            expert = tl.sum(tl.where(pick, early_routes[1], 0), axis=1)
        else:
            weight = tl.load(route_weights_ptr + choice).to(tl.float32)
            expert = tl.load(route_experts_ptr + choice)
        routed = add_choice(
            routed,
            y,
            weight,
            expert,
            first,
            count,
            choice == 0,
            dtype,
            ASM,  # `mul.rn`: this kernel is compiled with fp fusion on
        )
    if ROUTES_EARLY:
        shared_gate = early_routes[2]
    else:
        shared_gate = tl.load(shared_gate_ptr).to(tl.float32)
    out = with_shared(routed, shared, shared_gate, dtype, ASM)
    tl.store(out_ptr + rows, out, mask=row_mask)


def split_x(x: torch.Tensor, bits: int, group: int, padded_k: int):
    """x [M, K] -> (codes [M, 2, Kp/4] int32 (coarse words, then fine words), per-group
    corrections [M, Kp/group] int32 (read by q6, which takes q4's split; unused for q8),
    per-group fine steps [M, Kp/group] fp32), in the order `_groupwise_gemv_int_kernel`
    reads them."""
    m, k = x.shape
    num_groups = padded_k // group
    codes, corr, steps = split_buffers(m, padded_k, group, x.device)
    grid = (triton.cdiv(num_groups, SPLIT_BLOCK_GROUPS), m)
    _quantize_x_kernel[grid](
        x,
        codes,
        corr,
        steps,
        k,
        num_groups,
        x.stride(0),
        BITS=bits,
        GROUP=group,
        BLOCK_G=SPLIT_BLOCK_GROUPS,
        num_warps=4,
        **pdl_options(x.device),
    )
    return codes, corr, steps


def _int_config(
    num_rows: int,
    row_words: int,
    out_cols: int,
    device: torch.device,
    bits: int = 4,
):
    """(rows per program, words per row and step, warps) for rows of `row_words` code words
    and `out_cols` x rows (or token-expert pairs): a product listed in INT_TUNED for the device
    takes its setting; short rows whole, INT_SHORT_ROWS_WORDS words per program; otherwise
    INT_BLOCK_N rows, halved while the grid would not give every SM INT_MIN_PROGRAMS_PER_SM
    programs, and INT_STEP_WORDS spread over them; INT_WARPS warps where not listed."""
    if device.type == "cuda":
        tuned = INT_TUNED.get(device_name(device), {}).get((bits, num_rows, row_words, out_cols))
        if tuned is not None:
            return tuned
    if row_words <= INT_SHORT_ROW_WORDS:
        step = next_power_of_2(row_words)
        return min(64, INT_SHORT_ROWS_WORDS // step), step, INT_WARPS
    sms = num_sms(device)
    block_n = INT_BLOCK_N
    while block_n > 4 and triton.cdiv(num_rows, block_n) * out_cols < INT_MIN_PROGRAMS_PER_SM * sms:
        block_n //= 2
    return block_n, max(8, INT_STEP_WORDS // block_n), INT_WARPS


def _int_stages(
    num_rows: int, row_words: int, out_cols: int, device: torch.device, bits: int = 4
) -> int:
    """Stages of the integer kernel's loop for a product keyed as in `_int_config`: its entry
    in INT_TUNED_STAGES for the device, else INT_STAGES."""
    if device.type == "cuda":
        listed = INT_TUNED_STAGES.get(device_name(device), {})
        return listed.get((bits, num_rows, row_words, out_cols), INT_STAGES)
    return INT_STAGES


def _int_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    num_rows: int,
    bits: int,
    group: int,
    x_rows: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    swiglu: bool = False,
    high: torch.Tensor | None = None,
    combine: tuple | None = None,
) -> torch.Tensor:
    """x split into int8 pairs once, then the integer GEMV over codes [(E,) N, Kp*bits/8] and
    scales [(E,) N, Kp/group]; with `conv` (taps, windows, state slots), the causal conv of
    the first taps.shape[0] outputs in the kernel (`integer_linear_conv`); with `combine`
    (mailbox, routes' weights and ids, shared gate logit, first, count), the MoE block's
    output [1, N] (`grouped_swiglu_combine`)."""
    gather = experts is not None
    out_rows = experts.shape[0] if gather else x.shape[0]
    written_rows = 1 if combine is not None else out_rows
    out = torch.empty(written_rows, num_rows, dtype=x.dtype, device=x.device)
    if out_rows == 0 or x.shape[0] == 0:
        return out
    words = codes.view(torch.int32)
    num_words = words.shape[-1]
    num_groups = scales.shape[-1]
    x_bits = 4 if bits == 6 else bits  # q6's low plane is q4's, and so is its x split
    if swiglu:  # x is [gate | up]; the kernel splits the activation itself
        x_codes = corr = steps = x
    elif (split := attached(x, x_bits, group, num_groups)) is not None:
        x_codes, corr, steps = split.codes, split.corr, split.steps
    else:
        x_codes, corr, steps = split_x(x, x_bits, group, num_groups * group)
    block_n, block_words, warps = _int_config(num_rows, num_words, out_rows, x.device, bits)
    words_per_group = group * x_bits // 32
    block_words = max(words_per_group, min(block_words, next_power_of_2(num_words)))
    if swiglu:  # the kernel splits the activation of the whole row in one step
        block_words = num_words
    _groupwise_gemv_int_kernel[(triton.cdiv(num_rows, block_n), out_rows)](
        x_codes,
        corr,
        steps,
        words,
        scales,
        out,
        x_rows if gather else out,
        experts if gather else out,
        num_rows,
        num_words,
        num_groups,
        words.stride(0) if words.dim() == 3 else 0,
        words.stride(-2),
        scales.stride(0) if scales.dim() == 3 else 0,
        scales.stride(-2),
        out.stride(0),
        x if swiglu else out,
        x.stride(0) if swiglu else 0,
        *(conv if conv is not None else (out, out, out)),
        conv[0].shape[0] if conv is not None else 0,
        conv[0].stride(0) if conv is not None else 0,
        conv[1].stride(0) if conv is not None else 0,
        conv[1].stride(1) if conv is not None else 0,
        high.view(torch.int16) if high is not None else out,
        high.view(torch.int16).stride(0) if high is not None else 0,
        *(combine if combine is not None else (out, out, out, out, 0, 0)),
        BITS=bits,
        GROUP=group,
        GATHER=gather,
        SWIGLU=swiglu,
        CONV=conv is not None,
        COMBINE=combine is not None,
        ROUTES_EARLY=COMBINE_ROUTES_EARLY,
        TOP_K=out_rows - 1 if combine is not None else 1,
        BLOCK_N=block_n,
        BLOCK_WORDS=block_words,
        STAGES=_int_stages(num_rows, num_words, out_rows, x.device, bits),
        ASM=not INTERPRETED,
        WEIGHTS_BEFORE_WAIT=INT_WEIGHTS_BEFORE_WAIT
        and block_words >= num_words
        and (swiglu or not gather),
        num_warps=warps,
        # the plain kernel's registers for sm_90 (ptxas): the conv's taps and window, read
        # before the loop, would take 72, which fits 7 programs per SM instead of 8; capped,
        # three of them wait in local memory
        **({"maxnreg": INT_REGISTERS} if conv is not None else {}),
        **pdl_options(x_codes.device),
    )
    return out


def _unit_stride_planes(
    x: torch.Tensor,
    weight: EncodedTensor,
    x_width: int | None = None,
    formats: dict[str, tuple[int, int]] = SUPPORTED,
):
    """(bits, group, codes, scales) of a weight in one of `formats`, checking that x is
    `x_width` wide, by default the weight's K (the kernels would read a short x as zeros and
    ignore the rest of a long one), and unit stride along K in x and every plane."""
    width = weight.shape[-1] if x_width is None else x_width
    if x.shape[-1] != width:
        raise ValueError(
            f"x has {x.shape[-1]} columns, the weight {tuple(weight.shape)} takes {width}"
        )
    bits, group = formats[weight.format]
    if x.stride(-1) != 1 or any(plane.stride(-1) != 1 for plane in weight.planes.values()):
        raise ValueError("groupwise GEMV needs unit stride along K")
    return bits, group, weight.planes["codes"], weight.planes["scales"]


def grouped_groupwise_linear(
    x: torch.Tensor, weight: EncodedTensor, x_rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """MoE decode: x [T, K]; weight: encoded stacked experts [E, N, K]; x_rows, experts: [P]
    int32/int64 on x's device. Returns [P, N]: row p is W[experts[p]] @ x[x_rows[p]]. The
    expert ids are read on the device, so the call has fixed shapes (CUDA-graph safe)."""
    bits, group, codes, scales = _unit_stride_planes(x, weight)
    return _int_linear(x, codes, scales, weight.shape[1], bits, group, x_rows, experts)


def swiglu_fits(weight: EncodedTensor) -> bool:
    """Whether `grouped_swiglu_linear` takes stacked experts `weight`: a SUPPORTED format whose
    rows of K values are whole groups and at most INT_SHORT_ROW_WORDS code words, a power of
    two (the kernel reads such a row, and splits the activation, in one step); and
    INT_SWIGLU_INSIDE."""
    if not INT_SWIGLU_INSIDE or weight.format not in SUPPORTED:
        return False
    bits, group = SUPPORTED[weight.format]
    k = weight.shape[-1]
    words = k * bits // 32
    return k % group == 0 and words <= INT_SHORT_ROW_WORDS and next_power_of_2(words) == words


def grouped_swiglu_linear(
    gate_up: torch.Tensor, weight: EncodedTensor, x_rows: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """MoE decode, the experts' down projection with the SwiGLU before it in its kernel:
    gate_up [T, 2K] (gate | up, as the gate|up product writes them); weight stacked experts
    [E, N, K] that `swiglu_fits`. Returns [P, N]: row p is W[experts[p]] @ silu(gate) * up of
    row x_rows[p], bit for bit `swiglu_triton.silu_mul` (with the x split) followed by
    `grouped_groupwise_linear`, with no launch and no activation in memory between them."""
    if not swiglu_fits(weight):
        raise ValueError(
            f"the SwiGLU in the product does not take a {weight.format} {weight.shape}"
        )
    bits, group, codes, scales = _unit_stride_planes(gate_up, weight, 2 * weight.shape[-1])
    return _int_linear(
        gate_up, codes, scales, weight.shape[1], bits, group, x_rows, experts, swiglu=True
    )


def grouped_swiglu_combine(
    gate_up: torch.Tensor,
    weight: EncodedTensor,
    routes,
    first: int,
    count: int,
    shared_gate: torch.Tensor,
) -> torch.Tensor | None:
    """One MoE token's block output [1, N] from its experts' gate|up rows gate_up [k + 1, 2K]
    (its k routed pairs in expert id order, then its shared expert's; `routes`, a
    `moe_routing.Routes` with the shared pair): `grouped_swiglu_linear` over the pairs, then
    `moe_combine_triton.moe_combine`, bit for bit, in one launch with no [k + 1, N] product in
    memory between them. None where `combine_fits` says no or the mailbox cannot be had (first
    asked for inside a graph capture); the caller then takes the two kernels."""
    top_k = routes.weights.shape[1]
    pairs = routes.pairs.shape[0]
    if not combine_fits(gate_up, weight, top_k) or pairs != top_k + 1:
        return None
    if routes.weights.stride(-1) != 1 or routes.experts.stride(-1) != 1:
        return None  # the kernel reads the token's choices side by side
    num_rows = weight.shape[1]
    mailbox = zeroed_once(
        _combine_mailboxes, gate_up.device, COMBINE_MAILBOX_WORDS, torch.int32, top_k * num_rows
    )
    if mailbox is None:
        return None
    bits, group, codes, scales = _unit_stride_planes(gate_up, weight, 2 * weight.shape[-1])
    combine = (mailbox, routes.weights, routes.experts, shared_gate, first, count)
    return _int_linear(
        gate_up,
        codes,
        scales,
        num_rows,
        bits,
        group,
        routes.pairs,
        routes.pair_experts,
        swiglu=True,
        combine=combine,
    )


def combine_fits(x: torch.Tensor, weight: EncodedTensor, top_k: int) -> bool:
    """Whether `grouped_swiglu_combine` takes one token's block: `swiglu_fits`,
    INT_COMBINE_INSIDE, x in a 16-bit dtype (the mailbox's words carry a value over a mark)
    and a power-of-two top-k (the poller's tile of the mailbox)."""
    return (
        INT_COMBINE_INSIDE
        and swiglu_fits(weight)
        and x.dtype in (torch.bfloat16, torch.float16)
        and next_power_of_2(top_k) == top_k
    )


def integer_linear_conv(
    x: torch.Tensor,
    weight: EncodedTensor,
    conv_weight: torch.Tensor,
    conv_windows: torch.Tensor,
    state_slots: torch.Tensor,
) -> torch.Tensor:
    """A GDN decode step's in projection with its causal conv, for one token: x [1, K], weight
    the stacked q|k|v|z rows [N, K], conv_weight [C, 4] the taps of the first C outputs,
    conv_windows [num_slots, C, 3] (updated in place at slot state_slots[0]). Returns [1, N]:
    the first C columns are `causal_conv1d` of the product's, bit for bit, the rest the
    product."""
    bits, group, codes, scales = _unit_stride_planes(x, weight)
    channels = conv_weight.shape[0]
    if x.shape[0] != 1 or state_slots.shape[0] != 1:
        raise ValueError(f"the conv in the product takes one token, got {x.shape[0]}")
    if tuple(conv_weight.shape) != (channels, 4) or conv_weight.stride(1) != 1:
        raise ValueError(f"conv taps {tuple(conv_weight.shape)}: [C, 4] with unit stride wanted")
    if conv_windows.shape[1:] != (channels, 3) or conv_windows.stride(2) != 1:
        raise ValueError(f"conv windows {tuple(conv_windows.shape)} do not match {channels} taps")
    if channels > weight.shape[0]:
        raise ValueError(f"{channels} conv channels over a product of {weight.shape[0]} rows")
    conv = (conv_weight, conv_windows, state_slots)
    return _int_linear(x, codes, scales, weight.shape[0], bits, group, conv=conv)


def integer_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """`groupwise_linear` through the integer kernel whatever the rows (one x row per program
    column); it also takes q6_g64 weights (`ONE_ROW_FORMATS`), reading their two planes."""
    bits, group, codes, scales = _unit_stride_planes(x, weight, formats=ONE_ROW_FORMATS)
    high = weight.planes.get("high")  # q6's two high bits of each value
    return _int_linear(x, codes, scales, weight.shape[0], bits, group, high=high)


def groupwise_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x: [M, K] bf16/fp16; weight: an encoded [N, K] tensor in a SUPPORTED format, planes on
    x's device. Returns [M, N] in x's dtype."""
    bits, group, codes, scales = _unit_stride_planes(x, weight)
    num_rows, k = weight.shape
    m = x.shape[0]
    if m <= INT_MAX_ROWS:
        return _int_linear(x, codes, scales, num_rows, bits, group)
    if groupwise_gemv_gluon.fits(x, weight):
        return groupwise_gemv_gluon.q4_linear(x, weight)
    num_groups = scales.shape[1]
    weights_first = TC_WEIGHTS_FIRST and TC_SCALE_AFTER and m <= 8
    block_m = 8 if weights_first else min(64, max(16, next_power_of_2(m)))
    block_n, block_k, warps, stages = TC_CONFIG[weight.format]
    block_k = min(block_k, max(group, next_power_of_2(num_groups * group)))
    n_blocks = triton.cdiv(num_rows, block_n) * triton.cdiv(m, block_m)
    num_tiles = triton.cdiv(num_groups * group, block_k)
    splits, tiles_per_split = split_k(m, k, bits, n_blocks, num_tiles, num_sms(x.device))
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(m, block_m), splits)
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)
    counters = tile_counters(x.device, grid[0] * grid[1]) if splits > 1 else None
    partial = out
    if splits > 1:
        partial = torch.empty(splits, m, num_rows, dtype=torch.float32, device=x.device)
    _groupwise_gemv_kernel[grid](
        x,
        codes,
        scales,
        partial if splits > 1 and counters is None else out,
        partial,
        counters if counters is not None else out,
        m,
        num_rows,
        k,
        num_groups,
        tiles_per_split,
        x.stride(0),
        codes.stride(0),
        scales.stride(0),
        BITS=bits,
        GROUP=group,
        BLOCK_K=block_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        STAGES=stages,
        SPLIT_K=counters is not None,
        PACKED=bits == 4 and x.dtype == torch.bfloat16 and TC_PACKED_DEQUANT and not INTERPRETED,
        WHOLE_TILES=whole_tiles(num_rows, k, num_groups * group, block_n, block_k),
        SCALE_AFTER=TC_SCALE_AFTER,
        WEIGHTS_FIRST=weights_first,
        num_warps=warps,
        **({"maxnreg": TC_MAX_REGISTERS} if TC_MAX_REGISTERS else {}),
        **pdl_options(x.device),
    )
    if splits > 1 and counters is None:
        return partial.sum(dim=0).to(x.dtype)
    return out


def split_k(m: int, k: int, bits: int, n_blocks: int, num_tiles: int, sms: int) -> tuple[int, int]:
    """The tensor-core kernel's (splits of K, tiles per split) for m x rows over `n_blocks`
    output blocks and `num_tiles` tiles of K (`TC_PROGRAMS_PER_SM`, `TC_PARTIAL_SHARE`)."""
    splits = min(num_tiles, triton.cdiv(TC_PROGRAMS_PER_SM * sms, n_blocks))
    # each split writes and reads back an fp32 partial of the output, m * N * 8 bytes, against
    # the weight's N * k * bits / 8
    splits = max(1, min(splits, int(TC_PARTIAL_SHARE * k * bits / (64 * m))))
    tiles_per_split = triton.cdiv(num_tiles, splits)
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def whole_tiles(num_rows: int, k: int, padded_k: int, block_n: int, block_k: int) -> bool:
    """Whether the tensor-core kernel's tiles cover the weight exactly (its loop then loads
    without masks: about 8 % fewer loop instructions compiled for sm_90). True at every 27B
    and 35B-A3B product."""
    return num_rows % block_n == 0 and k == padded_k and k % block_k == 0


def tile_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed arrival counters, or None where there are too few or they would be
    allocated inside a graph capture (then the caller takes a path without them: here the
    splits' partials are summed by torch)."""
    return zeroed_once(_counters, device, TILE_COUNTERS, torch.int32, needed)


def zeroed_once(
    held: dict[torch.device, torch.Tensor],
    device: torch.device,
    size: int,
    dtype: torch.dtype,
    needed: int,
) -> torch.Tensor | None:
    """`held`'s zeroed tensor of `size` for the device, made on first use and kept (graphs keep
    its address; the kernels using it leave it at zero), or None where `needed` exceeds it or
    it would be made inside a graph capture."""
    tensor = held.get(device)
    if tensor is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if needed > size or capturing:
            return None
        tensor = held[device] = torch.zeros(size, dtype=dtype, device=device)
    return tensor if needed <= size else None

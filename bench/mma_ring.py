"""Tried and left out (docs/performance.md, Measurement 21): the q4 GEMV that loads its codes
into mma.sync's operand registers (the kernel of commit `39c2f51`, fragment-major planes), with
the codes brought through a ring of shared-memory stages by cp.async instead of straight into
registers, so that more bytes are in flight per SM than registers allow. Timed against the
shipped tensor-core product at eight x rows on the GPU machine:

    python bench/mma_ring.py

The kernel's description as it was in `39c2f51` follows.

q4_g64 weights times up to eight bf16 x rows on the tensor cores, each weight code loaded
straight into the operand registers of `mma.sync` (Gluon, Triton's layout-explicit dialect).
Our own because the decode step at two to eight sequences is these products' time, and the
tensor-core form in `groupwise_gemv_triton` is bound by instruction issue: Triton moves its
codes into the operand layout through shared memory and spends about 3.5 instructions a
weight (bench/decode_kernels.md). Here nothing passes through shared memory:

- The product is computed transposed, y^T = W x^T: sixteen weight rows are the MMA's A operand
  (m16), the x rows its B operand (n8), so eight x rows fill the instruction.
- A warp takes sixteen rows and one group of 64 columns at a time. Lane (g, q) (g = lane / 4,
  q = lane % 4) takes eight bytes of row g and eight of row g + 8: the group's columns
  16q .. 16q + 15. A product sums over K in any order as long as both operands agree, so each
  byte's two values (columns 2j and 2j + 1, lo and hi nibble) fill one bf16x2 register of A,
  and the lane's B registers are x's bf16 pairs of the same columns, loaded as stored. The
  codes are made exact bf16 by a byte permute, a lop3 (136 + code under 0x4300) and one
  bf16x2 fma per two values; four `mma.sync.m16n8k16` sum the group and one fp32 fma per
  output applies the group's scale, as the tensor-core kernel's scaled-after form does
  (`TC_SCALE_AFTER`): the weight is never rounded.
- Read as stored, a lane's bytes are two 8-byte pieces of two rows, and each warp load
  touches eight 128-byte lines for 256 bytes: the L1 then bounds the kernel (84 % busy, DRAM
  35 %, bench/decode_kernels.md). So the codes and scales are read from a second, fragment-
  major copy (`prepare`, `fragment_major`): per 16-row tile and group, the 16 bytes of each
  lane in lane order, one 16-byte load each, a warp's load 512 contiguous bytes.
- All of a group's work for one lane is one inline PTX block on four values of each operand
  (`gl.inline_asm_elementwise`, pack 4), on tensors whose layout puts exactly the lane's
  fragment in its registers; Gluon makes that layout explicit.
- A program is `TILES` tiles (sharing x's registers) and `WARPS` warps that take its split's
  groups in turn (so a wave of the program's warps reads consecutive groups), `SLOTS` groups
  in flight per warp, with `PREFETCH` the next turn's loads issued before this one's
  arithmetic; the warps' sums meet in one reduction at the end. K is split while the grid
  gives an SM fewer than `PROGRAMS_PER_SM` programs; the last split to arrive at its tile's
  counter adds the fp32 partials, as `groupwise_gemv_triton` does.

Reference: `groupwise_gemv.groupwise_linear`."""

from __future__ import annotations

import math
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.testing import do_bench_cudagraph

from ninfer.bench.ceilings import copy_bandwidth
from ninfer.kernels import groupwise_gemv_triton as gt
from ninfer.kernels.groupwise_gemv_triton import tile_counters
from ninfer.kernels.pdl_triton import pdl_options
from ninfer.kernels.triton_support import num_sms
from ninfer.quant import EncodedTensor, get_format

FORMAT = "q4_g64_fp16"
MAX_ROWS = 8  # x rows: the MMA's n
TILE_ROWS = 16  # weight rows per program: the MMA's m
GROUP = 64
# Warps per program (each takes every WARPS-th group of its split), groups in flight per
# warp per turn, 16-row tiles per program (sharing x's registers), and the programs per SM
# below which K is split.
WARPS = 4
SLOTS = 2
TILES = 4
PREFETCH = False
PROGRAMS_PER_SM = 4
STAGES = 0  # 0: the direct-load kernel; >= 2: codes through a cp.async ring of this depth
AHEAD = True  # scales and x loaded one turn ahead (ring kernel)
SCALE_HOT = False  # diagnostic: every scale read from one address


# One group for one lane: $4-$7 the codes (row g's words 2q, 2q + 1, then row g + 8's),
# $8-$15 x's bf16 pairs 8q .. 8q + 7 of the group for x row g, $16-$19 the rows' scales (g, g,
# g + 8, g + 8), $20-$23 the accumulator (row g: x rows 2q, 2q + 1; row g + 8: the same).
# Byte b of a word becomes one bf16x2 register (lo nibble low, hi nibble high): prmt places
# the byte and its copy shifted by 4 in the two halves, lop3 keeps the nibbles and puts
# each, xor 8, under 0x4300 (bf16 136 + code). Then either one bf16x2 fma per register takes
# 136 off exactly, or (`offset_in_mma`) the codes stay 136 + code and four more products of x
# with ones give x's group sums, 136 times which come off the fp32 result.
def _group_ptx(offset_in_mma: bool) -> str:
    lines = [
        "{",
        ".reg .b32 h<4>, a<16>, mask, high, one, m136;",
        ".reg .f32 c<4>, s<4>;",
        "mov.b32 mask, 0x000F000F;",
        "mov.b32 high, 0x43084308;",
        "mov.b32 one, 0x3F803F80;",
        "mov.b32 m136, 0xC308C308;",
    ]
    lines += [f"shr.u32 h{w}, ${4 + w}, 4;" for w in range(4)]
    for w in range(4):
        for b in range(4):
            a = f"a{4 * w + b}"
            lines.append(f"prmt.b32 {a}, ${4 + w}, h{w}, 0x{4 + b:02x}{b:02x};")
            lines.append(f"lop3.b32 {a}, {a}, mask, high, 0x6a;")
            if not offset_in_mma:
                lines.append(f"fma.rn.bf16x2 {a}, {a}, one, m136;")
    lines += [f"mov.f32 c{i}, 0f00000000;" for i in range(4)]
    if offset_in_mma:
        lines += [f"mov.f32 s{i}, 0f00000000;" for i in range(4)]
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    for step in range(4):
        # k-step: row g's bytes 2 (step % 2) and 2 (step % 2) + 1 of its word step // 2
        # (a0-a7), row g + 8's the same (a8-a15), x's pairs 2 step and 2 step + 1
        low = 4 * (step // 2) + 2 * (step % 2)
        operands = f"{{a{low}, a{8 + low}, a{low + 1}, a{9 + low}}}"
        x = f"{{${8 + 2 * step}, ${9 + 2 * step}}}"
        lines.append(f"{mma} {{c0, c1, c2, c3}}, {operands}, {x}, {{c0, c1, c2, c3}};")
        if offset_in_mma:
            lines.append(
                f"{mma} {{s0, s1, s2, s3}}, {{one, one, one, one}}, {x}, {{s0, s1, s2, s3}};"
            )
    for i in range(4):
        if offset_in_mma:
            lines.append(f"fma.rn.f32 c{i}, s{i}, 0fC3080000, c{i};")
        lines.append(f"fma.rn.f32 ${i}, ${16 + i}, c{i}, ${20 + i};")
    lines.append("}")
    return "\n".join(lines)


OFFSET_IN_MMA = False
_GROUP_PTX = gl.constexpr(_group_ptx(False))
_GROUP_PTX_OFFSET = gl.constexpr(_group_ptx(True))


@gluon.jit
def _index(size: gl.constexpr, dim: gl.constexpr, L: gl.constexpr):
    """arange(size) along `dim` of L's five dimensions, as a rank-5 tensor in L."""
    if dim == 0:
        v = gl.arange(
            0,
            size,
            layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))),
        )
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 2), 3), 4)
    elif dim == 1:
        v = gl.arange(
            0,
            size,
            layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))),
        )
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 2), 3), 4)
    elif dim == 2:
        v = gl.arange(
            0,
            size,
            layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, gl.SliceLayout(4, L)))),
        )
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 3), 4)
    elif dim == 3:
        v = gl.arange(
            0,
            size,
            layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, L)))),
        )
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 0), 4)
    else:
        v = gl.arange(
            0,
            size,
            layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L)))),
        )
        v = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 0), 0)
    return v


@gluon.jit
def _load_groups(
    words,
    pairs,
    scales,
    it,
    first,
    last,
    warp,
    slot,
    lane_words,
    x_pair,
    lane_scale,
    WARPS: gl.constexpr,
    SLOTS: gl.constexpr,
    EVEN: gl.constexpr,
):
    """Turn `it` of a split's groups [first, last): each warp's SLOTS groups (every WARPS-th),
    the lane's codes (16 bytes of a 512-byte tile group), x pairs and scales."""
    group = first + (it * SLOTS + slot) * WARPS + warp
    if EVEN:
        scale = gl.load(scales + lane_scale + group * 16, cache_modifier=".cg")
    else:
        # a turn past the split's last group reads that group again, with a scale of zero
        scale = gl.load(
            scales + lane_scale + group * 16, mask=group < last, other=0.0, cache_modifier=".cg"
        )
        group = gl.minimum(group, last - 1)
    code = gl.load(words + lane_words + group * 128, cache_modifier=".cg")
    x_lo = gl.load(pairs + x_pair + group * 32)
    x_hi = gl.load(pairs + x_pair + group * 32 + 4)
    return code, x_lo, x_hi, scale.to(gl.float32)


@gluon.jit
def _group_products(code, x_lo, x_hi, scale, acc, OFFSET_IN_MMA: gl.constexpr):
    return gl.inline_asm_elementwise(
        _GROUP_PTX_OFFSET if OFFSET_IN_MMA else _GROUP_PTX,
        "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f,f,f,f,f",
        [code, x_lo, x_hi, scale, acc],
        dtype=gl.float32,
        is_pure=True,
        pack=4,
    )


@gluon.jit
def _q4_mma_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    M,
    N,
    num_groups,
    groups_per_split,
    stride_x,
    WARPS: gl.constexpr,
    SLOTS: gl.constexpr,
    TILES: gl.constexpr,
    EVEN: gl.constexpr,
    PREFETCH: gl.constexpr,
    SPLIT: gl.constexpr,
    OFFSET_IN_MMA: gl.constexpr,
    PDL: gl.constexpr,
):
    # [warp, slot, tile, g, c]: lane (g, q) of a warp holds c = 4q .. 4q + 3, its four values
    # of each operand for a tile group (`_GROUP_PTX`'s order), so that each is one 16-byte load
    LAYOUT: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 1, 1, 4],
        threads_per_warp=[1, 1, 1, 8, 4],
        warps_per_cta=[WARPS, 1, 1, 1, 1],
        order=[4, 3, 2, 1, 0],
    )
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
    warp = _index(WARPS, 0, LAYOUT)
    slot = _index(SLOTS, 1, LAYOUT)
    tile = _index(TILES, 2, LAYOUT)
    lane_row = _index(8, 3, LAYOUT)  # g
    c = _index(16, 4, LAYOUT)
    row = lane_row + 8 * ((c % 4) // 2)  # the tile row of the value: g, or g + 8
    tiles = gl.program_id(0) * TILES + tile  # [1, 1, TILES, 1, 1]
    words = codes_ptr.to(gl.pointer_type(gl.int32))
    pairs = x_ptr.to(gl.pointer_type(gl.int32))
    # the lane's four words of a tile group: 16 bytes at 16 * lane (`fragment_major`)
    lane_words = tiles * (num_groups * 128) + lane_row * 16 + c
    lane_scale = tiles * (num_groups * 16) + row
    # lane g's x row (shared by the tiles); rows past M repeat the last one (their products
    # are not stored), so that no load needs a mask
    x_pair = gl.minimum(lane_row, M - 1) * (stride_x // 2) + (c // 4) * 8 + c % 4
    split = gl.program_id(1)
    first = split * groups_per_split
    last = gl.minimum(first + groups_per_split, num_groups)
    iterations = gl.cdiv(gl.cdiv(last - first, WARPS), SLOTS)
    acc = gl.zeros([WARPS, SLOTS, TILES, 8, 16], gl.float32, layout=LAYOUT)
    if PREFETCH:
        code, x_lo, x_hi, scale = _load_groups(
            words,
            pairs,
            scales_ptr,
            0,
            first,
            last,
            warp,
            slot,
            lane_words,
            x_pair,
            lane_scale,
            WARPS,
            SLOTS,
            EVEN,
        )
        for it in range(1, iterations):
            next_code, next_lo, next_hi, next_scale = _load_groups(
                words,
                pairs,
                scales_ptr,
                it,
                first,
                last,
                warp,
                slot,
                lane_words,
                x_pair,
                lane_scale,
                WARPS,
                SLOTS,
                EVEN,
            )
            acc = _group_products(code, x_lo, x_hi, scale, acc, OFFSET_IN_MMA)
            code, x_lo, x_hi, scale = next_code, next_lo, next_hi, next_scale
        acc = _group_products(code, x_lo, x_hi, scale, acc, OFFSET_IN_MMA)
    else:
        for it in range(iterations):
            code, x_lo, x_hi, scale = _load_groups(
                words,
                pairs,
                scales_ptr,
                it,
                first,
                last,
                warp,
                slot,
                lane_words,
                x_pair,
                lane_scale,
                WARPS,
                SLOTS,
                EVEN,
            )
            acc = _group_products(code, x_lo, x_hi, scale, acc, OFFSET_IN_MMA)
    total = gl.sum(gl.sum(acc, axis=1, keep_dims=True), axis=0, keep_dims=True)
    out_rows = tiles * 16 + row
    x_rows = (c // 4) * 2 + c % 2
    at = x_rows * N + out_rows
    out_mask = (x_rows < M) & (out_rows < N)
    if SPLIT:
        splits = gl.num_programs(1)
        gl.store(partial_ptr + split * M * N + at, total, mask=out_mask)
        gl.thread_barrier()  # every thread's partial is written before the arrival counts
        counter = counters_ptr + gl.program_id(0)
        if gl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = gl.zeros_like(total)
            for s in range(0, splits):
                # .cg reads from L2, where the other programs' partials are
                total += gl.load(
                    partial_ptr + s * M * N + at, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            gl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            gl.atomic_xchg(counter, 0)
    else:
        gl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)


@gluon.jit
def _issue(
    ring,
    words,
    it,
    first,
    last,
    warp,
    slot,
    lane_words,
    STAGES: gl.constexpr,
    WARPS: gl.constexpr,
    SLOTS: gl.constexpr,
):
    group = first + (it * SLOTS + slot) * WARPS + warp
    async_copy.async_copy_global_to_shared(
        ring.index(it % STAGES),
        words + lane_words + group * 128,
        mask=group < last,
        cache_modifier=".cg",
    )
    async_copy.commit_group()


@gluon.jit
def _side(
    scales,
    pairs,
    it,
    first,
    last,
    warp,
    slot,
    x_pair,
    lane_scale,
    WARPS: gl.constexpr,
    SLOTS: gl.constexpr,
    SCALE_HOT: gl.constexpr,
):
    group = first + (it * SLOTS + slot) * WARPS + warp
    if SCALE_HOT:
        scale = gl.load(
            scales + lane_scale * 0 + (group < last).to(gl.int32) * 0, mask=group < last, other=0.0
        )
    else:
        scale = gl.load(
            scales + lane_scale + group * 16, mask=group < last, other=0.0, cache_modifier=".cg"
        )
    g = gl.minimum(group, last - 1)
    x_lo = gl.load(pairs + x_pair + g * 32)
    x_hi = gl.load(pairs + x_pair + g * 32 + 4)
    return x_lo, x_hi, scale.to(gl.float32)


@gluon.jit
def _q4_ring_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    M,
    N,
    num_groups,
    groups_per_split,
    stride_x,
    WARPS: gl.constexpr,
    SLOTS: gl.constexpr,
    TILES: gl.constexpr,
    STAGES: gl.constexpr,
    AHEAD: gl.constexpr,
    SCALE_HOT: gl.constexpr,
    SPLIT: gl.constexpr,
    PDL: gl.constexpr,
):
    LAYOUT: gl.constexpr = gl.BlockedLayout(
        size_per_thread=[1, 1, 1, 1, 4],
        threads_per_warp=[1, 1, 1, 8, 4],
        warps_per_cta=[WARPS, 1, 1, 1, 1],
        order=[4, 3, 2, 1, 0],
    )
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[4, 3, 2, 1, 0])
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0",
            "=r",
            [],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
    warp = _index(WARPS, 0, LAYOUT)
    slot = _index(SLOTS, 1, LAYOUT)
    tile = _index(TILES, 2, LAYOUT)
    lane_row = _index(8, 3, LAYOUT)
    c = _index(16, 4, LAYOUT)
    row = lane_row + 8 * ((c % 4) // 2)
    tiles = gl.program_id(0) * TILES + tile
    words = codes_ptr.to(gl.pointer_type(gl.int32))
    pairs = x_ptr.to(gl.pointer_type(gl.int32))
    lane_words = tiles * (num_groups * 128) + lane_row * 16 + c
    lane_scale = tiles * (num_groups * 16) + row
    x_pair = gl.minimum(lane_row, M - 1) * (stride_x // 2) + (c // 4) * 8 + c % 4
    split = gl.program_id(1)
    first = split * groups_per_split
    last = gl.minimum(first + groups_per_split, num_groups)
    iterations = gl.cdiv(gl.cdiv(last - first, WARPS), SLOTS)
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, SLOTS, TILES, 8, 16], SMEM)
    for st in gl.static_range(STAGES - 1):
        _issue(ring, words, st, first, last, warp, slot, lane_words, STAGES, WARPS, SLOTS)
    acc = gl.zeros([WARPS, SLOTS, TILES, 8, 16], gl.float32, layout=LAYOUT)
    if AHEAD:
        x_lo, x_hi, scale = _side(
            scales_ptr,
            pairs,
            0,
            first,
            last,
            warp,
            slot,
            x_pair,
            lane_scale,
            WARPS,
            SLOTS,
            SCALE_HOT,
        )
    for it in range(iterations):
        async_copy.wait_group(STAGES - 2)
        code = ring.index(it % STAGES).load(LAYOUT)
        _issue(
            ring, words, it + STAGES - 1, first, last, warp, slot, lane_words, STAGES, WARPS, SLOTS
        )
        if AHEAD:
            n_lo, n_hi, n_scale = _side(
                scales_ptr,
                pairs,
                it + 1,
                first,
                last,
                warp,
                slot,
                x_pair,
                lane_scale,
                WARPS,
                SLOTS,
                SCALE_HOT,
            )
            acc = _group_products(code, x_lo, x_hi, scale, acc, False)
            x_lo, x_hi, scale = n_lo, n_hi, n_scale
        else:
            x_lo, x_hi, scale = _side(
                scales_ptr,
                pairs,
                it,
                first,
                last,
                warp,
                slot,
                x_pair,
                lane_scale,
                WARPS,
                SLOTS,
                SCALE_HOT,
            )
            acc = _group_products(code, x_lo, x_hi, scale, acc, False)
    async_copy.wait_group(0)
    total = gl.sum(gl.sum(acc, axis=1, keep_dims=True), axis=0, keep_dims=True)
    out_rows = tiles * 16 + row
    x_rows = (c // 4) * 2 + c % 2
    at = x_rows * N + out_rows
    out_mask = (x_rows < M) & (out_rows < N)
    if SPLIT:
        splits = gl.num_programs(1)
        gl.store(partial_ptr + split * M * N + at, total, mask=out_mask)
        gl.thread_barrier()
        counter = counters_ptr + gl.program_id(0)
        if gl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
            total = gl.zeros_like(total)
            for s in range(0, splits):
                total += gl.load(
                    partial_ptr + s * M * N + at, mask=out_mask, other=0.0, cache_modifier=".cg"
                )
            gl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            gl.atomic_xchg(counter, 0)
    else:
        gl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=out_mask)


def fragment_major(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A q4_g64 weight's planes (codes [N, K/2] u8, scales [N, K/64] fp16) in the order this
    kernel's lanes read them: per 16-row tile and group, 512 bytes where lane (g, q) finds at
    16 * (4g + q) its rows g and g + 8's words 2q, 2q + 1 (row g's first), then the tile's 16
    scales. Returns (codes [N/16, G, 128] int32, scales [N/16, G, 16] fp16)."""
    n, half_k = codes.shape
    groups = scales.shape[1]
    words = codes.contiguous().view(torch.int32).reshape(n // 16, 2, 8, groups, 4, 2)
    # [tile, rep, g, group, q, t] -> [tile, group, g, q, rep, t]
    frag = words.permute(0, 3, 2, 4, 1, 5).reshape(n // 16, groups, 128).contiguous()
    frag_scales = scales.reshape(n // 16, 16, groups).transpose(1, 2).contiguous()
    return frag, frag_scales


def fits(x: torch.Tensor, weight: EncodedTensor) -> bool:
    """Whether `mma_linear` takes this product: a q4_g64 weight with its fragment-major planes
    (`prepare`) and bf16 x of one to eight rows."""
    return (
        "mma_codes" in weight.planes
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[1] == weight.shape[-1]
        and x.stride(-1) == 1
        and x.stride(0) % 2 == 0
    )


def prepare(weight: EncodedTensor) -> bool:
    """Adds the fragment-major planes to a 2-D q4_g64 weight of whole 16-row tiles (its codes
    twice in memory); False where the weight does not qualify."""
    n, k = weight.shape[-2], weight.shape[-1]
    if weight.format != FORMAT or len(weight.shape) != 2 or n % TILE_ROWS or k % GROUP:
        return False
    codes, scales = fragment_major(weight.planes["codes"], weight.planes["scales"])
    weight.planes["mma_codes"], weight.planes["mma_scales"] = codes, scales
    return True


def tiles_for(n: int) -> int:
    """16-row tiles per program: `TILES`, halved until they divide N's."""
    tiles = TILES
    while (n // TILE_ROWS) % tiles:
        tiles //= 2
    return tiles


def launch_config(n: int, num_groups: int, sms: int) -> tuple[int, int, int, int]:
    """(tiles per program, warps per program, splits of K, groups per split): K is split
    while the grid gives an SM fewer than `PROGRAMS_PER_SM` programs and each warp keeps a
    turn of `SLOTS` groups."""
    tiles = tiles_for(n)
    programs = n // (TILE_ROWS * tiles)
    turn = WARPS * SLOTS
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, programs), num_groups // turn))
    per_split = triton.cdiv(triton.cdiv(num_groups, splits), turn) * turn
    return tiles, WARPS, triton.cdiv(num_groups, per_split), per_split


def mma_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x: [M <= 8, K] bf16; weight: q4_g64 [N, K] with its fragment-major planes (`fits`).
    Returns [M, N] bf16, each group's exact-code product scaled in fp32 as the tensor-core
    GEMV's scaled-after form computes it."""
    n, k = weight.shape
    m = x.shape[0]
    num_groups = k // GROUP
    tiles, warps, splits, per_split = launch_config(n, num_groups, num_sms(x.device))
    programs = n // (TILE_ROWS * tiles)
    counters = tile_counters(x.device, programs) if splits > 1 else None
    if counters is None:
        splits, per_split = 1, num_groups
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out
    if splits > 1:
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if STAGES:
        _q4_ring_kernel[(programs, splits)](
            x,
            weight.planes["mma_codes"],
            weight.planes["mma_scales"],
            out,
            partial,
            counters if counters is not None else out,
            m,
            n,
            num_groups,
            per_split,
            x.stride(0),
            WARPS=warps,
            SLOTS=SLOTS,
            TILES=tiles,
            STAGES=STAGES,
            AHEAD=AHEAD,
            SCALE_HOT=SCALE_HOT,
            SPLIT=splits > 1,
            num_warps=warps,
            **pdl_options(x.device),
        )
        return out
    _q4_mma_kernel[(programs, splits)](
        x,
        weight.planes["mma_codes"],
        weight.planes["mma_scales"],
        out,
        partial,
        counters if counters is not None else out,
        m,
        n,
        num_groups,
        per_split,
        x.stride(0),
        WARPS=warps,
        SLOTS=SLOTS,
        TILES=tiles,
        EVEN=per_split % (warps * SLOTS) == 0 and num_groups % per_split == 0,
        PREFETCH=PREFETCH,
        SPLIT=splits > 1,
        OFFSET_IN_MMA=OFFSET_IN_MMA,
        num_warps=warps,
        **pdl_options(x.device),
    )
    return out


# --- timing ---

dev = "cuda"
q4 = get_format("q4_g64_fp16")


def exact_ok(out, x, enc):
    d = enc.decode(torch.float32).double()
    exact = x.double() @ d.T
    mag = x.double().abs() @ d.abs().T
    return bool(((out.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * mag).all())


def median_us(fn):
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def rot(calls):
    st = {"i": 0}

    def run():
        calls[st["i"] % len(calls)]()
        st["i"] += 1

    return run


_this = sys.modules[__name__]


def setv(settings):
    old = {a: getattr(_this, a) for a in settings}
    for a, v in settings.items():
        setattr(_this, a, v)
    return old


VARIANTS = [
    ("direct", dict(STAGES=0, TILES=4, SLOTS=2)),
    ("r4t2s2", dict(STAGES=4, TILES=2, SLOTS=2)),
    ("r6t2s2", dict(STAGES=6, TILES=2, SLOTS=2)),
    ("r3t4s2", dict(STAGES=3, TILES=4, SLOTS=2)),
    ("r4t2s2n", dict(STAGES=4, TILES=2, SLOTS=2, AHEAD=False)),
    ("r8t1s2", dict(STAGES=8, TILES=1, SLOTS=2)),
    ("r4t2s2P8", dict(STAGES=4, TILES=2, SLOTS=2, PROGRAMS_PER_SM=8)),
    ("r4t2s2hot", dict(STAGES=4, TILES=2, SLOTS=2, SCALE_HOT=True)),
]


def correctness():
    bad = []
    for n, k, m in [
        (34816, 5120, 8),
        (5120, 17408, 3),
        (48, 64 * 7, 8),
        (32, 64 * 37, 1),
        (5120, 6144, 8),
    ]:
        torch.manual_seed(n + k + m)
        w = torch.randn(n, k, device=dev) * torch.logspace(-4, 1, n, device=dev)[:, None]
        enc = q4.encode(w)
        enc.planes["scales"][1::7] *= -1
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        _this.prepare(enc)
        for name, s in VARIANTS:
            if "hot" in name:
                continue
            old = setv(s)
            try:
                ok = exact_ok(_this.mma_linear(x, enc), x, enc)
            except Exception as e:
                ok = f"ERR {type(e).__name__} {str(e)[:200]}"
            setv(old)
            if ok is not True:
                bad.append((n, k, m, name, ok))
    print("correctness failures:", bad if bad else "none", flush=True)


def timings():
    copy = copy_bandwidth(torch.device(dev))
    print(f"copy {copy / 1e9:.0f} GB/s", flush=True)
    for n, k in [(34816, 5120), (5120, 17408), (5120, 6144), (16384, 5120), (14336, 5120)]:
        nbytes = q4.encoded_nbytes((n, k))
        ws = [
            q4.encode(torch.randn(n, k, device=dev) * 0.02)
            for _ in range(max(2, math.ceil(240e6 / nbytes)))
        ]
        for w in ws:
            _this.prepare(w)
        x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
        line = [f"{n}x{k} M=8"]
        us = median_us(rot([lambda w=w, x=x: gt.groupwise_linear(x, w) for w in ws]))
        line.append(f"shipped {us:5.1f} ({nbytes / us / 1e3 / copy * 1e9:4.0%})")
        for name, s in VARIANTS:
            old = setv(s)
            try:
                us = median_us(rot([lambda w=w, x=x: _this.mma_linear(x, w) for w in ws]))
                line.append(f"{name} {us:5.1f} ({nbytes / us / 1e3 / copy * 1e9:4.0%})")
            except Exception as e:
                line.append(f"{name} ERR {type(e).__name__}: {str(e)[:100]}")
            setv(old)
        print(" | ".join(line), flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    correctness()
    timings()

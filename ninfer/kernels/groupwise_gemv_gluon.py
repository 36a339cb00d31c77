"""q4_g64 and q6_g64 weights times 2 to 8 bf16 x rows on Hopper's tensor cores, in Gluon.
Our own because no library reads this layout, and at eight decode rows these products are
about 80 % of the 27B step (docs/performance.md, Measurement 20). Gluon (Triton's explicit
layout language) gives what plain Triton does not: the layout of every register tensor is
written out, so the codes go from shared memory straight into the MMA's operand registers,
and the loads run as a TMA ring paced by mbarriers.

The product is the weight first (`mma.sync m16n8k16`, 16 weight rows by x's 8 rows):
- A program owns `BN` weight rows and walks K in tiles of `GROUPS` groups of 64 columns. Per
  tile, TMA brings the tile's code words, its scales and x's tile into one of `STAGES` ring
  slots, each slot with an mbarrier counting the bytes; the next tiles' copies are in flight
  while a tile is computed. Codes and scales are never written by a kernel of the step, so
  under PDL the first tiles' weight copies are issued before the wait on the previous kernel
  and only x's wait for it.
- Each thread of a row's quad loads two code words of a group (16 of its 64 values) and turns
  each word into four bf16 pairs of exact integer codes (`_PAIRS_PTX`: a shift, a `lop3` that
  puts a nibble xor 8 under 0x4300, the bf16 of 136 + code, and a subtraction of 136, per
  pair). A pair holds the nibbles at bits 4q and 4q + 16 of a word, values q and q + 4 of its
  eight, not neighbours. The MMA does not care which columns of the group a thread holds, as
  long as x's operand holds the same columns in the same places: the dequantized values are
  permuted (a register relabelling, `assert_trivial`) into the operand layout, giving each
  operand position a column of the group, and x is read into its operand with that same
  map. So no value moves between threads or through shared memory.
- Each group's product goes into a fresh fp32 tile and is added to the total times the
  group's fp16 scale (the weight is never rounded; the same order of operations as the Triton
  kernel's `SCALE_AFTER` form).
- Where the row blocks alone give too few programs, K is split; each split writes an fp32
  partial, and the split that arrives last at its row block's counter adds them up and
  writes the result (the Triton kernel's scheme and counters).
- Where the row blocks are more than the SMs hold at once and the rest would be a short second
  wave (the 27B gate|up at eight rows), the blocks past the first wave are split the same way
  among `TAIL_SPLITS` programs each (`_tail_sum`), so the second wave's programs are short.
- `q6_linear` reads a q6_g64 weight (the heads) the same way: its codes plane is q4's (the low
  four bits) and a second TMA box brings the group's high-bit words, which `_Q6_PAIRS_PTX`
  puts under each pair's nibbles (two more `lop3`s and a shift a pair).
- `q4_swiglu_linear` runs an MLP's stacked gate|up weight with the SwiGLU in the epilogue: a
  program's rows are BN/2 of gate's over the same BN/2 of up's (one TMA box over the two
  halves seen as one more dim), and it writes silu(gate) * up, so the SwiGLU's launch and the
  [M, 2F] product's round trip go away. Same loop, same programs as the plain product.
- `q4_linear_conv` runs a GDN layer's in projection at a decode step: the causal conv of its
  q|k|v channels in the epilogue (`_conv_out`), and the layer's gates from x in programs
  after the product's in the grid (`_gates_program`, one b|a row each, or a share of its
  tokens with `GATE_TOKEN_SHARES`), so the conv and gates kernel that ran between the
  product and the recurrent kernel goes.

References: `groupwise_gemv.groupwise_linear`, `groupwise_gemv.swiglu_linear`,
`causal_conv1d.causal_conv1d`, `gdn_gates.gdn_gates_from_x`. Loop cost and timings:
bench/decode_kernels.md, "The q4 product at eight rows in Gluon" and "The GDN conv and gates
in the Gluon in projection".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from ninfer.kernels.gdn_gates_triton import _log_decay  # a Triton function Gluon calls as is
from ninfer.kernels.norm_fold import SQUARE_COLUMNS, HeadNormedRows, NormAfter, NormedRows
from ninfer.kernels.pdl_triton import COUNTER_RESET_SEM, pdl_options
from ninfer.kernels.triton_support import device_name, num_sms, programs_per_sm
from ninfer.quant import EncodedTensor

try:  # Gluon's Hopper modules (Triton 3.6 and 3.9 are the versions checked)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel serves instead
    gluon = None

GROUP = 64
MAX_ROWS = 8
# Groups of 64 columns per tile.
GROUPS = 8
# (rows per program, ring slots, programs per SM that K is split for) where a product is not
# listed: 64 rows and 3 slots (75 KB of shared memory: two programs an SM, 72 bytes short of
# three with the 1 KB the hardware keeps per program) were the fastest
# of seven settings at the 27B out projections and GDN in projection on the GPU machine, and
# two programs per SM the best split (bench/decode_kernels.md, "The q4 product at eight rows
# in Gluon"). Three programs an SM, by taking the scales out of the ring, were slower
# (bench/decode_kernels.md, "Three Gluon programs an SM").
BLOCK_N, STAGES, PROGRAMS_PER_SM = 64, 3, 2
# ... and the products whose fastest setting differs, per device: (N, K) -> setting.
TUNED: dict[str, dict[tuple[int, int], tuple[int, int, int]]] = {
    "NVIDIA H200": {
        (34816, 5120): (64, 2, 2),  # 27B MLP gate|up: 36.3 -> 32.3 us at eight rows
        (5120, 17408): (64, 4, 2),  # 27B MLP down: 19.5 -> 18.7 us
        (12288, 5120): (64, 4, 2),  # 27B attention q|gate: 13.6 -> 13.3 us
        (9216, 2048): (64, 2, 2),  # 35B-A3B attention q|gate|k|v: 9.7 -> 7.8 us
        (248320, 5120): (64, 2, 2),  # 27B q6 head: 360.3 -> 338.5 us at eight rows
        (248320, 2048): (64, 2, 2),  # 35B-A3B q6 head: 150.6 -> 139.6 us
    },
}
# The dims a group's values are permuted by on their way into the operands, from
# [rows, t1, t0, h, e, q0, q1] (the weight's) and [rows, t1, t0, h, e, q1, q0] (x's) to
# [rows, h, q1, q0, t1, t0, e]: operand column 32h + 16q1 + 8q0 + 2t + e is the group's column
# 16t + 8h + 4e + q (t = 2t1 + t0, q = 2q1 + q0) on both sides.
WEIGHT_ORDER = (0, 3, 6, 5, 1, 2, 4)
X_ORDER = (0, 3, 5, 6, 1, 2, 4)
# The first tiles' codes and scales are asked for before the PDL wait.
WEIGHTS_BEFORE_WAIT = True
# Shares a row block is split into where the row blocks are more than the SMs hold at once, and
# those past it would run as a short second wave (the 27B gate|up at eight rows: 544 blocks of
# 64 rows, 528 resident at four programs an SM). Each tail block's tiles are split among this
# many programs that add their partials up (`_tail_sum`). 1: no split. On the H200, five took
# the 27B q4 C=8 step from 6.66-6.67 to 6.51-6.52 ms (three: 6.54); the gate|up alone gained
# only 0.57 us (docs/performance.md, Measurement 38).
TAIL_SPLITS = 5
# Programs a GDN in projection's gates row is split among by tokens (1, 2, 4 or 8), each taking
# 8 / GATE_TOKEN_SHARES of the step's tokens (`_gates_program`): a gates program's time is its
# chain of x loads token by token (docs/performance.md, Measurement 29), and at eight sequences
# the 27B layer's 96 rows run after the product's row blocks. On the H200 two gave the same bits
# as one; with the codes in wide boxes they took the 27B q4 C=8 step 6.29-6.30 -> 6.22 ms in two
# alternating pairs (before them 0.01-0.05 ms, within noise; docs/performance.md, Measurements 39
# and 40): 2.
GATE_TOKEN_SHARES = 2
# A tile's codes asked for as two boxes of [rows, 32 words] (128 contiguous bytes a row, read
# back through a 128-byte swizzle as x's tile is), not one [GROUPS, rows, 8 words] box (32 bytes
# a row). A TMA copy moves its box row by row, and the narrow box makes 512 of a tile's 640 rows
# of copies for 25 KB (bench/decode_kernels.md, "The Gluon product's codes in wide boxes"). A q6
# weight's high bits go likewise, as one [rows, 32 words] box a tile, not [GROUPS, rows, 4
# words]. On the H200 the tiles streamed with no arithmetic went from 81 to 94 % of copy, the
# 27B gate|up at eight rows took 30.78 -> 28.08 us alone, the q6 head 331 -> 288 us, and the
# 27B q4 C=8 step 6.41-6.49 -> 6.29-6.32 ms in three pairs (docs/performance.md, Measurement 40).
WIDE_CODES = True
# The product's loop as two partitions (`gl.warp_specialize`): a producer warp issuing the
# ring's copies and the program's four warps computing, so that the copies' barriers of the
# whole program go (bench/decode_kernels.md, "What the Gluon product's loop waits on besides
# memory"). For products without a folded norm after, conv, gates, head factors or q6 weight.
# Registers: a program is then two warp groups, the producer's at PRODUCER_REGISTERS and the
# kernel capped at WS_MAX_REGISTERS a thread (64: four programs an SM, 104 for the consumers).
# On the H200 the 27B gate|up at eight rows took 34.66 -> 34.24 us alone (Nsight Compute) and
# the 27B q4 C=8 step 0.02-0.09 ms less in six alternating pairs (docs/performance.md,
# Measurement 39).
WARP_SPECIALIZED = True
PRODUCER_REGISTERS, WS_MAX_REGISTERS = 24, 64
# The warp-specialized loop also for products with the next norm folded in after them
# (`NormAfter`: at two to eight rows the MLP down and the attention's out projection; the GDN
# out projection, its x a folded output norm's rows, keeps one partition), the consumer warps
# loading the residual and the norm's weight before their loop. The down product at eight rows
# waits on issuing, fixed-latency stalls and barriers besides its copies (Nsight Compute,
# docs/performance.md, Measurement 39), and runs at 78 % of its copies alone with the codes in
# wide boxes, against the warp-specialized gate|up's 90 % (Measurement 40). Compiled for
# sm_90, not yet run on the GPU machine: off.
WS_NORM_AFTER = False
# Value heads a folded GDN output norm may have (their factors sit in shared memory).
MAX_HEADS = 128

if gluon is not None:
    _GROUP = gl.constexpr(GROUP)
    # TMA's global-to-shared copy: `async_load` since Triton 3.7, the older name before
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a barrier of the program's threads: `barrier` since Triton 3.7, `thread_barrier` before
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # shared memory viewed as another shape: `reinterpret` since Triton 3.7, `_reinterpret` before
    _OLD_SHARED_VIEW = gl.constexpr(hasattr(gl.shared_memory_descriptor, "_reinterpret"))

    @gluon.jit
    def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        if _OLD_SHARED_VIEW:
            return smem._reinterpret(dtype, shape, layout)
        else:
            return smem.reinterpret(dtype, shape, layout)

    _WEIGHT_ORDER = gl.constexpr(WEIGHT_ORDER)
    _X_ORDER = gl.constexpr(X_ORDER)
    _PAIRS_PTX = gl.constexpr(
        """
{
.reg .b32 t1, t2, t3;
.reg .b32 p0, p1, p2, p3, bias;
mov.b32 bias, 0x43084308;
shr.u32 t1, $4, 4;
shr.u32 t2, $4, 8;
shr.u32 t3, $4, 12;
lop3.b32 p0, $4, 0x000F000F, 0x43084308, 0x6a;
lop3.b32 p1, t1, 0x000F000F, 0x43084308, 0x6a;
lop3.b32 p2, t2, 0x000F000F, 0x43084308, 0x6a;
lop3.b32 p3, t3, 0x000F000F, 0x43084308, 0x6a;
sub.rn.bf16x2 $0, p0, bias;
sub.rn.bf16x2 $1, p1, bias;
sub.rn.bf16x2 $2, p2, bias;
sub.rn.bf16x2 $3, p3, bias;
}
"""
    )
    # q6: $5 holds the word's high bits, value q's at bits 2q and value q + 4's at 16 + 2q
    # (`_high_bits`). Per pair, those two bits go under the nibbles at bits 4-5 and 20-21, with
    # the top one flipped: 0x4300 | (code6 xor 32) is the bf16 of 160 + the signed code.
    _Q6_PAIRS_PTX = gl.constexpr(
        """
{
.reg .b32 t1, t2, t3, h0, h1, h3;
.reg .b32 m0, m1, m2, m3, p0, p1, p2, p3, bias;
mov.b32 bias, 0x43204320;
shr.u32 t1, $4, 4;
shr.u32 t2, $4, 8;
shr.u32 t3, $4, 12;
shl.b32 h0, $5, 4;
shl.b32 h1, $5, 2;
shr.u32 h3, $5, 2;
lop3.b32 m0, h0, 0x00300030, 0x43204320, 0x6a;
lop3.b32 m1, h1, 0x00300030, 0x43204320, 0x6a;
lop3.b32 m2, $5, 0x00300030, 0x43204320, 0x6a;
lop3.b32 m3, h3, 0x00300030, 0x43204320, 0x6a;
lop3.b32 p0, $4, 0x000F000F, m0, 0xea;
lop3.b32 p1, t1, 0x000F000F, m1, 0xea;
lop3.b32 p2, t2, 0x000F000F, m2, 0xea;
lop3.b32 p3, t3, 0x000F000F, m3, 0xea;
sub.rn.bf16x2 $0, p0, bias;
sub.rn.bf16x2 $1, p1, bias;
sub.rn.bf16x2 $2, p2, bias;
sub.rn.bf16x2 $3, p3, bias;
}
"""
    )

    @gluon.jit
    def _await_inputs(PDL: gl.constexpr):
        """`pdl_triton.await_inputs` for a Gluon kernel."""
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

    @gluon.jit
    def _bf16_pair(word):
        """An int32 tensor's two halves as bf16 values: [..., 2] (low half first)."""
        both = gl.join(word, word)
        return gl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r,r", [both], dtype=gl.bfloat16, is_pure=True, pack=2
        )

    @gluon.jit
    def _high_bits(high, W_LAYOUT: gl.constexpr):
        """A q6 group's high-bit words [BN, 4] (thread t of a row quad holds word t: bits 2u,
        2u + 1 are bits 4-5 of the thread's value u = 0..15) as [BN, 8] beside the code words:
        for word 2t + h, bytes 2h and 2h + 1 of word t at bytes 0 and 2, so that its value q's
        bits sit at 2q and value q + 4's at 16 + 2q."""
        low = (high & 0xFF) | ((high & 0xFF00) << 8)
        high = ((high >> 16) & 0xFF) | ((high >> 8) & 0xFF0000)
        both = gl.reshape(gl.join(low, high), [high.shape[0], 8])
        return gl.convert_layout(both, W_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _weight_operand(words, high, BN: gl.constexpr, A_LAYOUT: gl.constexpr, Q6: gl.constexpr):
        """Code words [BN, 8] of one group (thread t of a row quad holds words 2t + h; with Q6
        also their high bits, `_high_bits`) to the group's exact integer codes [BN, 64] in the
        MMA's A operand layout. Operand column 32h + 16q1 + 8q0 + 2t + e holds word 2t + h's
        value q + 4e (q = 2q1 + q0), i.e. column 16t + 8h + 4e + 2q1 + q0 of the group
        (`_x_operand` reads x by the same map)."""
        if Q6:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(
                _Q6_PAIRS_PTX,
                "=r,=r,=r,=r,r,r",
                [words, high],
                dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            p0, p1, p2, p3 = gl.inline_asm_elementwise(
                _PAIRS_PTX,
                "=r,=r,=r,=r,r",
                [words],
                dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                is_pure=True,
                pack=1,
            )
        low = gl.join(_bf16_pair(p0), _bf16_pair(p1))  # [BN, 8, e, q0], q1 = 0
        high = gl.join(_bf16_pair(p2), _bf16_pair(p3))
        values = gl.join(low, high)  # [BN, 8, e, q0, q1]
        values = gl.reshape(values, [BN, 2, 2, 2, 2, 2, 2])  # [BN, t1, t0, h, e, q0, q1]
        values = gl.permute(values, _WEIGHT_ORDER.value)  # [BN, h, q1, q0, t1, t0, e]
        values = gl.reshape(values, [BN, _GROUP])
        return gl.convert_layout(values, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _x_operand(x, B_LAYOUT: gl.constexpr):
        """x's group [8, 64] (thread t of a row quad holds columns 16t .. 16t + 15) as the MMA's
        B operand [64, 8], its columns permuted as `_weight_operand`'s."""
        x = gl.reshape(x, [8, 2, 2, 2, 2, 2, 2])  # [8, t1, t0, h, e, q1, q0]
        x = gl.permute(x, _X_ORDER.value)  # [8, h, q1, q0, t1, t0, e]
        x = gl.permute(gl.reshape(x, [8, _GROUP]), [1, 0])
        return gl.convert_layout(x, B_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _column(values, g: gl.constexpr):
        """Column g of a [rows, 8] tensor whose columns are all in each thread's registers."""
        values = gl.reshape(values, [values.shape[0], 2, 2, 2])  # column 4a + 2b + c
        low, high = gl.split(values)
        values = high if g % 2 == 1 else low
        low, high = gl.split(values)
        values = high if (g // 2) % 2 == 1 else low
        low, high = gl.split(values)
        return high if g // 4 == 1 else low

    @gluon.jit
    def _issue_tile(
        descs,
        rings,
        ready,
        slot,
        tile,
        n0,
        pred,
        WEIGHTS: gl.constexpr,
        X: gl.constexpr,
        HALVES: gl.constexpr,
        Q6: gl.constexpr,
    ):
        """Ask TMA for tile `tile`'s codes and scales (WEIGHTS; with Q6 the high bits too) and
        x's tile (X) into ring slot `slot`, counted by its mbarrier. With HALVES the weight is
        [gate; up] seen as two halves (`_descriptors`) and n0 a row of each, up's rows from
        up_rows on. Codes in wide boxes (`WIDE_CODES`: a rank-2 box of [rows, 32 words]) go
        as each K half's boxes, with HALVES gate's rows then up's."""
        x_desc, w_desc, s_desc, h_desc, up_rows = descs
        x_ring, w_ring, s_ring, h_ring = rings
        groups: gl.constexpr = s_desc.block_type.shape[-1]
        bar = ready.index(slot)
        WIDE: gl.constexpr = len(w_desc.block_type.shape) == 2
        if WEIGHTS:
            if WIDE:
                rows: gl.constexpr = w_desc.block_type.shape[0]
                words = w_ring.index(slot)
                for b in gl.static_range(2):
                    column = tile * (groups * 8) + b * (groups * 4)
                    if HALVES:
                        gate = words.slice(2 * b * rows, rows)
                        _tma_load(w_desc, [n0, column], bar, gate, pred=pred)
                        up = words.slice((2 * b + 1) * rows, rows)
                        _tma_load(w_desc, [up_rows + n0, column], bar, up, pred=pred)
                    else:
                        box = words.slice(b * rows, rows)
                        _tma_load(w_desc, [n0, column], bar, box, pred=pred)
            elif HALVES:
                _tma_load(w_desc, [tile * groups, 0, n0, 0], bar, w_ring.index(slot), pred=pred)
            else:
                _tma_load(w_desc, [tile * groups, n0, 0], bar, w_ring.index(slot), pred=pred)
            if HALVES:
                _tma_load(s_desc, [0, n0, tile * groups], bar, s_ring.index(slot), pred=pred)
            else:
                _tma_load(s_desc, [n0, tile * groups], bar, s_ring.index(slot), pred=pred)
            if Q6 and WIDE:  # the tile's high bits: a row's 32 words, one box
                _tma_load(h_desc, [n0, tile * (groups * 4)], bar, h_ring.index(slot), pred=pred)
            elif Q6:
                _tma_load(h_desc, [tile * groups, n0, 0], bar, h_ring.index(slot), pred=pred)
        if X:
            _tma_load(x_desc, [tile * groups, 0, 0], bar, x_ring.index(slot), pred=pred)

    @gluon.jit
    def _swiglu_out(acc, out_ptr, M, N, n0, BN: gl.constexpr):
        """Write out[m, n0 + i] = silu(gate) * up for the accumulator [BN, 8] of gate's rows
        over up's: both products rounded to bf16 first, then `swiglu_triton`'s arithmetic in
        fp32 (bit for bit the product followed by `silu_mul`). The halves meet through shared
        memory, as the MMA puts them in different warps."""
        HALF: gl.constexpr = BN // 2
        OUT_LAYOUT: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])
        both = gl.allocate_shared_memory(
            gl.bfloat16, [BN, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        both.store(acc.to(gl.bfloat16))
        _barrier()
        gate = both.slice(0, HALF).load(OUT_LAYOUT).to(gl.float32)
        up = both.slice(HALF, HALF).load(OUT_LAYOUT).to(gl.float32)
        values = (gate * (1 / (1 + gl.exp(-gate))) * up).to(gl.bfloat16)
        rows = n0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, OUT_LAYOUT))
        x_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, OUT_LAYOUT))
        at = gl.expand_dims(x_rows, 0) * N + gl.expand_dims(rows, 1)
        mask = (gl.expand_dims(x_rows, 0) < M) & (gl.expand_dims(rows, 1) < N)
        gl.store(out_ptr + at, values, mask=mask)

    @gluon.jit
    def _tile_product(
        acc, rings, slot, tile, head_scales, BN: gl.constexpr, GROUPS: gl.constexpr,
        Q6: gl.constexpr, HEAD_DIM: gl.constexpr, MMA: gl.constexpr, A_LAYOUT: gl.constexpr,
        B_LAYOUT: gl.constexpr, W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr,
        X_LAYOUT: gl.constexpr, H_LAYOUT: gl.constexpr, X_SHARED: gl.constexpr,
        W_SHARED: gl.constexpr, S_SHARED: gl.constexpr,
    ):  # fmt: skip
        """acc plus ring slot `slot`'s tile (K tile `tile`) of the product: each group's codes
        as the MMA's A operand, x's group as its B, the group's fp32 product times its scales
        (and with HEAD_DIM, the x rows' head factors from head_scales)."""
        x_ring, w_ring, s_ring, h_ring = rings
        xs = _view(x_ring.index(slot), gl.bfloat16, [GROUPS * 8, _GROUP], X_SHARED)
        WIDE: gl.constexpr = len(w_ring.shape) == 3  # [STAGES, 2 * BN, 32] (`WIDE_CODES`)
        if WIDE:  # a K half's rows over the other's, each row four groups of 8 words
            ws = w_ring.index(slot)
        else:
            ws = _view(w_ring.index(slot), gl.int32, [GROUPS * BN, 8], W_SHARED)
        scales = _view(s_ring.index(slot), gl.float16, [BN, GROUPS], S_SHARED)
        scales = scales.load(S_LAYOUT).to(gl.float32)
        if Q6 and WIDE:  # [BN, 32]: a row's four words of each group
            hs = h_ring.index(slot)
        elif Q6:
            hs = _view(h_ring.index(slot), gl.int32, [GROUPS * BN, 4], W_SHARED)
        for g in gl.static_range(GROUPS):
            if WIDE:
                half = ws.slice((g // (GROUPS // 2)) * BN, BN)
                words = half.slice((g % (GROUPS // 2)) * 8, 8, dim=1).load(W_LAYOUT)
            else:
                words = ws.slice(g * BN, BN).load(W_LAYOUT)
            if Q6 and WIDE:
                high = _high_bits(hs.slice(g * 4, 4, dim=1).load(H_LAYOUT), W_LAYOUT)
            elif Q6:
                high = _high_bits(hs.slice(g * BN, BN).load(H_LAYOUT), W_LAYOUT)
            else:
                high = words
            a = _weight_operand(words, high, BN, A_LAYOUT, Q6)
            b = _x_operand(xs.slice(g * 8, 8).load(X_LAYOUT), B_LAYOUT)
            product = mma_v2(a, b, gl.zeros([BN, 8], gl.float32, MMA))
            scale = gl.convert_layout(
                _column(scales, g), gl.SliceLayout(1, MMA), assert_trivial=True
            )
            if HEAD_DIM > 0:
                head = (tile * GROUPS + g) * _GROUP // HEAD_DIM
                factors = head_scales.index(head).load(gl.SliceLayout(0, MMA))
                product = product * gl.expand_dims(factors, 0)
            acc = acc + product * gl.expand_dims(scale, 1)
        return acc

    @gluon.jit
    def _ask_for_weights(
        descs, rings, ready, first, count, n0, NBYTES: gl.constexpr, TILES: gl.constexpr,
        WEIGHTS_FIRST: gl.constexpr, SWIGLU: gl.constexpr, Q6: gl.constexpr,
    ):  # fmt: skip
        """Before the PDL wait: each of the first TILES ring slots expects its tile's bytes,
        and with WEIGHTS_FIRST the tile's codes and scales (no kernel writes them) are asked
        for; x's part follows after the wait."""
        for i in gl.static_range(TILES):
            mbarrier.expect(ready.index(i), NBYTES, pred=i < count)
            if WEIGHTS_FIRST:
                _issue_tile(
                    descs, rings, ready, i, first + i, n0, i < count, True, False, SWIGLU, Q6
                )

    @gluon.jit
    def _produce_tiles(
        descs, rings, ready, empty, first, count, n0, PDL: gl.constexpr,
        WEIGHTS_FIRST: gl.constexpr, SWIGLU: gl.constexpr, STAGES: gl.constexpr,
        NBYTES: gl.constexpr,
    ):  # fmt: skip
        """The producer warp of the warp-specialized product (`WARP_SPECIALIZED`): x's part of
        the first STAGES tiles once the kernel before has finished (their codes and scales went
        before the wait, from the program), then each next tile into the slot the consumers
        release (its `empty` mbarrier), counted by the slot's `ready` one."""
        _await_inputs(PDL)
        for i in gl.static_range(STAGES):
            _issue_tile(
                descs, rings, ready, i, first + i, n0, i < count, not WEIGHTS_FIRST, True, SWIGLU,
                False,
            )  # fmt: skip
        for j in range(STAGES, count):
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) + 1) & 1)  # tile j - STAGES read
            mbarrier.expect(ready.index(slot), NBYTES)
            _issue_tile(descs, rings, ready, slot, first + j, n0, True, True, True, SWIGLU, False)

    @gluon.jit
    def _consume_tiles(
        rings, ready, empty, count, first, squares_ptr, square_blocks, inv_width, eps,
        residual_ptr, norm_weight_ptr, M, N, n0, PDL: gl.constexpr, ROW_SCALE: gl.constexpr,
        SQUARE_BLOCKS: gl.constexpr, FOLD: gl.constexpr, STAGES: gl.constexpr,
        BN: gl.constexpr, GROUPS: gl.constexpr, MMA: gl.constexpr, A_LAYOUT: gl.constexpr,
        B_LAYOUT: gl.constexpr, W_LAYOUT: gl.constexpr, S_LAYOUT: gl.constexpr,
        X_LAYOUT: gl.constexpr, X_SHARED: gl.constexpr, W_SHARED: gl.constexpr,
        S_SHARED: gl.constexpr,
    ):  # fmt: skip
        """The program's four warps under `WARP_SPECIALIZED`: each tile as it arrives
        (`_tile_product`), its slot released to the producer after; with ROW_SCALE each x
        row's folded-norm factor applied at the end. With FOLD (`WS_NORM_AFTER`) the residual
        and the norm's weight that the epilogue after the partitions reads are loaded before
        the loop, as the one-partition kernel loads them. Returns (acc, residual, norm
        weight), zeros in place of the two without FOLD: a tuple, which the Triton versions
        checked return alike."""
        acc = gl.zeros([BN, 8], gl.float32, MMA)
        if ROW_SCALE or FOLD:
            _await_inputs(PDL)
        if ROW_SCALE:
            squares = _load_squares(squares_ptr, square_blocks, SQUARE_BLOCKS)
        if FOLD:
            rows, x_rows, at, mask = _out_index(n0, M, N, BN, MMA)
            residual = gl.load(residual_ptr + at, mask=mask, other=0.0)
            norm_weight = gl.load(norm_weight_ptr + rows, mask=rows < N, other=0.0)
        else:
            residual = acc
            norm_weight = acc
        for j in range(count):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            acc = _tile_product(
                acc, rings, slot, first + j, 0.0, BN, GROUPS, False, 0, MMA, A_LAYOUT,
                B_LAYOUT, W_LAYOUT, S_LAYOUT, X_LAYOUT, W_LAYOUT, X_SHARED, W_SHARED, S_SHARED,
            )  # fmt: skip
            mbarrier.arrive(empty.index(slot), count=1)
        if ROW_SCALE:
            scale = _row_scale(squares, inv_width, eps, MMA)
            acc = acc * gl.expand_dims(scale, 0)
        return acc, residual, norm_weight

    @gluon.jit
    def _tail_sum(
        acc, partial_ptr, counters_ptr, block, split, splits, BN: gl.constexpr, MMA: gl.constexpr
    ):
        """A tail block's share (`_q4_tc_kernel`'s TAIL): write this split's [BN, 8] fp32 partial,
        arrive at the block's counter, and for the last to arrive, the partials added up in
        split order (the same bits whichever arrives last) and the counter reset. Returns
        (the sum, or acc where not the last; whether this program is the last)."""
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        columns = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        at = block * splits * (BN * 8) + gl.expand_dims(rows, 1) * 8 + gl.expand_dims(columns, 0)
        gl.store(partial_ptr + at + split * (BN * 8), acc)
        _barrier()  # every thread's partial is written before the arrival counts
        counter = counters_ptr + block
        last = gl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
        if last:
            acc = gl.zeros([BN, 8], gl.float32, MMA)
            for s in range(0, splits):
                # .cg reads from L2, where the other programs' partials are
                acc += gl.load(partial_ptr + at + s * (BN * 8), cache_modifier=".cg")
            gl.atomic_xchg(counter, 0, sem=COUNTER_RESET_SEM)
        return acc, last

    @gluon.jit
    def _out_index(n0, M, N, BN: gl.constexpr, MMA: gl.constexpr):
        """(output rows, x rows, offsets, mask) of a program's [BN, 8] result in out[M, N]."""
        rows = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        x_rows = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        at = gl.expand_dims(x_rows, 0) * N + gl.expand_dims(rows, 1)
        mask = (gl.expand_dims(x_rows, 0) < M) & (gl.expand_dims(rows, 1) < N)
        return rows, x_rows, at, mask

    @gluon.jit
    def _load_squares(squares_ptr, blocks, BLOCKS: gl.constexpr):
        """A folded norm's sums of squares of its `blocks` column blocks ([blocks, 8] fp32, x
        row m in column m), padded to BLOCKS with zeros (`_row_scale` adds them up)."""
        # a thread holds blocks of one column: the sum over blocks is in-thread adds and two
        # shuffles, not five shuffles a column
        LAYOUT: gl.constexpr = gl.BlockedLayout([BLOCKS // 16, 1], [4, 8], [4, 1], [0, 1])
        block = gl.arange(0, BLOCKS, layout=gl.SliceLayout(1, LAYOUT))
        column = gl.arange(0, 8, layout=gl.SliceLayout(0, LAYOUT))
        at = gl.expand_dims(block, 1) * 8 + gl.expand_dims(column, 0)
        return gl.load(squares_ptr + at, mask=gl.expand_dims(block < blocks, 1), other=0.0)

    @gluon.jit
    def _head_scales(
        squares_ptr,
        M,
        heads,
        blocks,
        eps,
        HEAD_DIM: gl.constexpr,
        HEADS: gl.constexpr,
        BLOCKS: gl.constexpr,
    ):
        """rsqrt(mean(o^2) + eps) of each head and x row of a folded GDN output norm, [HEADS, 8]
        (padding past M and `heads` is never read), from its sums of squares [M, heads,
        blocks]."""
        LAYOUT: gl.constexpr = gl.BlockedLayout([1, 1, BLOCKS], [32, 1, 1], [1, 4, 1], [2, 1, 0])
        head = gl.arange(0, HEADS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LAYOUT)))
        row = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LAYOUT)))
        block = gl.arange(0, BLOCKS, layout=gl.SliceLayout(0, gl.SliceLayout(1, LAYOUT)))
        head3 = gl.expand_dims(gl.expand_dims(head, 1), 2)
        row3 = gl.expand_dims(gl.expand_dims(row, 0), 2)
        block3 = gl.expand_dims(gl.expand_dims(block, 0), 1)
        at = (row3 * heads + head3) * blocks + block3
        mask = (row3 < M) & (head3 < heads) & (block3 < blocks)
        squares = gl.load(squares_ptr + at, mask=mask, other=0.0)
        return gl.rsqrt(gl.sum(squares, axis=2) * (1.0 / HEAD_DIM) + eps)

    @gluon.jit
    def _row_scale(squares, inv_width, eps, MMA: gl.constexpr):
        """Each x row's factor rsqrt(mean(h^2) + eps) of a folded norm from its sums of squares
        (`_load_squares`), as the accumulator's column vector."""
        scale = gl.rsqrt(gl.sum(squares, axis=0) * inv_width + eps)
        return gl.convert_layout(scale, gl.SliceLayout(0, MMA))

    @gluon.jit
    def _fold_out(total, out_ptr, fold, at, mask, x_rows, pid_n):
        """The epilogue of a product with the next norm folded in (`norm_fold`), given the
        residual and the norm's weight (loaded before the loop): h = the result rounded, plus
        the residual, rounded as the unfused add is, written to the sum; u = h * (1 + w)
        written as the output; and row block pid_n's sum of h^2 of each x row (rows past N
        and M add zeros) to its row of the squares table."""
        residual, norm_weight, sum_ptr, squares_ptr = fold
        h = (total.to(gl.bfloat16).to(gl.float32) + residual.to(gl.float32)).to(gl.bfloat16)
        gl.store(sum_ptr + at, h, mask=mask)
        h = h.to(gl.float32)
        weighted = h * gl.expand_dims(1.0 + norm_weight.to(gl.float32), 1)
        gl.store(out_ptr + at, weighted.to(gl.bfloat16), mask=mask)
        gl.store(squares_ptr + pid_n * 8 + x_rows, gl.sum(h * h, axis=0))

    @gluon.jit
    def _conv_inputs(conv, n0, M, N, BN: gl.constexpr, MMA: gl.constexpr):
        """What the conv's epilogue reads, loaded before the loop so that it arrives during it:
        x row m's state slot, and for the program's [BN, 8] outputs each q|k|v channel's window
        of that slot (its three entries) and its four taps (`_conv_out`, which makes the
        window's pointers again rather than hold them through the loop)."""
        taps_ptr, windows_ptr, slots_ptr, channels, stride_taps, stride_slot, stride_channel = conv
        rows, x_rows, _, mask = _out_index(n0, M, N, BN, MMA)
        slots = gl.load(slots_ptr + x_rows, mask=x_rows < M, other=0)
        window, conv_rows = _window(conv, slots, rows, mask)
        taps = taps_ptr + rows.to(gl.int64) * stride_taps
        tap_rows = rows < channels
        return (
            slots,
            gl.load(window, mask=conv_rows, other=0.0),
            gl.load(window + 1, mask=conv_rows, other=0.0),
            gl.load(window + 2, mask=conv_rows, other=0.0),
            gl.load(taps, mask=tap_rows, other=0.0),
            gl.load(taps + 1, mask=tap_rows, other=0.0),
            gl.load(taps + 2, mask=tap_rows, other=0.0),
            gl.load(taps + 3, mask=tap_rows, other=0.0),
        )

    @gluon.jit
    def _window(conv, slots, rows, mask):
        """(pointers, mask) of the conv windows of a program's [BN, 8] outputs: channel
        rows[i]'s window in x row m's state slot, for the q|k|v channels."""
        taps_ptr, windows_ptr, slots_ptr, channels, stride_taps, stride_slot, stride_channel = conv
        window = (
            windows_ptr
            + gl.expand_dims(slots.to(gl.int64), 0) * stride_slot
            + gl.expand_dims(rows.to(gl.int64), 1) * stride_channel
        )
        return window, gl.expand_dims(rows < channels, 1) & mask

    @gluon.jit
    def _conv_out(acc, out_ptr, conv, conv_in, rows, at, mask):
        """The epilogue of a GDN in projection with its causal conv (taps of width 4, one token
        a sequence): q|k|v channels get silu(conv) of the product rounded to bf16, in
        `causal_conv1d_triton`'s arithmetic (fp32, the taps in order, the window's three
        entries then the new input), so bit for bit the product followed by that kernel; the
        window shifts the rounded product in. The other channels (z) get the product."""
        slots, w0, w1, w2, t0, t1, t2, t3 = conv_in
        window, conv_rows = _window(conv, slots, rows, mask)
        y = acc.to(gl.bfloat16)
        new = y.to(gl.float32)
        total = gl.zeros_like(acc)
        total += w0.to(gl.float32) * gl.expand_dims(t0.to(gl.float32), 1)
        total += w1.to(gl.float32) * gl.expand_dims(t1.to(gl.float32), 1)
        total += w2.to(gl.float32) * gl.expand_dims(t2.to(gl.float32), 1)
        total += new * gl.expand_dims(t3.to(gl.float32), 1)
        silu = (total * (1 / (1 + gl.exp(-total)))).to(gl.bfloat16)
        gl.store(out_ptr + at, gl.where(conv_rows, silu, y), mask=mask)
        gl.store(window, w1, mask=conv_rows)
        gl.store(window + 1, w2, mask=conv_rows)
        gl.store(window + 2, y.to(window.dtype.element_ty), mask=conv_rows)

    @gluon.jit
    def _gates_program(
        row,
        first_token,
        gates,
        M,
        K,
        squares_ptr,
        square_blocks,
        inv_width,
        eps,
        PDL: gl.constexpr,
        ROW_SCALE: gl.constexpr,
        SQUARE_BLOCKS: gl.constexpr,
        CHUNKS: gl.constexpr,
        SHARE: gl.constexpr,
    ):
        """One b|a row of a GDN layer's gates from its input x, for the SHARE tokens (x rows)
        from first_token on (every token where SHARE is 8):
        `gdn_gates_triton.gdn_gates_from_x`'s dot products (fp32, in another order, rounded to
        x's dtype; with ROW_SCALE each token's folded-norm factor first), then beta =
        sigmoid(b) for a b row, g = -exp(A_log) * softplus(a + dt_bias) for an a row. These
        programs follow the product's in the grid; at two programs an SM the 27B in
        projection's 96 start as its row blocks end (put first, or run by the first row
        blocks before their loop, they delayed the product more; docs/performance.md,
        Measurement 29). Each takes one row and asks for all of it at once: the weight row
        (CHUNKS of 1024 columns, 16-byte loads) before the PDL wait (no kernel writes it),
        then x token by token (the loads of several tokens in flight together), not a round
        trip per chunk of columns: a loop over chunks added 3.4 us to the 27B in projection's
        16 us and nothing to the step (Measurement 28)."""
        x_ptr, stride_x, ba_ptr, stride_ba, heads, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr = gates
        # [chunk, lane, column]: lane i of the program holds columns 8i .. 8i + 7 of every
        # chunk of 1024 and adds its products up in-thread
        L3: gl.constexpr = gl.BlockedLayout([CHUNKS, 1, 8], [1, 32, 1], [1, 4, 1], [2, 1, 0])
        chunk = gl.arange(0, CHUNKS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        block = gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        inner = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        cols = (
            gl.expand_dims(gl.expand_dims(chunk, 1), 2) * 1024
            + gl.expand_dims(gl.expand_dims(block, 0), 2) * 8
            + gl.expand_dims(gl.expand_dims(inner, 0), 1)
        )  # [CHUNKS, 128, 8]
        in_k = cols < K
        w = gl.load(ba_ptr + row.to(gl.int64) * stride_ba + cols, mask=in_k, other=0.0)
        w = w.to(gl.float32)
        _await_inputs(PDL)
        if ROW_SCALE:
            squares = _load_squares(squares_ptr, square_blocks, SQUARE_BLOCKS)
        # each lane's sum of each token, [token, lane], then one sum over the lanes
        SUMS: gl.constexpr = gl.BlockedLayout([8, 1], [1, 32], [1, 4], [1, 0])
        TOKENS: gl.constexpr = gl.SliceLayout(1, SUMS)
        tokens = gl.arange(0, 8, layout=TOKENS)
        sums = gl.zeros([8, 128], gl.float32, SUMS)
        for i in gl.static_range(SHARE):
            t = first_token + i
            x = gl.load(x_ptr + t * stride_x + cols, mask=in_k & (t < M), other=0.0)
            part = gl.sum(gl.sum(w * x.to(gl.float32), axis=2), axis=0)  # [128]
            part = gl.expand_dims(gl.convert_layout(part, gl.SliceLayout(0, SUMS)), 0)
            sums = gl.where(gl.expand_dims(tokens, 1) == t, part, sums)
        dots = gl.sum(sums, axis=1)  # one per token
        if ROW_SCALE:
            scale = gl.rsqrt(gl.sum(squares, axis=0) * inv_width + eps)
            dots = dots * gl.convert_layout(scale, TOKENS)
        dots = dots.to(x_ptr.dtype.element_ty).to(gl.float32)
        mine = (tokens < M) & (tokens >= first_token) & (tokens < first_token + SHARE)
        if row < heads:
            at = tokens * heads + row
            beta = 1 / (1 + gl.exp(-dots))
            gl.store(beta_ptr + at, beta.to(beta_ptr.dtype.element_ty), mask=mine)
        else:
            head = row - heads
            A_log = gl.load(A_log_ptr + head).to(gl.float32)
            dt_bias = gl.load(dt_bias_ptr + head).to(gl.float32)
            gl.store(g_ptr + tokens * heads + head, _log_decay(dots, A_log, dt_bias), mask=mine)

    @gluon.jit
    def _q4_tc_kernel(
        x_desc,
        w_desc,
        s_desc,
        h_desc,
        out_ptr,
        partial_ptr,
        counters_ptr,
        M,
        N,
        tiles_per_split,
        num_tiles,
        residual_ptr,
        norm_weight_ptr,
        sum_ptr,
        squares_out_ptr,
        squares_in_ptr,
        square_blocks,
        inv_width,
        eps,
        head_squares_ptr,
        heads,
        head_blocks,
        head_eps,
        conv_taps_ptr,
        windows_ptr,
        slots_ptr,
        conv_channels,
        stride_taps,
        stride_slot,
        stride_channel,
        x_ptr,
        stride_x,
        ba_ptr,
        stride_ba,
        gate_heads,
        A_log_ptr,
        dt_bias_ptr,
        g_ptr,
        beta_ptr,
        BN: gl.constexpr,
        GROUPS: gl.constexpr,
        STAGES: gl.constexpr,
        SPLIT_K: gl.constexpr,
        WEIGHTS_FIRST: gl.constexpr,
        PDL: gl.constexpr,
        SWIGLU: gl.constexpr,
        Q6: gl.constexpr,
        FOLD: gl.constexpr,
        ROW_SCALE: gl.constexpr,
        SQUARE_BLOCKS: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        HEADS: gl.constexpr,
        HEAD_BLOCKS: gl.constexpr,
        CONV: gl.constexpr,
        GATES: gl.constexpr,
        GATE_CHUNKS: gl.constexpr,
        full_blocks=0,
        tail_splits=1,
        tail_per_split=1,
        TAIL: gl.constexpr = False,
        gate_shares=1,
        GATE_TOKENS: gl.constexpr = 8,
        WS: gl.constexpr = False,
        PRODUCER_REGS: gl.constexpr = 24,
    ):
        """out[M, N] = x[M, K] @ W[N, K]^T for a q4_g64 W (module docstring). With SPLIT_K,
        program (n, s) takes tiles s * tiles_per_split ...; the last to arrive at row block
        n's counter (then reset by it) adds the partials up and writes out. With SWIGLU, W is
        [gate; up] (2N rows): a program's BN rows are gate's rows n0 .. n0 + BN/2 over up's
        same rows, and out[M, N] = silu(gate product) * up product. With Q6, W is q6_g64:
        the same codes plane and scales as q4_g64, and h_desc its high bits. With ROW_SCALE,
        x is a folded norm's weighted rows and each x row's factor, from the square_blocks
        sums at squares_in_ptr, multiplies the accumulator first; with FOLD the result is
        added to the residual and its norm's parts written instead (`_fold_out`; the module
        `norm_fold` says what each side computes). With HEAD_DIM, x is the GDN output norm's
        folded rows: each group's product is also multiplied by its x rows' factors of the
        head it lies in, from the sums at head_squares_ptr ([M, heads, head_blocks]). With
        CONV, outputs below `conv`'s channel count are a GDN layer's q|k|v channels, x row m
        sequence m's one token, and the program writes their causal conv instead
        (`_conv_out`). With GATES, the grid's programs after the product's (gate_shares a
        b|a row, each taking GATE_TOKENS of the tokens) compute a GDN layer's gates from x
        instead (`_gates_program`), reading x through plain pointers (x_ptr) while the
        product's programs stream the weight. With TAIL, the
        row blocks from full_blocks on, which would run as a second wave, are split: program
        full_blocks + tail_splits * b + s takes tiles s * tail_per_split ... of block
        full_blocks + b, writes its fp32 partial, and the last to arrive at the block's
        counter adds them up and runs the epilogue."""
        conv = (
            conv_taps_ptr,
            windows_ptr,
            slots_ptr,
            conv_channels,
            stride_taps,
            stride_slot,
            stride_channel,
        )
        products = gl.cdiv(N, BN // 2 if SWIGLU else BN)
        if GATES and gl.program_id(0) >= products:
            gates = (
                x_ptr,
                stride_x,
                ba_ptr,
                stride_ba,
                gate_heads,
                A_log_ptr,
                dt_bias_ptr,
                g_ptr,
                beta_ptr,
            )
            _gates_program(
                (gl.program_id(0) - products) // gate_shares,
                (gl.program_id(0) - products) % gate_shares * GATE_TOKENS,
                gates,
                M,
                num_tiles * (GROUPS * _GROUP),
                squares_in_ptr,
                square_blocks,
                inv_width,
                eps,
                PDL,
                ROW_SCALE,
                SQUARE_BLOCKS,
                GATE_CHUNKS,
                GATE_TOKENS,
            )
        else:
            R: gl.constexpr = BN // 64  # 16-row blocks per warp
            MMA: gl.constexpr = gl.NVMMADistributedLayout(
                version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]
            )
            A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
            B_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
            ROWS_REG: gl.constexpr = [[8, 0]] + ([[64, 0]] if R == 2 else [])
            ROWS_LANE: gl.constexpr = [[1, 0], [2, 0], [4, 0]]
            ROWS_WARP: gl.constexpr = [[16, 0], [32, 0]]
            # a group's words: row g (+ 8, + 64) of a quad's lane 4g + t holds words 2t, 2t + 1
            W_LAYOUT: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1]] + ROWS_REG,
                lane_bases=[[0, 2], [0, 4]] + ROWS_LANE,
                warp_bases=ROWS_WARP,
                block_bases=[],
                shape=[BN, 8],
            )
            # a tile's scales: every group of the thread's rows
            S_LAYOUT: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4]] + ROWS_REG,
                lane_bases=[[0, 0], [0, 0]] + ROWS_LANE,
                warp_bases=ROWS_WARP,
                block_bases=[],
                shape=[BN, 8],
            )
            # x's group: lane 4g + t holds x row g's columns 16t .. 16t + 15, in every warp
            X_LAYOUT: gl.constexpr = gl.DistributedLinearLayout(
                reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]],
                lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
                warp_bases=[[0, 0], [0, 0]],
                block_bases=[],
                shape=[8, _GROUP],
            )
            X_SHARED: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=128, element_bitwidth=16, rank=2
            )
            W_SHARED: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=0, element_bitwidth=32, rank=2
            )
            S_SHARED: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=0, element_bitwidth=16, rank=2
            )
            gl.static_assert(GROUPS == 8)
            gl.static_assert(not (SWIGLU and SPLIT_K))
            gl.static_assert(not (SWIGLU and FOLD))
            gl.static_assert(not (CONV and (SWIGLU or FOLD or SPLIT_K)))
            gl.static_assert(not (TAIL and (SPLIT_K or FOLD or CONV or GATES)))

            pid_n = gl.program_id(0)
            split = gl.program_id(1)
            first = split * tiles_per_split
            count = gl.minimum(num_tiles - first, tiles_per_split)
            if TAIL:
                if pid_n >= full_blocks:  # a share of a tail block's tiles
                    tail = pid_n - full_blocks
                    split = tail % tail_splits
                    pid_n = full_blocks + tail // tail_splits
                    first = split * tail_per_split
                    count = gl.minimum(num_tiles - first, tail_per_split)
            n0 = pid_n * (BN // 2 if SWIGLU else BN)

            x_ring = gl.allocate_shared_memory(
                gl.bfloat16, [STAGES, GROUPS, 8, _GROUP], x_desc.layout
            )
            WIDE: gl.constexpr = len(w_desc.block_type.shape) == 2  # `WIDE_CODES`
            if WIDE:  # a slot: each K half's boxes (gate's rows, then up's with SWIGLU)
                w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 2 * BN, 32], w_desc.layout)
            elif (
                SWIGLU
            ):  # a slot holds gate's rows of each group, then up's: [GROUPS, BN, 8] in memory
                w_ring = gl.allocate_shared_memory(
                    gl.int32, [STAGES, GROUPS, 2, BN // 2, 8], w_desc.layout
                )
            else:
                w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, GROUPS, BN, 8], w_desc.layout)
            if SWIGLU:
                s_ring = gl.allocate_shared_memory(
                    gl.float16, [STAGES, 2, BN // 2, GROUPS], s_desc.layout
                )
            else:
                s_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, GROUPS], s_desc.layout)
            if Q6 and WIDE:  # a row's four words of high bits a group, the groups side by side
                h_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 32], h_desc.layout)
            elif Q6:  # a group's four words of high bits per row
                h_ring = gl.allocate_shared_memory(gl.int32, [STAGES, GROUPS, BN, 4], h_desc.layout)
            if Q6:
                # thread t of a row quad: high word t of its rows
                H_LAYOUT: gl.constexpr = gl.DistributedLinearLayout(
                    reg_bases=ROWS_REG,
                    lane_bases=[[0, 1], [0, 2]] + ROWS_LANE,
                    warp_bases=ROWS_WARP,
                    block_bases=[],
                    shape=[BN, 4],
                )
            else:
                h_ring = w_ring
                H_LAYOUT: gl.constexpr = W_LAYOUT  # unused
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
            descs = (x_desc, w_desc, s_desc, h_desc, N)  # N: with SWIGLU, up's first row
            rings = (x_ring, w_ring, s_ring, h_ring)
            nbytes: gl.constexpr = (
                x_desc.block_type.nbytes
                + w_desc.block_type.nbytes * ((4 if SWIGLU else 2) if WIDE else 1)
                + s_desc.block_type.nbytes
                + (h_desc.block_type.nbytes if Q6 else 0)
            )
            if WS:  # a producer warp keeps the ring full (`_produce_tiles`)
                gl.static_assert(not (CONV or Q6 or HEAD_DIM > 0))
                conv_in = 0.0  # what the conv's epilogue reads; it does not run here
                squares = 0.0
                empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
                for i in gl.static_range(STAGES):
                    mbarrier.init(empty.index(i), count=1)
                _ask_for_weights(
                    descs, rings, ready, first, count, n0, nbytes, STAGES, WEIGHTS_FIRST, SWIGLU, Q6
                )
                acc, residual, norm_weight = gl.warp_specialize(
                    [
                        (
                            _consume_tiles,
                            (
                                rings, ready, empty, count, first, squares_in_ptr, square_blocks,
                                inv_width, eps, residual_ptr, norm_weight_ptr, M, N, n0, PDL,
                                ROW_SCALE, SQUARE_BLOCKS, FOLD, STAGES, BN, GROUPS, MMA,
                                A_LAYOUT, B_LAYOUT, W_LAYOUT, S_LAYOUT, X_LAYOUT, X_SHARED,
                                W_SHARED, S_SHARED,
                            ),
                        ),
                        (
                            _produce_tiles,
                            (
                                descs, rings, ready, empty, first, count, n0, PDL, WEIGHTS_FIRST,
                                SWIGLU, STAGES, nbytes,
                            ),
                        ),
                    ],
                    [1],
                    [PRODUCER_REGS],
                )  # fmt: skip
                for i in gl.static_range(STAGES):
                    mbarrier.invalidate(ready.index(i))
                    mbarrier.invalidate(empty.index(i))
            else:
                _ask_for_weights(
                    descs,
                    rings,
                    ready,
                    first,
                    count,
                    n0,
                    nbytes,
                    STAGES - 1,
                    WEIGHTS_FIRST,
                    SWIGLU,
                    Q6,
                )
                _await_inputs(PDL)
                for i in gl.static_range(STAGES - 1):
                    _issue_tile(
                        descs,
                        rings,
                        ready,
                        i,
                        first + i,
                        n0,
                        i < count,
                        not WEIGHTS_FIRST,
                        True,
                        SWIGLU,
                        Q6,
                    )
                # what a folded norm's epilogue reads, asked for now: it arrives during the loop, and
                # the epilogue, on the step's critical path, waits for no load of its own
                if ROW_SCALE:
                    squares = _load_squares(squares_in_ptr, square_blocks, SQUARE_BLOCKS)
                else:
                    squares = 0.0
                if HEAD_DIM > 0:  # every head's factors, in shared memory for the loop to index
                    # written through a [HEADS, 8] view; a rank-1 layout, so that `index` gives one
                    # head's [8]
                    head_scales = gl.allocate_shared_memory(
                        gl.float32, [HEADS, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
                    )
                    table: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
                    _view(head_scales, gl.float32, [HEADS, 8], table).store(
                        _head_scales(
                            head_squares_ptr,
                            M,
                            heads,
                            head_blocks,
                            head_eps,
                            HEAD_DIM,
                            HEADS,
                            HEAD_BLOCKS,
                        )
                    )
                    _barrier()
                else:
                    head_scales = 0.0
                if FOLD:
                    rows, x_rows, at, mask = _out_index(n0, M, N, BN, MMA)
                    residual = gl.load(residual_ptr + at, mask=mask, other=0.0)
                    norm_weight = gl.load(norm_weight_ptr + rows, mask=rows < N, other=0.0)
                else:
                    residual = 0.0
                    norm_weight = 0.0
                if CONV:
                    conv_in = _conv_inputs(conv, n0, M, N, BN, MMA)
                else:
                    conv_in = 0.0

                acc = gl.zeros([BN, 8], gl.float32, MMA)
                for j in range(count):
                    # refill the slot every warp finished reading a turn ago
                    ahead = j + STAGES - 1
                    slot_ahead = ahead % STAGES
                    _barrier()
                    fence_async_shared()
                    mbarrier.expect(ready.index(slot_ahead), nbytes, pred=ahead < count)
                    _issue_tile(
                        descs,
                        rings,
                        ready,
                        slot_ahead,
                        first + ahead,
                        n0,
                        ahead < count,
                        True,
                        True,
                        SWIGLU,
                        Q6,
                    )

                    slot = j % STAGES
                    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
                    acc = _tile_product(
                        acc, rings, slot, first + j, head_scales, BN, GROUPS, Q6, HEAD_DIM, MMA,
                        A_LAYOUT, B_LAYOUT, W_LAYOUT, S_LAYOUT, X_LAYOUT, H_LAYOUT, X_SHARED,
                        W_SHARED, S_SHARED,
                    )  # fmt: skip
                for i in gl.static_range(STAGES):
                    mbarrier.invalidate(ready.index(i))

            if ROW_SCALE and not WS:  # (the consumer warps apply it under WS)
                scale = _row_scale(squares, inv_width, eps, MMA)
                acc = acc * gl.expand_dims(scale, 0)
            if TAIL:
                last = pid_n < full_blocks
                if pid_n >= full_blocks:
                    acc, last = _tail_sum(
                        acc,
                        partial_ptr,
                        counters_ptr,
                        pid_n - full_blocks,
                        split,
                        tail_splits,
                        BN,
                        MMA,
                    )
                if last:  # a whole block, or the last share of a tail block to arrive
                    if SWIGLU:
                        _swiglu_out(acc, out_ptr, M, N, n0, BN)
                    else:
                        rows, x_rows, at, mask = _out_index(n0, M, N, BN, MMA)
                        gl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
            elif SWIGLU:
                _swiglu_out(acc, out_ptr, M, N, n0, BN)
            else:
                rows, x_rows, at, mask = _out_index(n0, M, N, BN, MMA)
                fold = (residual, norm_weight, sum_ptr, squares_out_ptr)
                if SPLIT_K:
                    splits = gl.num_programs(1)
                    gl.store(partial_ptr + split * M * N + at, acc, mask=mask)
                    _barrier()  # every thread's partial is written before the arrival counts
                    counter = counters_ptr + pid_n
                    if gl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
                        total = gl.zeros([BN, 8], gl.float32, MMA)
                        for s in range(0, splits):
                            # .cg reads from L2, where the other programs' partials are
                            total += gl.load(
                                partial_ptr + s * M * N + at,
                                mask=mask,
                                other=0.0,
                                cache_modifier=".cg",
                            )
                        if FOLD:
                            _fold_out(total, out_ptr, fold, at, mask, x_rows, pid_n)
                        else:
                            gl.store(out_ptr + at, total.to(gl.bfloat16), mask=mask)
                        gl.atomic_xchg(counter, 0, sem=COUNTER_RESET_SEM)
                elif FOLD:
                    _fold_out(acc, out_ptr, fold, at, mask, x_rows, pid_n)
                elif CONV:
                    _conv_out(acc, out_ptr, conv, conv_in, rows, at, mask)
                else:  # the result, or (split-K without counters) this split's partial
                    gl.store(
                        out_ptr + split * M * N + at, acc.to(out_ptr.dtype.element_ty), mask=mask
                    )


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


FORMATS = ("q4_g64_fp16", "q6_g64_fp16")


def runs(x: torch.Tensor) -> bool:
    """Whether this kernel runs for x's rows at all: 2..8 bf16 rows [M, K] on a Hopper or
    later GPU, with Gluon present."""
    if gluon is None or x.dtype != torch.bfloat16:
        return False
    if not (x.is_cuda and x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _hopper(index)


def takes_weight(weight: EncodedTensor) -> bool:
    """Whether this kernel can take the weight at all: q4_g64 or q6_g64, K a multiple of 512
    (TMA needs the scales' rows 16-byte aligned), with Gluon present."""
    return (
        gluon is not None and weight.format in FORMATS and weight.shape[-1] % (GROUP * GROUPS) == 0
    )


def fits_normed(x: torch.Tensor | NormedRows | HeadNormedRows, weight: EncodedTensor) -> bool:
    """`fits` for x or a folded norm's rows (`norm_fold`): for the GDN output norm's, heads of
    whole groups (so a group's factor is one head's) and at most MAX_HEADS of them."""
    if isinstance(x, HeadNormedRows):
        heads = x.squares.shape[1]
        return (
            x.head_dim % GROUP == 0
            and heads <= MAX_HEADS
            and x.squares.is_contiguous()
            and fits(x.weighted, weight)
        )
    if isinstance(x, NormedRows):
        return x.squares.is_contiguous() and fits(x.weighted, weight)
    return fits(x, weight)


def takes_norm_after(x: torch.Tensor | HeadNormedRows, weight: EncodedTensor) -> bool:
    """Whether `q4_linear` with `after` folds the norm into this product: as `fits_normed`,
    for a q4_g64 weight, and where K is split, with the split-K counters at hand (the last
    split to arrive runs the folded epilogue)."""
    from ninfer.kernels.groupwise_gemv_triton import tile_counters

    if weight.format != "q4_g64_fp16" or not fits_normed(x, weight):
        return False
    n, k = weight.shape
    device = x.device
    splits, _ = _splits(n, k, device)
    return (
        splits == 1 or tile_counters(device, triton.cdiv(n, _config(n, k, device)[0])) is not None
    )


def fits(x: torch.Tensor, weight: EncodedTensor) -> bool:
    """Whether `q4_linear` (`q6_linear`) takes this product: q4_g64 (q6_g64) weights, 2..8 bf16
    x rows on a Hopper or later GPU, K a multiple of 512 (TMA needs the scales' rows 16-byte
    aligned) and every plane and x aligned for TMA."""
    if not (takes_weight(weight) and runs(x)):
        return False
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    high = weight.planes.get("high", codes)
    k = weight.shape[-1]
    return (
        high.stride(-1) == 1
        and high.stride(0) % 16 == 0
        and high.data_ptr() % 16 == 0
        and x.shape[1] == k == codes.shape[-1] * 2
        and x.stride(-1) == 1
        and x.stride(0) % 8 == 0
        and codes.stride(-1) == 1
        and codes.stride(0) % 16 == 0
        and scales.stride(-1) == 1
        and scales.stride(0) % 8 == 0
        and all(t.data_ptr() % 16 == 0 for t in (x, codes, scales))
    )


def _config(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(rows per program, ring slots, programs per SM that K is split for): TUNED's for a
    listed product on the device, else the defaults."""
    name = device_name(device) if device.type == "cuda" else ""
    return TUNED.get(name, {}).get((n, k), (BLOCK_N, STAGES, PROGRAMS_PER_SM))


def swiglu_fits(x: torch.Tensor, weight: EncodedTensor) -> bool:
    """Whether `q4_swiglu_linear` takes this product: as `fits`, with an even number of rows
    (gate's over up's), where `q4_linear` would not split K either (so both forms run the same
    programs and give the same bits, but for the tail blocks `TAIL_SPLITS` splits; the 27B
    gate|up product has 544 row blocks)."""
    n, k = weight.shape
    return (
        weight.format == "q4_g64_fp16"
        and n % 2 == 0
        and fits(x, weight)
        and _splits(n, k, x.device)[0] == 1
    )


def weight_views(
    codes: torch.Tensor, scales: torch.Tensor, halves: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes as int32 words [K/64, N, 8] and the scales [N, K/64] that the TMA boxes read;
    with `halves`, the weight's two halves (gate's rows over up's) as one more dim: codes
    [K/64, 2, N/2, 8] and scales [2, N/2, K/64]. Views, no copy."""
    words = codes.view(torch.int32)
    n, k = codes.shape[0], codes.shape[1] * 2
    row, scale_row = words.stride(0), scales.stride(0)
    if not halves:
        return words.as_strided((k // GROUP, n, 8), (8, row, 1)), scales
    half = n // 2
    return (
        words.as_strided((k // GROUP, 2, half, 8), (8, half * row, row, 1)),
        scales.as_strided((2, half, k // GROUP), (half * scale_row, scale_row, 1)),
    )


def _descriptors(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_n: int,
    halves: bool,
    wide: bool = False,
):
    """TMA descriptors: x as [K/64, M, 64] (a tile: GROUPS groups of 8 rows, 128-byte swizzle),
    and the weight as `weight_views`: a box of block_n rows of GROUPS groups, with `halves`
    block_n/2 rows of each half, so a ring slot holds a group's gate rows then its up rows.
    Rows past M or N (N/2) read as zeros. With `wide` (`WIDE_CODES`) the codes are their
    words [N, K/8] and a box [block_n rows (block_n/2 with `halves`), 32 words], 128-byte
    swizzle: half a tile's columns. A gate box past N/2 then reads up's first rows, into
    outputs the kernel does not store."""
    m, k = x.shape
    x3 = x.as_strided((k // GROUP, m, GROUP), (GROUP, x.stride(0), 1))
    w, s = weight_views(codes, scales, halves)
    rows = [2, block_n // 2] if halves else [block_n]
    w_box, s_box = [GROUPS, *rows, 8], [*rows, GROUPS]
    w_swizzle = 0
    if wide:
        w, w_box, w_swizzle = codes.view(torch.int32), [rows[-1], GROUPS * 4], 128
    return (
        TensorDescriptor(
            x3,
            list(x3.shape),
            list(x3.stride()),
            [GROUPS, 8, GROUP],
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3),
        ),
        TensorDescriptor(
            w,
            list(w.shape),
            list(w.stride()),
            w_box,
            gl.NVMMASharedLayout(
                swizzle_byte_width=w_swizzle, element_bitwidth=32, rank=len(w_box)
            ),
        ),
        TensorDescriptor(
            s,
            list(s.shape),
            list(s.stride()),
            s_box,
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=len(s_box)),
        ),
    )


def _high_descriptor(high: torch.Tensor, block_n: int, wide: bool = False):
    """q6's high bits [N, K/4] bytes as int32 words [K/64, N, 4] (a group's four words per
    row), a box of GROUPS groups of block_n rows; with `wide` (`WIDE_CODES`) the words
    [N, K/16] and a box of block_n rows of a tile's 32 words, 128-byte swizzle."""
    words = high.view(torch.int32)
    if wide:
        return TensorDescriptor(
            words,
            list(words.shape),
            list(words.stride()),
            [block_n, GROUPS * 4],
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2),
        )
    n, k = high.shape[0], high.shape[1] * 4
    w = words.as_strided((k // GROUP, n, 4), (4, words.stride(0), 1))
    return TensorDescriptor(
        w,
        list(w.shape),
        list(w.stride()),
        [GROUPS, block_n, 4],
        gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3),
    )


def q4_linear(
    x: torch.Tensor | NormedRows | HeadNormedRows,
    weight: EncodedTensor,
    after: NormAfter | None = None,
) -> torch.Tensor | tuple[NormedRows, torch.Tensor]:
    """x [M, K] bf16 (M <= 8) times a q4_g64 weight [N, K] as `fits_normed` checked: [M, N]
    bf16. x may be a folded norm's rows (`NormedRows`: each row's factor applied in the
    epilogue; `HeadNormedRows`: each group's in the loop); with `after`, returns (the norm
    after the product as `NormedRows`, product + residual) (`norm_fold`)."""
    return _launch(x, weight, swiglu=False, after=after)


def q6_linear(x: torch.Tensor | NormedRows, weight: EncodedTensor) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8) times a q6_g64 weight [N, K] as `fits` checked: [M, N] bf16. The
    27B head read as stored, 0.99 GB a step instead of the 1.35 GB of its q8_g32 widening."""
    return _launch(x, weight, swiglu=False)


def q4_swiglu_linear(x: torch.Tensor | NormedRows, weight: EncodedTensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for a q4_g64 weight [2F, K] stacking gate's rows over
    up's, as `swiglu_fits` checked: [M, F] bf16, bit for bit `q4_linear` followed by
    `swiglu_triton.silu_mul` of its halves, in one launch. K is not split as `q4_linear`
    splits it; only the row blocks past a full wave are (`TAIL_SPLITS`), and the last share of
    such a block to arrive adds up the partials and runs the SwiGLU. Those blocks' outputs are
    then within the partials' rounding of the two launches, not their bits."""
    return _launch(x, weight, swiglu=True)


@dataclass(frozen=True, slots=True)
class GdnConv:
    """A GDN layer's causal conv run in its in projection's epilogue (`q4_linear_conv`): the
    taps [C, 4] of the first C outputs (q|k|v), the conv windows [slots, C, 3] and each x
    row's state slot [M] (one token a sequence)."""

    taps: torch.Tensor
    windows: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True, slots=True)
class GdnGates:
    """A GDN layer's gates computed from its input by programs of the in projection's grid
    (`q4_linear_conv`): the dense b|a weight [2H, K] (b's rows over a's), A_log and dt_bias
    [H]."""

    ba: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor


def takes_conv(
    x: torch.Tensor | NormedRows, weight: EncodedTensor, conv: GdnConv, gates: GdnGates | None
) -> bool:
    """Whether `q4_linear_conv` takes this GDN in projection: a q4_g64 weight `fits_normed`
    takes unsplit, x not the GDN output norm's rows, one state slot per x row, taps of
    width 4, windows of 3 bf16 entries with unit strides along them; gates (if any) from a
    bf16 b|a weight of x's width with unit stride along it."""
    if isinstance(x, HeadNormedRows) or weight.format != "q4_g64_fp16":
        return False
    if not fits_normed(x, weight):
        return False
    rows = x.weighted if isinstance(x, NormedRows) else x
    n, k = weight.shape
    taps, windows, slots = conv.taps, conv.windows, conv.slots
    channels = taps.shape[0]
    ok = (
        _splits(n, k, rows.device)[0] == 1
        and taps.dim() == 2
        and taps.shape[1] == 4
        and taps.stride(1) == 1
        and 0 < channels <= n
        and windows.dim() == 3
        and windows.shape[1:] == (channels, 3)
        and windows.stride(2) == 1
        and windows.dtype == torch.bfloat16
        and slots.dim() == 1
        and slots.shape[0] == rows.shape[0]
        and all(t.device == rows.device for t in (taps, windows, slots))
    )
    if not ok or gates is None:
        return ok
    ba = gates.ba
    return (
        ba.dim() == 2
        and ba.shape[1] == k
        and ba.shape[0] % 2 == 0
        and ba.stride(1) == 1
        and ba.dtype == rows.dtype
        and ba.device == rows.device
        and gates.A_log.shape == gates.dt_bias.shape == (ba.shape[0] // 2,)
    )


def q4_linear_conv(
    x: torch.Tensor | NormedRows,
    weight: EncodedTensor,
    conv: GdnConv,
    gates: GdnGates | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """A GDN in projection at a decode step of 2..8 sequences, as `takes_conv` checked:
    (out [M, N] bf16 with silu(conv) in its first C columns and the product in the rest,
    (g fp32, beta) [M, H] or None). The conv as `causal_conv1d_triton.causal_conv1d` after
    `q4_linear` gives it, bit for bit, the windows updated; the gates as
    `gdn_gates_triton.gdn_gates_from_x` gives them up to the order of its fp32 sums. The
    conv's launch (and the gates') go: one kernel between the norm and the recurrent one."""
    return _launch(x, weight, swiglu=False, conv=conv, gates=gates)


def _splits(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(splits of K, tiles per split) for the [N, K] product: enough programs for the listed
    programs per SM, each split a whole number of tiles."""
    block_n, _, per_sm = _config(n, k, device)
    num_tiles = k // (GROUP * GROUPS)
    blocks = triton.cdiv(n, block_n)
    splits = max(1, min(num_tiles, round(per_sm * num_sms(device) / blocks)))
    per_split = triton.cdiv(num_tiles, splits)
    return triton.cdiv(num_tiles, per_split), per_split


def shared_bytes(block_n: int, stages: int) -> int:
    """The q4 product's shared memory a program at (block_n, stages): each ring slot's x tile,
    code words and scales, and its mbarrier. The compiled kernel's (51,216 bytes at 64 rows and
    two slots, 76,824 at three; the SwiGLU epilogue's tile reuses the ring's)."""
    slot = GROUPS * 8 * GROUP * 2 + block_n * GROUPS * 8 * 4 + block_n * GROUPS * 2
    return stages * (slot + 8)


def resident_programs(block_n: int, stages: int, device: torch.device) -> int:
    """How many programs of the product at (block_n, stages) the device's SMs hold at once, by
    their shared memory (`triton_support.programs_per_sm`)."""
    return programs_per_sm(shared_bytes(block_n, stages), 0, 4)[0] * num_sms(device)


def _tail(blocks: int, num_tiles: int, block_n: int, stages: int, device: torch.device):
    """(full blocks, tail blocks, splits of a tail block, tiles a split): the row blocks past
    what the SMs hold at once split TAIL_SPLITS ways, where they are a short second wave and
    the counters are there; else every block whole."""
    from ninfer.kernels.groupwise_gemv_triton import tile_counters

    resident = resident_programs(block_n, stages, device)
    extra = blocks - resident
    splits = min(TAIL_SPLITS, num_tiles)
    if splits < 2 or extra <= 0 or extra * splits > resident:
        return blocks, 0, 1, num_tiles
    if tile_counters(device, extra) is None:
        return blocks, 0, 1, num_tiles
    per_split = triton.cdiv(num_tiles, splits)
    return resident, extra, triton.cdiv(num_tiles, per_split), per_split


def _launch(
    x: torch.Tensor | NormedRows | HeadNormedRows,
    weight: EncodedTensor,
    swiglu: bool,
    after: NormAfter | None = None,
    conv: GdnConv | None = None,
    gates: GdnGates | None = None,
):
    from ninfer.kernels.groupwise_gemv_triton import tile_counters

    normed = x if isinstance(x, NormedRows) else None
    head_normed = x if isinstance(x, HeadNormedRows) else None
    if normed is not None or head_normed is not None:
        x = x.weighted
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    m, k = x.shape
    n = weight.shape[0]
    num_tiles = k // (GROUP * GROUPS)
    block_n, stages, _ = _config(n, k, x.device)
    out_n = n // 2 if swiglu else n
    blocks = triton.cdiv(n, block_n)
    splits, per_split = (1, num_tiles) if swiglu else _splits(n, k, x.device)
    out = torch.empty(m, out_n, dtype=x.dtype, device=x.device)
    counters = tile_counters(x.device, blocks) if splits > 1 else None
    partial = out
    if splits > 1:
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    q6 = weight.format == "q6_g64_fp16"
    full, tail_blocks, tail_splits, tail_per_split = blocks, 0, 1, num_tiles
    if splits == 1 and not q6 and after is None and conv is None and gates is None:
        full, tail_blocks, tail_splits, tail_per_split = _tail(
            blocks, num_tiles, block_n, stages, x.device
        )
    if tail_blocks:
        counters = tile_counters(x.device, tail_blocks)
        partial = torch.empty(
            tail_blocks * tail_splits * block_n * 8, dtype=torch.float32, device=x.device
        )
    # a folded norm on either side (`norm_fold`); unused pointers are `out`
    residual = norm_weight = total = squares = squares_in = out
    eps, square_blocks = 0.0, 1
    if after is not None:
        if splits > 1 and counters is None:
            raise RuntimeError("a folded norm needs the split-K counters (`takes_norm_after`)")
        residual, norm_weight = after.residual, after.weight
        total = torch.empty_like(out)
        squares = torch.empty(blocks, SQUARE_COLUMNS, dtype=torch.float32, device=x.device)
    if normed is not None:
        squares_in, eps, square_blocks = normed.squares, normed.eps, normed.squares.shape[0]
    head_squares, heads, head_blocks, head_eps, head_dim = out, 1, 1, 0.0, 0
    if head_normed is not None:
        head_squares, head_dim = head_normed.squares, head_normed.head_dim
        heads, head_blocks = head_squares.shape[1], head_squares.shape[2]
        head_eps = head_normed.eps
    # a GDN in projection's conv and gates (`q4_linear_conv`); unused pointers are `out`
    conv_args = (out, out, out, 0, 0, 0, 0)
    if conv is not None:
        if splits > 1:
            raise RuntimeError("the conv runs only in an unsplit product (`takes_conv`)")
        conv_args = (
            conv.taps,
            conv.windows,
            conv.slots,
            conv.taps.shape[0],
            conv.taps.stride(0),
            conv.windows.stride(0),
            conv.windows.stride(1),
        )
    gate_args = (x, x.stride(0), out, 0, 0, out, out, out, out)
    gate_programs, gate_outputs = 0, None
    gate_tokens, gate_shares = max(1, MAX_ROWS // GATE_TOKEN_SHARES), 1
    if gates is not None:
        heads = gates.ba.shape[0] // 2
        g = torch.empty(m, heads, dtype=torch.float32, device=x.device)
        beta = torch.empty(m, heads, dtype=x.dtype, device=x.device)
        gate_args = (x, x.stride(0), gates.ba, gates.ba.stride(0), heads)
        gate_args += (gates.A_log, gates.dt_bias, g, beta)
        # each program a b|a row for gate_tokens of the step's tokens
        gate_shares = triton.cdiv(m, gate_tokens)
        gate_programs, gate_outputs = 2 * heads * gate_shares, (g, beta)
    ws = WARP_SPECIALIZED and not (
        q6 or (after and not WS_NORM_AFTER) or conv or gates or head_normed is not None
    )
    x_desc, w_desc, s_desc = _descriptors(x, codes, scales, block_n, swiglu, WIDE_CODES)
    _q4_tc_kernel[(full + tail_blocks * tail_splits + gate_programs, splits)](
        x_desc,
        w_desc,
        s_desc,
        _high_descriptor(weight.planes["high"], block_n, WIDE_CODES) if q6 else w_desc,
        partial if splits > 1 and counters is None else out,
        partial,
        counters if counters is not None else out,
        m,
        out_n,
        per_split,
        num_tiles,
        residual,
        norm_weight,
        total,
        squares,
        squares_in,
        square_blocks,
        1.0 / k,
        eps,
        head_squares,
        heads,
        head_blocks,
        head_eps,
        *conv_args,
        *gate_args,
        BN=block_n,
        GROUPS=GROUPS,
        STAGES=stages,
        SPLIT_K=splits > 1 and counters is not None,
        WEIGHTS_FIRST=WEIGHTS_BEFORE_WAIT,
        SWIGLU=swiglu,
        Q6=q6,
        FOLD=after is not None,
        ROW_SCALE=normed is not None,
        SQUARE_BLOCKS=max(16, triton.next_power_of_2(square_blocks)),
        HEAD_DIM=head_dim,
        HEADS=max(32, triton.next_power_of_2(heads)),
        HEAD_BLOCKS=triton.next_power_of_2(head_blocks),
        CONV=conv is not None,
        GATES=gates is not None,
        GATE_CHUNKS=triton.next_power_of_2(triton.cdiv(k, 1024)),
        full_blocks=full,
        tail_splits=tail_splits,
        tail_per_split=tail_per_split,
        TAIL=tail_blocks > 0,
        gate_shares=gate_shares,
        GATE_TOKENS=gate_tokens,
        WS=ws,
        PRODUCER_REGS=PRODUCER_REGISTERS,
        num_warps=4,
        **pdl_options(x.device),
        **({"maxnreg": WS_MAX_REGISTERS} if ws else {}),
    )
    if splits > 1 and counters is None:
        return partial.sum(dim=0).to(x.dtype)
    if after is not None:
        return NormedRows(out, squares, after.eps), total
    if conv is not None:
        return out, gate_outputs
    return out

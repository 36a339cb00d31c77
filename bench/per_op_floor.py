"""The floor of a one-kernel-per-operation decode step on this GPU: the C=1 step of a bench
shape replayed as a CUDA graph of kernels that only read, in the step's order, the bytes each
of its kernels must move, and as many trivial dependent kernels as the step has besides
(docs/performance.md, "The floor of one kernel per operation"). GPU only.

    python bench/per_op_floor.py [--shape qwen3_5-27b] [--weights q4]
    python bench/per_op_floor.py --pattern
    python bench/per_op_floor.py --tma

`--pattern` asks where the 27B one-row q4 products lose to their read floor: each product
timed as shipped (x split beforehand, so one kernel); as a plain copy of its loop with x's two
int8 levels, and with the coarse one alone; its loads alone in the shipped tiles (the
weight's codes and scales; then also x's four code arrays and steps), xored instead of
multiplied; the same loads, and the loop, with each tile's steps stored whole one after
another (a layout made for the tile: only the addresses change); the weight's loads alone at
other tiles, and the loop in the best of them; and the read floor of the same bytes.

`--tma` times, for the same products, the plain loop and the weight's loads alone as above
against the same with the codes and scales read through the tensor memory accelerator (bulk
copies into shared memory that the loop's pipeliner issues ahead under mbarriers, no address
arithmetic a thread), in the shipped tile and five others; it first checks that the TMA loop
gives the plain loop's output bit for bit.

Steps:
1. The shape's C=1 decode step is profiled (`ninfer bench --profile`, 16 steps, graphs off)
   for the number of kernels a step launches.
2. The step's reads come from the speed-of-light model (`ninfer.bench.traffic`), one read
   kernel per launch that moves weights or state: a GDN layer's q|k|v|z product, its
   recurrent kernel (the state read and written, the b|a rows), its out product; an attention
   layer's q|gate|k|v product, its K/V read, its o product; an MLP's gate|up and down
   products, or a MoE block's router, experts' gate|up and experts' down (the routed experts
   plus the shared one); the head.
3. The read kernel: a program reads its contiguous share in blocks of 16 bytes a thread, its
   first block before the PDL wait and the rest after it, as a product's program reads its
   codes, and stores one word. Each distinct size takes the fastest of a sweep of warps, block
   and programs per SM, timed alone with its bytes rotated beyond the L2.
4. Every other launch of the step (norms, SwiGLU, conv, attention's split and merge, rotary,
   embedding, argmax, ...) is one trivial dependent kernel: it waits for the kernel before it
   and copies a 5120-value row (docs/performance.md, Measurement 21: 0.7-0.8 us a launch).
5. The chain is timed as one CUDA graph (median replay) with every kernel under PDL.

What it prints: each read size alone (best setting, us, share of copy); then the chain's
time, the step bytes over it as a share of the copy rate measured in the same run, and the
step time the target's share would need.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from decode_variants import _chain_kernel  # this folder: the scripts run as `python bench/...`
from triton.testing import do_bench_cudagraph

from ninfer.bench.cases import make_cases
from ninfer.bench.ceilings import copy_bandwidth
from ninfer.bench.profile import category
from ninfer.bench.run import BenchOptions, run_bench
from ninfer.bench.shapes import SHAPES
from ninfer.bench.traffic import Traffic, expected_distinct_experts, profile_formats
from ninfer.kernels import groupwise_gemv_triton
from ninfer.kernels.pdl_triton import await_inputs, pdl_options
from ninfer.kernels.triton_support import num_sms
from ninfer.kernels.x_split import SplitRequest, attach
from ninfer.quant import get_format

DEVICE = "cuda"
CONTEXT = 128  # tokens cached before the step, as a short `tg` case
ROTATE_BYTES = 512 << 20  # a size's copies together, so that a timed read misses the L2
# The sweep: warps, 16-byte loads a thread per block, programs per SM.
WARPS, LOADS, PROGRAMS_PER_SM = (4, 8), (1, 2, 4), (1, 2, 4, 8)
TRIVIAL_ROW = 5120
TRIVIAL_PROGRAMS = 40


@triton.jit
def _read_kernel(words_ptr, out_ptr, steps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p reads words [p * steps * BLOCK, (p + 1) * steps * BLOCK): the first block
    before the wait (nothing writes them), the rest after; stores their xor."""
    base = tl.program_id(0).to(tl.int64) * steps * BLOCK
    offsets = tl.arange(0, BLOCK)
    acc = tl.load(words_ptr + base + offsets)
    await_inputs(PDL)
    for step in tl.range(1, steps):
        acc ^= tl.load(words_ptr + base + step * BLOCK + offsets)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


@triton.jit
def _x_words(x_ptr, num_words, cols):
    """The xor of x's four code arrays (coarse and fine, even and odd values) at `cols`."""
    x = tl.load(x_ptr + cols)
    x ^= tl.load(x_ptr + num_words + cols)
    x ^= tl.load(x_ptr + 2 * num_words + cols)
    return x ^ tl.load(x_ptr + 3 * num_words + cols)


@triton.jit
def _tile_rows(words_ptr, scales_ptr, num_words, num_groups, BLOCKED, BLOCK_N, BLOCK_WORDS):
    """(code rows, scale rows, words and groups between a row's steps) of program p's tile: row
    after row of the planes as stored, or, BLOCKED, the tile's steps each stored whole, one
    after another ([row blocks, steps, BLOCK_N, BLOCK_WORDS] codes and [..., groups] scales):
    what a layout made for this tile would read. Only the addresses differ, so a BLOCKED
    kernel times the layout and computes nothing meaningful."""
    per_group: tl.constexpr = 8  # q4_g64: eight code words a group
    step_groups: tl.constexpr = BLOCK_WORDS // per_group
    p = tl.program_id(0).to(tl.int64)
    if BLOCKED:
        tiles = p * (num_words // BLOCK_WORDS)
        local = tl.arange(0, BLOCK_N)[:, None]
        word_rows = words_ptr + tiles * (BLOCK_N * BLOCK_WORDS) + local * BLOCK_WORDS
        scale_rows = scales_ptr + tiles * (BLOCK_N * step_groups) + local * step_groups
        return word_rows, scale_rows, BLOCK_N * BLOCK_WORDS, BLOCK_N * step_groups
    rows = p * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    return words_ptr + rows * num_words, scales_ptr + rows * num_groups, BLOCK_WORDS, step_groups


@triton.jit
def _pattern_kernel(
    words_ptr,
    scales_ptr,
    x_ptr,
    xscale_ptr,
    out_ptr,
    num_words,
    num_groups,
    WITH_X: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    BLOCKED: tl.constexpr = False,
):
    """The one-row integer GEMV's loads without its arithmetic: program p reads rows
    [p * BLOCK_N, (p + 1) * BLOCK_N) of the codes, BLOCK_WORDS words a row a step, with their
    scales (and, WITH_X, x's coarse and fine words of the even and odd values and its steps),
    the first step's codes and scales before the wait, and stores for each row the xor of
    what it read (BLOCKED: `_tile_rows`)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    word_rows, scale_rows, word_step, group_step = _tile_rows(
        words_ptr, scales_ptr, num_words, num_groups, BLOCKED, BLOCK_N, BLOCK_WORDS
    )
    per_group: tl.constexpr = 8  # q4_g64: eight code words a group
    cols = tl.arange(0, BLOCK_WORDS)
    groups = tl.arange(0, BLOCK_WORDS // per_group)
    acc = tl.load(word_rows + cols[None, :])
    acc_s = tl.load(scale_rows + groups[None, :]).to(tl.int16, bitcast=True).to(tl.int32)
    await_inputs(PDL)
    if WITH_X:  # x is the kernel before's output: its first step is read after the wait
        acc ^= _x_words(x_ptr, num_words, cols)[None, :]
        acc_s ^= tl.load(xscale_ptr + groups).to(tl.int32, bitcast=True)[None, :]
    for start in tl.range(BLOCK_WORDS, num_words, BLOCK_WORDS, num_stages=STAGES):
        step = start // BLOCK_WORDS
        acc ^= tl.load(word_rows + step * word_step + cols[None, :])
        s = tl.load(scale_rows + step * group_step + groups[None, :])
        acc_s ^= s.to(tl.int16, bitcast=True).to(tl.int32)
        if WITH_X:
            acc ^= _x_words(x_ptr, num_words, start + cols)[None, :]
            g = start // per_group + groups
            acc_s ^= tl.load(xscale_ptr + g).to(tl.int32, bitcast=True)[None, :]
    total = tl.xor_sum(acc, 1) ^ tl.xor_sum(acc_s, 1)
    tl.store(out_ptr + rows, total)


@triton.jit
def _levels_kernel(
    words_ptr,
    scales_ptr,
    x_ptr,
    xscale_ptr,
    out_ptr,
    num_words,
    num_groups,
    LEVELS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr = True,
    BLOCKED: tl.constexpr = False,
):
    """The one-row q4 product's loop in its plainest form, with x's two int8 levels (coarse
    and fine, as shipped) or the coarse level alone: what the second level's loads and dp4a
    cost. Timing only; one level is not the shipped arithmetic (BLOCKED: `_tile_rows`)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    word_rows, scale_rows, word_step, group_step = _tile_rows(
        words_ptr, scales_ptr, num_words, num_groups, BLOCKED, BLOCK_N, BLOCK_WORDS
    )
    per_group: tl.constexpr = 8
    acc = tl.zeros([BLOCK_N, BLOCK_WORDS // per_group], tl.float32)
    await_inputs(PDL)
    for start in tl.range(0, num_words, BLOCK_WORDS, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_WORDS)
        groups = start // per_group + tl.arange(0, BLOCK_WORDS // per_group)
        step = start // BLOCK_WORDS
        w = tl.load(word_rows + step * word_step + tl.arange(0, BLOCK_WORDS)[None, :])
        local_groups = tl.arange(0, BLOCK_WORDS // per_group)[None, :]
        w_scale = tl.load(scale_rows + step * group_step + local_groups).to(tl.float32)
        low, high = groupwise_gemv_triton._signed_nibbles(w)
        even = tl.load(x_ptr + cols)[None, :]
        odd = tl.load(x_ptr + num_words + cols)[None, :]
        sums = groupwise_gemv_triton._quad_chain(low, high, even, odd, True, True, ASM)
        if LEVELS == 2:
            even = tl.load(x_ptr + 2 * num_words + cols)[None, :]
            odd = tl.load(x_ptr + 3 * num_words + cols)[None, :]
            fine = groupwise_gemv_triton._quad_chain(low, high, even, odd, True, True, ASM)
            sums = sums * 254 + fine
        group_sums = tl.sum(tl.reshape(sums, [BLOCK_N, BLOCK_WORDS // per_group, 2]), axis=2)
        x_scale = tl.load(xscale_ptr + groups)
        acc += group_sums.to(tl.float32) * (x_scale[None, :] * w_scale)
    total = tl.sum(acc, axis=1) * 0.0625
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty))


@triton.jit
def _tma_kernel(
    words_desc,
    scales_desc,
    x_ptr,
    xscale_ptr,
    out_ptr,
    num_words,
    LOADS_ONLY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr = True,
):
    """`_levels_kernel`'s loop (two levels), or with LOADS_ONLY its weight loads xored as in
    `_pattern_kernel`, with the codes and scales read through the tensor memory accelerator
    (host tensor descriptors of [BLOCK_N, BLOCK_WORDS] codes and [BLOCK_N, groups] scales,
    which the loop's pipeliner turns into bulk copies into shared memory under mbarriers), in
    place of a load of 16 bytes a thread. Timing only."""
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    per_group: tl.constexpr = 8
    step_groups: tl.constexpr = BLOCK_WORDS // per_group
    acc = tl.zeros([BLOCK_N, step_groups], tl.float32)
    bits = tl.zeros([BLOCK_N, BLOCK_WORDS], tl.int32)
    bits_s = tl.zeros([BLOCK_N, step_groups], tl.int32)
    await_inputs(PDL)
    for start in tl.range(0, num_words, BLOCK_WORDS, num_stages=STAGES):
        w = words_desc.load([row0, start])
        scale = scales_desc.load([row0, start // per_group])
        if LOADS_ONLY:
            bits ^= w
            bits_s ^= scale.to(tl.int16, bitcast=True).to(tl.int32)
        else:
            cols = start + tl.arange(0, BLOCK_WORDS)
            groups = start // per_group + tl.arange(0, step_groups)
            low, high = groupwise_gemv_triton._signed_nibbles(w)
            even = tl.load(x_ptr + cols)[None, :]
            odd = tl.load(x_ptr + num_words + cols)[None, :]
            sums = groupwise_gemv_triton._quad_chain(low, high, even, odd, True, True, ASM)
            even = tl.load(x_ptr + 2 * num_words + cols)[None, :]
            odd = tl.load(x_ptr + 3 * num_words + cols)[None, :]
            fine = groupwise_gemv_triton._quad_chain(low, high, even, odd, True, True, ASM)
            sums = sums * 254 + fine
            group_sums = tl.sum(tl.reshape(sums, [BLOCK_N, step_groups, 2]), axis=2)
            x_scale = tl.load(xscale_ptr + groups)
            acc += group_sums.to(tl.float32) * (x_scale[None, :] * scale.to(tl.float32))
    if LOADS_ONLY:
        tl.store(out_ptr + rows, tl.xor_sum(bits, 1) ^ tl.xor_sum(bits_s, 1))
    else:
        total = tl.sum(acc, axis=1) * 0.0625
        tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty))


# The 27B one-row q4 products: (name, rows, K).
PATTERN_PRODUCTS = (
    ("gdn q|k|v|z", 16384, 5120),
    ("attention q|gate|k|v", 14336, 5120),
    ("out", 5120, 6144),
    ("mlp gate|up", 34816, 5120),
    ("mlp down", 5120, 17408),
)
# Weight-only tiles tried besides the shipped one: (rows, words a row a step, warps).
PATTERN_TILES = tuple(
    (rows, words, warps)
    for rows in (4, 8, 16, 32, 64)
    for words in (64, 128, 256)
    for warps in (2, 4, 8)
    if rows * words <= 8192
)


# Tiles the TMA forms try besides the shipped one: (rows, words a row a step, warps).
TMA_TILES = ((16, 128, 4), (32, 128, 4), (32, 128, 8), (64, 64, 4), (64, 128, 8))


def gemv_pattern(sms: int, options, copy: float, tma: bool = False) -> None:
    """Each 27B product as shipped, its loads alone in the shipped tiles, the weight's loads
    at other tiles, and the read floor of its bytes; with `tma`, instead, its plain loop and
    its weight loads as shipped against the same read through the tensor memory
    accelerator (`_tma_kernel`), in the shipped tile and in TMA_TILES."""
    print(f"{'product':22} {'form':30} {'rows':>4} {'words':>5} {'warps':>5} {'us':>7} {'copy':>6}")
    for name, n, k in PATTERN_PRODUCTS:
        _pattern_product(name, n, k, sms, options, copy, tma)
        torch.cuda.empty_cache()


def _pattern_product(
    name: str, n: int, k: int, sms: int, options, copy: float, tma: bool = False
) -> None:
    q4 = get_format("q4_g64_fp16")
    nbytes = q4.encoded_nbytes((n, k))
    sets = max(2, math.ceil(ROTATE_BYTES / nbytes))
    weights = [q4.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(sets)]
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    split = groupwise_gemv_triton.split_x(x, 4, 64, k)
    attach(x, SplitRequest(4, 64, 1), split)
    num_words, num_groups = k // 8, k // 64
    stages = groupwise_gemv_triton._int_stages(n, num_words, 1, x.device)  # as shipped
    out = torch.empty(n, dtype=torch.int32, device=DEVICE)

    def report(form, rows, words, warps, us):
        share = nbytes / (us * 1e-6) / copy
        print(f"{name:22} {form:30} {rows:4d} {words:5d} {warps:5d} {us:7.2f} {share:6.1%}")

    result = torch.empty(n, dtype=torch.bfloat16, device=DEVICE)

    def run_tile(kernel, into, rows, words, warps, **flags):
        """One of this script's kernels over the rotated weights, in a tile, timed."""
        state = {"i": 0}

        def run():
            w = weights[state["i"] % sets]
            state["i"] += 1
            kernel[(triton.cdiv(n, rows),)](
                w.planes["codes"].view(torch.int32),
                w.planes["scales"],
                split[0],
                split[2],
                into,
                num_words,
                num_groups,
                BLOCK_N=rows,
                BLOCK_WORDS=words,
                STAGES=stages,
                num_warps=warps,
                **flags,
                **options,
            )

        return median_us(run)

    def levels(rows, words, warps, levels, blocked=False):
        return run_tile(_levels_kernel, result, rows, words, warps, LEVELS=levels, BLOCKED=blocked)

    def pattern(rows, words, warps, with_x, blocked=False):
        return run_tile(_pattern_kernel, out, rows, words, warps, WITH_X=with_x, BLOCKED=blocked)

    state = {"i": 0}

    def shipped():
        groupwise_gemv_triton.integer_linear(x, weights[state["i"] % sets])
        state["i"] += 1

    rows, words, warps = groupwise_gemv_triton._int_config(n, num_words, 1, x.device)
    report("shipped GEMV", rows, words, warps, median_us(shipped))
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def through_tma(rows, words, warps, loads_only):
            descs = [
                (
                    TensorDescriptor.from_tensor(
                        w.planes["codes"].view(torch.int32), [rows, words]
                    ),
                    TensorDescriptor.from_tensor(w.planes["scales"], [rows, words // 8]),
                )
                for w in weights
            ]
            state = {"i": 0}

            def run():
                codes, scales = descs[state["i"] % sets]
                state["i"] += 1
                _tma_kernel[(triton.cdiv(n, rows),)](
                    codes, scales, split[0], split[2], out if loads_only else result,
                    num_words, LOADS_ONLY=loads_only, BLOCK_N=rows, BLOCK_WORDS=words,
                    STAGES=stages, num_warps=warps, **options,
                )  # fmt: skip

            return median_us(run)

        # the TMA loop computes what the plain loop does (same weight, the shipped tile)
        plain = torch.empty_like(result)
        codes, scales = weights[0].planes["codes"].view(torch.int32), weights[0].planes["scales"]
        grid = (triton.cdiv(n, rows),)
        _levels_kernel[grid](
            codes, scales, split[0], split[2], plain, num_words, num_groups, LEVELS=2,
            BLOCK_N=rows, BLOCK_WORDS=words, STAGES=stages, num_warps=warps, **options,
        )  # fmt: skip
        _tma_kernel[grid](
            TensorDescriptor.from_tensor(codes, [rows, words]),
            TensorDescriptor.from_tensor(scales, [rows, words // 8]),
            split[0], split[2], result, num_words, LOADS_ONLY=False, BLOCK_N=rows,
            BLOCK_WORDS=words, STAGES=stages, num_warps=warps, **options,
        )  # fmt: skip
        if not torch.equal(plain, result):
            raise SystemExit(f"{name}: the TMA loop's output differs from the plain loop's")
        for tile in ((rows, words, warps), *TMA_TILES):
            if num_words % tile[1] or n % tile[0]:
                continue
            report("product, two levels (plain)", *tile, levels(*tile, 2))
            report("product, two levels, TMA", *tile, through_tma(*tile, False))
            report("loads: codes, scales", *tile, pattern(*tile, False))
            report("loads: codes, scales, TMA", *tile, through_tma(*tile, True))
        return
    report("product, two levels (plain)", rows, words, warps, levels(rows, words, warps, 2))
    report("product, one level (plain)", rows, words, warps, levels(rows, words, warps, 1))
    report("loads: codes, scales", rows, words, warps, pattern(rows, words, warps, False))
    report("loads: codes, scales, x", rows, words, warps, pattern(rows, words, warps, True))
    tile = (rows, words, warps)
    report("loads: codes, scales, blocked", *tile, pattern(*tile, False, blocked=True))
    report("loads: codes, scales, x, blocked", *tile, pattern(*tile, True, blocked=True))
    report("product, two levels, blocked", *tile, levels(*tile, 2, blocked=True))
    timed = sorted(
        (pattern(*tile, False), tile)
        for tile in PATTERN_TILES
        if num_words % tile[1] == 0 and n % tile[0] == 0
    )
    for us, tile in timed[:3]:
        report("loads: codes, scales (best)", *tile, us)
    for tile in (timed[0][1], (rows, words, 2 * warps)):
        report("product, two levels (plain)", *tile, levels(*tile, 2))
        report("product, one level (plain)", *tile, levels(*tile, 1))
        report("product, two levels, blocked", *tile, levels(*tile, 2, blocked=True))
    setting, us = best_read(nbytes, sms, options)
    report("read floor", 0, setting.block, setting.warps, us)


@dataclass(frozen=True, slots=True)
class ReadSetting:
    warps: int
    block: int  # int32 words a program reads a step
    steps: int
    programs: int

    def words(self) -> int:
        return self.block * self.steps * self.programs


def settings_for(nbytes: int, sms: int) -> list[ReadSetting]:
    words = math.ceil(nbytes / 4)
    out = []
    for warps in WARPS:
        for loads in LOADS:
            block = warps * 32 * 4 * loads
            for per_sm in PROGRAMS_PER_SM:
                steps = max(1, math.ceil(words / (block * sms * per_sm)))
                programs = math.ceil(words / (block * steps))
                out.append(ReadSetting(warps, block, steps, programs))
    return out


def launch_read(words: torch.Tensor, out: torch.Tensor, setting: ReadSetting, options) -> None:
    _read_kernel[(setting.programs,)](
        words, out, setting.steps, BLOCK=setting.block, num_warps=setting.warps, **options
    )


def median_us(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def best_read(nbytes: int, sms: int, options) -> tuple[ReadSetting, float]:
    """The fastest setting of the read kernel for `nbytes`, timed alone over copies whose sum
    exceeds the L2."""
    candidates = settings_for(nbytes, sms)
    span = max(s.words() for s in candidates)
    copies = max(2, math.ceil(ROTATE_BYTES / (4 * span)))
    buffer = torch.zeros(copies * span, dtype=torch.int32, device=DEVICE)
    out = torch.empty(max(s.programs for s in candidates), dtype=torch.int32, device=DEVICE)
    best = None
    for setting in candidates:
        views = [buffer[i * span : i * span + setting.words()] for i in range(copies)]
        state = {"i": 0}

        def run(setting=setting, views=views, state=state):
            launch_read(views[state["i"] % copies], out, setting, options)
            state["i"] += 1

        us = median_us(run)
        if best is None or us < best[1]:
            best = (setting, us)
    del buffer
    return best


def step_reads(traffic: Traffic) -> list[tuple[str, int]]:
    """(label, bytes) of each launch of a C=1 step that moves weights or state, in order."""
    c = traffic.config
    by_name = {w.name: w for w in traffic.weights}

    def size(*names: str) -> int:
        return sum(by_name[n].nbytes for n in names if n in by_name)

    routed = expected_distinct_experts(c.num_experts, c.num_experts_per_tok, 1)
    state = traffic.state_bytes_per_sequence() // max(1, traffic.num_gdn_layers)
    conv = traffic.conv_bytes_per_sequence() // max(1, traffic.num_gdn_layers)
    kv_token = traffic.kv_bytes_per_token() // max(1, traffic.num_attention_layers)
    reads: list[tuple[str, int]] = []
    for i, kind in enumerate(c.layer_types):
        p = f"text/layers.{i}."
        if kind == "linear_attention":
            a = p + "linear_attn."
            reads.append(("gdn q|k|v|z", size(a + "in_proj_qkv.weight", a + "in_proj_z.weight")))
            rule = 2 * state + 2 * conv + size(a + "in_proj_b.weight", a + "in_proj_a.weight")
            reads.append(("gdn recurrent", rule))
            reads.append(("out", size(a + "out_proj.weight")))
        else:
            a = p + "self_attn."
            qkv = size(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
            reads.append(("attention q|gate|k|v", qkv))
            reads.append(("attention K/V", (CONTEXT + 2) * kv_token))
            reads.append(("out", size(a + "o_proj.weight")))
        m = p + "mlp."
        if c.num_experts:
            e = m + "experts."
            s = m + "shared_expert."
            reads.append(("moe router", size(m + "gate.weight", m + "shared_expert_gate.weight")))
            gate_up = by_name[e + "gate_up_proj"].nbytes * routed / c.num_experts
            reads.append(
                (
                    "experts gate|up",
                    int(gate_up) + size(s + "gate_proj.weight", s + "up_proj.weight"),
                )
            )
            down = by_name[e + "down_proj"].nbytes * routed / c.num_experts
            reads.append(("experts down", int(down) + size(s + "down_proj.weight")))
        else:
            reads.append(("mlp gate|up", size(m + "gate_proj.weight", m + "up_proj.weight")))
            reads.append(("mlp down", size(m + "down_proj.weight")))
    head = "text/embed_tokens.weight" if c.tie_word_embeddings else "text/lm_head.weight"
    reads.append(("head", by_name[head].nbytes))
    return reads


def step_launches(shape: str, weights: str) -> tuple[float, float]:
    """(kernels, integer GEMV kernels) per C=1 decode step of ninfer on `shape`, profiled."""
    options = BenchOptions(
        cases=make_cases([], [16], [], [1]),
        shape=shape,
        weights=weights,
        repetitions=1,
        profile=True,
    )
    report = run_bench(options)
    row = report["rows"][0]
    steps = row["profile_decode_steps"]
    total = sum(k["calls"] for k in row["profile"]) / steps
    gemv = sum(k["calls"] for k in row["profile"] if category(k["name"]) == "gemv") / steps
    for kernel in row["profile"]:
        print(f"  {kernel['calls'] / steps:6.1f} a step  {kernel['name'][:80]}")
    torch.cuda.empty_cache()
    return total, gemv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3_5-27b", choices=sorted(SHAPES))
    parser.add_argument("--weights", default="q4")
    parser.add_argument("--target", type=float, default=0.8, help="share of copy (0.8)")
    parser.add_argument(
        "--pattern", action="store_true", help="the 27B one-row q4 products against their floor"
    )
    parser.add_argument(
        "--tma",
        action="store_true",
        help="the 27B one-row q4 products' loop and loads through the tensor memory accelerator",
    )
    args = parser.parse_args()
    device = torch.device(DEVICE)
    options = pdl_options(device)
    sms = num_sms(device)
    copy = copy_bandwidth(DEVICE)
    if args.pattern or args.tma:
        gemv_pattern(sms, options, copy, args.tma)
        return

    total, gemv = step_launches(args.shape, args.weights)
    config = SHAPES[args.shape]
    traffic = Traffic(config, profile_formats(config, args.weights))
    step_bytes = traffic.decode_bytes([CONTEXT]).total
    reads = step_reads(traffic)
    trivial = max(0, round(total) - len(reads))
    print(
        f"{args.shape} {args.weights} C=1: {total:.1f} kernels a step ({gemv:.1f} integer "
        f"GEMV); {len(reads)} reads, {trivial} trivial kernels; step bytes "
        f"{step_bytes / 1e9:.3f} GB, read {sum(b for _, b in reads) / 1e9:.3f} GB; "
        f"copy {copy / 1e9:.1f} GB/s; {options}"
    )

    best: dict[int, tuple[ReadSetting, float]] = {}
    labels: dict[int, set[str]] = {}
    for label, nbytes in reads:
        labels.setdefault(nbytes, set()).add(label)
    print(
        f"{'read alone':34} {'MB':>8} {'warps':>5} {'block':>5} {'progs':>6} {'us':>8} {'copy':>6}"
    )
    for nbytes in sorted(labels):
        setting, us = best_read(nbytes, sms, options)
        best[nbytes] = (setting, us)
        name = ", ".join(sorted(labels[nbytes]))
        print(
            f"{name[:34]:34} {nbytes / 1e6:8.2f} {setting.warps:5d} {setting.block:5d} "
            f"{setting.programs:6d} {us:8.2f} {nbytes / (us * 1e-6) / copy:6.1%}"
        )

    spans = [best[nbytes][0].words() for _, nbytes in reads]
    offsets = [0]
    for span in spans:
        offsets.append(offsets[-1] + span)
    buffer = torch.zeros(offsets[-1], dtype=torch.int32, device=DEVICE)
    out = torch.empty(max(s.programs for s, _ in best.values()), dtype=torch.int32, device=DEVICE)
    rows = [torch.zeros(TRIVIAL_ROW, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    block = triton.next_power_of_2(triton.cdiv(TRIVIAL_ROW, TRIVIAL_PROGRAMS))
    # trivial kernels spread evenly before the reads
    before = [
        trivial * (i + 1) // len(reads) - trivial * i // len(reads) for i in range(len(reads))
    ]

    def chain():
        flip = 0
        for (_, nbytes), start, extra in zip(reads, offsets, before, strict=False):
            for _ in range(extra):
                _chain_kernel[(TRIVIAL_PROGRAMS,)](
                    rows[flip], rows[1 - flip], TRIVIAL_ROW, BLOCK=block, **options
                )
                flip = 1 - flip
            setting = best[nbytes][0]
            launch_read(buffer[start : start + setting.words()], out, setting, options)

    chain_us = median_us(chain)
    alone = sum(best[nbytes][1] for _, nbytes in reads)
    need = step_bytes / (args.target * copy) * 1e6
    print(f"{'chain':34} {'launches':>8} {'ms':>8} {'copy':>6}")
    print(
        f"{'reads alone, summed':34} {len(reads):8d} {alone / 1e3:8.3f} "
        f"{step_bytes / (alone * 1e-6) / copy:6.1%}"
    )
    print(
        f"{'the floor chain, one graph, PDL':34} {len(reads) + trivial:8d} "
        f"{chain_us / 1e3:8.3f} {step_bytes / (chain_us * 1e-6) / copy:6.1%}"
    )
    print(f"{f'a step at {args.target:.0%} of copy':34} {'':8} {need / 1e3:8.3f}")


if __name__ == "__main__":
    main()

"""The Gluon q4 product's copies alone: its TMA ring streamed with no arithmetic, in the boxes
the product asked for and in the wider ones it asks for now, at the 27B gate|up and down
shapes (GPU only).

Each of the product's tiles (`groupwise_gemv_gluon`, 64 rows x 512 columns) was asked for as
three TMA boxes (`WIDE_CODES` off): the codes as [8 groups, 64 rows, 8 words], whose rows are 32 contiguous
bytes each, the scales as [64 rows, 8 groups] (16 bytes a row) and x as [8 groups, 8 rows,
64 columns] (128 bytes a row). A TMA copy moves its box row by row, so a tile is 640 rows of
transfers for 25 KB, 512 of them the codes'. If the copy engine's rate in rows, not the
memory's in bytes, bounds the product, streaming the same tile without arithmetic is as slow
as the product, and the same codes asked for as two [64 rows, 32 words] boxes (128 contiguous
bytes a row, the swizzle the shared-memory reads then need) are faster.

A program streams its row block's tiles through a ring of STAGES slots (two, as the gate|up's
setting: four programs an SM), waiting for each tile as the product does and reading
nothing; the down product's row blocks are split over K for about four programs an SM, as
its setting is. Forms: the codes in the narrow boxes or the wide ones, alone, with the
scales, and with the scales and x; with the wide codes also the scales from a transposed copy
([K/64, N]: a tile's as one [8 groups, 64 rows] box, 8 rows of 128 bytes instead of 64 of
16). Beside them in the same run: the product itself at eight x rows, with its codes in the
narrow boxes and in the wide ones (`WIDE_CODES`, shipped on), the 27B q6 head likewise, and
the device's copy rate. Times are CUDA-graph replays, median, the weights rotated over sets
larger than the L2 (`decode_variants.median_us`).

    python bench/tma_boxes.py
"""

from __future__ import annotations

import math
from functools import partial

import torch
import triton
from decode_kernels import rotating  # this folder: the scripts run as `python bench/...`
from decode_variants import median_us
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ninfer.bench.ceilings import copy_bandwidth
from ninfer.kernels import groupwise_gemv_gluon as gluon_q4
from ninfer.quant import get_format

DEVICE = "cuda"
Q4 = get_format("q4_g64_fp16")
BN, GROUPS, STAGES = 64, 8, 2
# 27B products: (N, K, K splits for about four programs an SM)
SHAPES = {"gate|up": (34816, 5120, 1), "down": (5120, 17408, 6)}
HEAD = (248320, 5120)  # the 27B head, q6
# codes alone, with the scales (as stored, or a transposed copy: [K/64, N], a box of
# [8 groups, 64 rows], 128-byte rows), with the scales and x
PARTS = ("codes", "+scales", "+x", "+scales T", "+scales T +x")
FORMS = [(False, "codes"), (False, "+scales"), (False, "+x")] + [(True, p) for p in PARTS]


@gluon.jit
def _stream_kernel(
    w_desc, s_desc, x_desc, out_ptr, num_tiles, tiles_per_split,
    BN: gl.constexpr, GROUPS: gl.constexpr, WIDE: gl.constexpr, SCALES: gl.constexpr,
    X: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """A program's tiles through the ring, each waited for and not read. WIDE: the codes as
    two [BN, 32-word] boxes a tile, else one [GROUPS, BN, 8-word] box."""
    pid_n = gl.program_id(0)
    first = gl.program_id(1) * tiles_per_split
    count = gl.minimum(num_tiles - first, tiles_per_split)
    n0 = pid_n * BN
    BOXES: gl.constexpr = 2 if WIDE else 1
    if WIDE:
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES * 2, BN, 32], w_desc.layout)
    else:
        w_ring = gl.allocate_shared_memory(gl.int32, [STAGES, GROUPS, BN, 8], w_desc.layout)
    if SCALES == 2:  # transposed: [GROUPS, BN]
        s_ring = gl.allocate_shared_memory(gl.float16, [STAGES, GROUPS, BN], s_desc.layout)
    else:
        s_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, GROUPS], s_desc.layout)
    x_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, GROUPS, 8, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    nbytes: gl.constexpr = (
        BOXES * w_desc.block_type.nbytes
        + (s_desc.block_type.nbytes if SCALES > 0 else 0)
        + (x_desc.block_type.nbytes if X else 0)
    )
    for j in range(-(STAGES - 1), count):
        ahead = j + STAGES - 1
        slot = ahead % STAGES
        bar = ready.index(slot)
        gluon_q4._barrier()  # every warp is past the wait on this slot's last tile
        mbarrier.expect(bar, nbytes, pred=ahead < count)
        tile = first + ahead
        if WIDE:
            for b in gl.static_range(2):
                gluon_q4._tma_load(
                    w_desc, [n0, tile * 64 + b * 32], bar, w_ring.index(slot * 2 + b),
                    pred=ahead < count,
                )  # fmt: skip
        else:
            gluon_q4._tma_load(
                w_desc, [tile * GROUPS, n0, 0], bar, w_ring.index(slot), pred=ahead < count
            )
        if SCALES == 2:
            gluon_q4._tma_load(
                s_desc, [tile * GROUPS, n0], bar, s_ring.index(slot), pred=ahead < count
            )
        elif SCALES == 1:
            gluon_q4._tma_load(
                s_desc, [n0, tile * GROUPS], bar, s_ring.index(slot), pred=ahead < count
            )
        if X:
            gluon_q4._tma_load(
                x_desc, [tile * GROUPS, 0, 0], bar, x_ring.index(slot), pred=ahead < count
            )
        if j >= 0:
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    gl.store(out_ptr + pid_n, count)


def stream(
    weight, scales_t, x: torch.Tensor, out: torch.Tensor, wide: bool, parts: str, splits: int
):
    """Launch the streaming kernel over weight's row blocks: `parts` one of PARTS."""
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    n, k = weight.shape
    num_tiles = k // (64 * GROUPS)
    x_desc, w_desc, s_desc = gluon_q4._descriptors(x, codes, scales, BN, False)
    if "scales T" in parts:  # scales_t: the scales' transposed copy, [K/64, N]
        s_desc = TensorDescriptor(
            scales_t,
            list(scales_t.shape),
            list(scales_t.stride()),
            [GROUPS, BN],
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2),
        )
    if wide:  # each row's 256 bytes of a tile as two boxes of 128, swizzled as x's are
        words = codes.view(torch.int32)
        w_desc = TensorDescriptor(
            words,
            list(words.shape),
            list(words.stride()),
            [BN, 32],
            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2),
        )
    per_split = triton.cdiv(num_tiles, splits)
    scales = 0 if parts == "codes" else 2 if "scales T" in parts else 1
    _stream_kernel[(triton.cdiv(n, BN), splits)](
        w_desc, s_desc, x_desc, out, num_tiles, per_split,
        BN=BN, GROUPS=GROUPS, WIDE=wide, SCALES=scales, X=parts.endswith("+x"), STAGES=STAGES,
        num_warps=4,
    )  # fmt: skip


def main() -> None:
    copy = copy_bandwidth(DEVICE)
    shipped = gluon_q4.WIDE_CODES
    print(f"copy {copy / 1e9:.1f} GB/s")
    print(f"{'27B':8} {'form':>22} {'us':>7} {'GB/s':>7} {'of copy':>8}")
    for name, (n, k, splits) in SHAPES.items():
        nbytes = Q4.encoded_nbytes((n, k))
        weights = [
            Q4.encode(torch.randn(n, k, device=DEVICE) * 0.02)
            for _ in range(max(2, math.ceil(240e6 / nbytes)))
        ]
        transposed = [w.planes["scales"].t().contiguous() for w in weights]
        x = torch.randn(8, k, device=DEVICE, dtype=torch.bfloat16)
        out = torch.empty(triton.cdiv(n, BN), dtype=torch.int32, device=DEVICE)
        product = gluon_q4.q4_swiglu_linear if name == "gate|up" else gluon_q4.q4_linear
        rows = []
        for wide in (False, True):  # the product with its codes in narrow boxes, then wide ones
            gluon_q4.WIDE_CODES = wide
            calls = [partial(product, x, w) for w in weights]
            rows.append((f"product{', wide' if wide else ''}, 8 rows", median_us(rotating(calls))))
        gluon_q4.WIDE_CODES = shipped
        for wide, parts in FORMS:
            calls = [
                partial(stream, w, t, x, out, wide, parts, splits)
                for w, t in zip(weights, transposed, strict=True)
            ]
            rows.append((f"{'wide' if wide else 'narrow'} {parts}", median_us(rotating(calls))))
        codes_bytes = n * k // 2
        for label, us in rows:  # the bytes from DRAM: codes, and scales where read (x: L2)
            moved = codes_bytes if label.endswith(" codes") else nbytes
            rate = moved / (us * 1e-6)
            print(f"{name:8} {label:>22} {us:7.2f} {rate / 1e9:7.0f} {rate / copy:8.1%}")
        del weights
    # the 27B q6 head at eight rows, its codes and high bits in narrow boxes, then wide ones
    n, k = HEAD
    q6 = get_format("q6_g64_fp16")
    weights = [q6.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(2)]
    x = torch.randn(8, k, device=DEVICE, dtype=torch.bfloat16)
    for wide in (False, True):
        gluon_q4.WIDE_CODES = wide
        us = median_us(rotating([partial(gluon_q4.q6_linear, x, w) for w in weights]))
        rate = q6.encoded_nbytes((n, k)) / (us * 1e-6)
        label = f"q6 product{', wide' if wide else ''}, 8 rows"
        print(f"{'head':8} {label:>22} {us:7.2f} {rate / 1e9:7.0f} {rate / copy:8.1%}")
    gluon_q4.WIDE_CODES = shipped


if __name__ == "__main__":
    main()

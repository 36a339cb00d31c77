"""Two comparisons behind settings and choices of the decode kernels, on the GPU (random
inputs, CUDA-graph replay, median; weights rotated over sets larger than the L2):

- the warps of the one-token norm (`rms_norm_triton`) and routing (`moe_routing_triton`)
  programs, which are latency and not bandwidth (docs/performance.md, Measurement 8);
- the column block and warps of the GDN decode kernel (`gdn_recurrent_triton`, b|a product
  and gates inside) at one token, beside the one-token cost of the small kernels around it
  (gated norm, conv, SwiGLU) that folding into a neighbour would save (Measurement 9);
- torch's int4 tensor-core product (`torch.ops.aten._weight_int4pack_mm`, weights prepared by
  `_convert_weight_to_int4pack`) against our q4 GEMVs at the 27B shapes, one to sixteen x rows
  (bench/decode_kernels.md, "torch's int4 tensor-core kernel against ours").

    python bench/decode_variants.py [--skip-int4pack]
"""

from __future__ import annotations

import argparse
import math

import torch
from decode_kernels import rotating  # this folder: the scripts run as `python bench/...`
from triton.testing import do_bench_cudagraph

from ninfer.bench.ceilings import copy_bandwidth
from ninfer.kernels import (
    causal_conv1d_triton,
    gated_rms_norm_triton,
    gdn_recurrent_triton,
    groupwise_gemv_triton,
    moe_routing_triton,
    rms_norm_triton,
    swiglu_triton,
)
from ninfer.kernels.x_split import SplitRequest
from ninfer.quant import get_format

DEVICE = "cuda"
BF16 = torch.bfloat16
Q4 = get_format("q4_g64_fp16")
# 27B q4 products: MLP gate|up, MLP down, GDN out_proj, GDN qkv|z
GEMV_SHAPES = ((34816, 5120), (5120, 17408), (5120, 6144), (16384, 5120))


def median_us(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3


def norm_and_routing_warps() -> None:
    print(f"{'one-token kernel':40} {'warps':>5} {'us':>7}")
    split = SplitRequest.for_format("q4_g64_fp16")
    defaults = rms_norm_triton.NORM_ELEMENTS_PER_WARP, rms_norm_triton.NORM_DECODE_MAX_WARPS
    rms_norm_triton.NORM_DECODE_MAX_WARPS = 16
    for dim in (5120, 2048):
        x = torch.randn(1, dim, device=DEVICE, dtype=BF16)
        residual, weight = torch.randn_like(x), torch.randn(dim, device=DEVICE, dtype=BF16)
        for per_warp in (2048, 1024, 512, 256):
            rms_norm_triton.NORM_ELEMENTS_PER_WARP = per_warp
            warps = min(16, max(1, rms_norm_triton.next_power_of_2(dim) // per_warp))
            us = median_us(
                lambda x=x, w=weight, r=residual: rms_norm_triton.rms_norm(x, w, 1e-6, r, split)
            )
            print(f"{f'rms_norm + residual + split, 1 x {dim}':40} {warps:5d} {us:7.2f}")
    rms_norm_triton.NORM_ELEMENTS_PER_WARP, rms_norm_triton.NORM_DECODE_MAX_WARPS = defaults
    default_warps = moe_routing_triton.ROUTE_WARPS
    for tokens in (1, 8):
        logits = torch.randn(tokens, 256, device=DEVICE, dtype=BF16)
        for warps in (1, 2, 4):
            moe_routing_triton.ROUTE_WARPS = warps
            us = median_us(lambda z=logits: moe_routing_triton.moe_route(z, 8, BF16, 0, 256, True))
            print(f"{f'moe_route T={tokens}, 256 experts, top 8':40} {warps:5d} {us:7.2f}")
    moe_routing_triton.ROUTE_WARPS = default_warps


def gdn_decode_kernels() -> None:
    """One token at the 27B (48 value heads, hidden 5120, MLP 17408) and 35B-A3B (32, 2048,
    shared expert 512) shapes, 16 key heads, dk = dv = 128."""
    print(f"{'one-token GDN-layer kernel':48} {'us':>7}")
    for shape in (("27B", 5120, 48, 17408), ("35B-A3B", 2048, 32, 512)):
        _gdn_decode_kernels_at(*shape)


def _gdn_decode_kernels_at(name: str, hidden: int, value_heads: int, mlp: int) -> None:
    dim, key_heads = 128, 16
    split = SplitRequest.for_format("q4_g64_fp16")

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(BF16)

    slots = torch.tensor([3], device=DEVICE, dtype=torch.int32)
    query_start = torch.tensor([0, 1], device=DEVICE, dtype=torch.int32)
    q, k, v = randn(1, key_heads, dim), randn(1, key_heads, dim), randn(1, value_heads, dim)
    x, ba_weight = randn(1, hidden), randn(2 * value_heads, hidden, scale=0.02)
    A_log = torch.randn(value_heads, device=DEVICE)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    states = torch.randn(8, value_heads, dim, dim, device=DEVICE) * 0.1

    def rule():
        gdn_recurrent_triton.recurrent_gated_delta_rule_from_x(
            q, k, v, x, ba_weight, A_log, dt_bias, states, slots, query_start
        )

    print(f"{f'{name} recurrent + gates, as chosen':48} {median_us(rule):7.2f}")
    defaults = gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS
    sms = gdn_recurrent_triton.num_sms
    gdn_recurrent_triton.num_sms = lambda device: 1  # the block as set, never narrowed
    for block_v, warps in ((16, 4), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (128, 16)):
        gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = block_v, warps
        us = median_us(rule)
        print(f"{f'{name} recurrent + gates, block {block_v}, {warps} warps':48} {us:7.2f}")
    gdn_recurrent_triton.num_sms = sms
    gdn_recurrent_triton.MAX_BLOCK_V, gdn_recurrent_triton.RECURRENT_WARPS = defaults
    out, z, weight = randn(1, value_heads, dim), randn(1, value_heads, dim), randn(dim)
    us = median_us(lambda: gated_rms_norm_triton.gated_rms_norm(out, z, weight, 1e-6, split))
    print(f"{f'{name} gated norm + split':48} {us:7.2f}")
    channels = (2 * key_heads + value_heads) * dim
    mixed, taps, windows = randn(1, channels), randn(channels, 4), randn(8, channels, 3)
    us = median_us(
        lambda: causal_conv1d_triton.causal_conv1d(mixed, taps, windows, slots, query_start)
    )
    print(f"{f'{name} causal conv, {channels} channels':48} {us:7.2f}")
    gate, up = randn(1, 2 * mlp).chunk(2, dim=-1)
    us = median_us(lambda: swiglu_triton.silu_mul(gate, up, split))
    print(f"{f'{name} SwiGLU + split, {mlp} wide':48} {us:7.2f}")


def int4pack(encoded, inner_k_tiles: int):
    """Our q4_g64 planes in the int4pack form: the same codes (value 2j in the high nibble,
    stored as code + 8), bf16 scales, zero points 0."""
    unsigned = encoded.planes["codes"] ^ 0x88
    swapped = ((unsigned & 0xF) << 4) | (unsigned >> 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), inner_k_tiles)
    scales = encoded.planes["scales"].to(BF16).t().contiguous()
    return packed, torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()


def int4pack_against_ours() -> None:
    copy = copy_bandwidth(DEVICE)
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'q4 product':18} {'tiles':>5} {'M':>3} {'int4pack us':>12} {'ours us':>8}")
    for n, k in GEMV_SHAPES:
        sets = max(2, math.ceil(240e6 / Q4.encoded_nbytes((n, k))))
        weights = [Q4.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(sets)]
        for tiles in (8, 4, 2):
            packs = [int4pack(w, tiles) for w in weights]
            for m in (1, 2, 4, 8, 16):
                x = torch.randn(m, k, device=DEVICE, dtype=BF16)
                theirs = median_us(
                    rotating(
                        [
                            lambda p=p, x=x: torch.ops.aten._weight_int4pack_mm(x, p[0], 64, p[1])
                            for p in packs
                        ]
                    )
                )
                ours = median_us(
                    rotating(
                        [
                            lambda w=w, x=x: groupwise_gemv_triton.groupwise_linear(x, w)
                            for w in weights
                        ]
                    )
                )
                print(f"{f'{n}x{k}':18} {tiles:5d} {m:3d} {theirs:12.1f} {ours:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-int4pack", action="store_true", help="only the one-token sweeps")
    args = parser.parse_args()
    norm_and_routing_warps()
    gdn_decode_kernels()
    if not args.skip_int4pack:
        int4pack_against_ours()


if __name__ == "__main__":
    main()

"""Achieved bandwidth of the Triton decode kernels (and of prefill's weight dequantization)
against a device-to-device copy measured in the same run, at the Qwen3.5-27B shapes (random
inputs; GPU only).

    python bench/decode_kernels.py [--json PATH]

Each row: the kernel's median time (CUDA-graph replay, triton.testing.do_bench_cudagraph), the bytes it must move (every
input read once, every output written once), their ratio in GB/s and that over the copy rate.
Inputs are rotated over several sets larger than the L2 where a single set would fit in it.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench, do_bench_cudagraph

from ninfer.bench.ceilings import copy_bandwidth
from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels import (
    causal_conv1d_triton,
    gated_rms_norm_triton,
    gdn_recurrent_triton,
    groupwise_dequant_triton,
    groupwise_gemv_triton,
    paged_attention_triton,
    rms_norm_triton,
)
from ninfer.quant import get_format

DEVICE = "cuda"
BF16 = torch.bfloat16
# Qwen3.5-27B
HIDDEN, INTERMEDIATE = 5120, 17408
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 24, 4, 256
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM, CONV_KERNEL = 16, 48, 128, 4
FORMATS = ("q4_g64_fp16", "q8_g32_fp16")
# Tensor-core GEMV settings timed at M = 8: (rows, columns per tile, warps, stages), programs
# per SM below which K is split; the q8 format only at up to 128 columns.
TC_VARIANTS = (
    ((128, 128, 4, 3), 6),
    ((128, 128, 4, 3), 4),
    ((128, 128, 4, 3), 3),
    ((128, 128, 4, 3), 8),
    ((128, 128, 4, 2), 6),
    ((128, 128, 4, 4), 6),
    ((128, 64, 4, 3), 6),
    ((64, 128, 4, 3), 6),
    ((64, 128, 2, 3), 6),
    ((64, 256, 4, 3), 6),
    ((64, 256, 4, 3), 4),
    ((64, 256, 4, 4), 6),
    ((32, 256, 2, 3), 6),
    ((128, 256, 8, 3), 6),
    ((128, 128, 8, 3), 6),
    ((256, 128, 8, 3), 6),
)
# ... at the 27B products: MLP gate|up, MLP down, out projection, attention q|gate
TC_SHAPES = ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE), (HIDDEN, 6144), (12288, HIDDEN))
CONV_DIM = 2 * GDN_KEY_HEADS * GDN_DIM + GDN_VALUE_HEADS * GDN_DIM


def median_ms(fn) -> float:
    """Replayed from a CUDA graph (as decode runs), so small kernels are not timed as Python
    launch overhead; falls back to plain launches if capture fails."""
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as error:  # noqa: BLE001 - report and time without a graph
        print(f"  (no graph: {type(error).__name__}: {error})")
        return do_bench(fn, warmup=25, rep=200, return_mode="median")


def rotating(calls):
    state = {"i": 0}

    def run():
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return run


def bench_attention(batch: int, context: int):
    pages_each = math.ceil(context / PAGE_SIZE)
    num_pages = batch * pages_each
    shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=BF16)
    v_cache = torch.randn(shape, device=DEVICE, dtype=BF16)
    page_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(batch, pages_each)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=BF16)
    fn = lambda: paged_attention_triton.paged_attention_decode(
        q, k_cache, v_cache, page_table, seq_lens, HEAD_DIM**-0.5, context
    )
    moved = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    return f"paged attention B={batch} ctx={context}", median_ms(fn), moved


def bench_gdn(batch: int):
    sets = max(1, math.ceil(256e6 / (batch * GDN_VALUE_HEADS * GDN_DIM * GDN_DIM * 4)))
    states = torch.randn(sets * batch, GDN_VALUE_HEADS, GDN_DIM, GDN_DIM, device=DEVICE)
    q = torch.randn(batch, GDN_KEY_HEADS, GDN_DIM, device=DEVICE, dtype=BF16)
    k = torch.randn_like(q)
    v = torch.randn(batch, GDN_VALUE_HEADS, GDN_DIM, device=DEVICE, dtype=BF16)
    g = -torch.rand(batch, GDN_VALUE_HEADS, device=DEVICE)
    beta = torch.rand(batch, GDN_VALUE_HEADS, device=DEVICE, dtype=BF16)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    slot_sets = torch.randperm(sets * batch, device=DEVICE).to(torch.int32).view(sets, batch)
    calls = [
        (
            lambda slots=slots: gdn_recurrent_triton.recurrent_gated_delta_rule(
                q, k, v, g, beta, states, slots, query_start
            )
        )
        for slots in slot_sets
    ]
    moved = batch * GDN_VALUE_HEADS * GDN_DIM * GDN_DIM * 4 * 2
    return f"GDN recurrent B={batch}", median_ms(rotating(calls)), moved


def bench_conv(batch: int):
    sets = 16
    windows = torch.randn(sets * batch, CONV_DIM, CONV_KERNEL - 1, device=DEVICE, dtype=BF16)
    weight = torch.randn(CONV_DIM, CONV_KERNEL, device=DEVICE, dtype=BF16)
    x = torch.randn(batch, CONV_DIM, device=DEVICE, dtype=BF16)
    query_start = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    slot_sets = torch.randperm(sets * batch, device=DEVICE).to(torch.int32).view(sets, batch)
    calls = [
        (
            lambda slots=slots: causal_conv1d_triton.causal_conv1d(
                x, weight, windows, slots, query_start
            )
        )
        for slots in slot_sets
    ]
    moved = batch * CONV_DIM * (2 * (CONV_KERNEL - 1) + 2) * 2 + weight.numel() * 2
    return f"causal conv update B={batch}", median_ms(rotating(calls)), moved


def bench_rms_norm(rows: int):
    x = torch.randn(rows, HIDDEN, device=DEVICE, dtype=BF16)
    residual = torch.randn_like(x)
    weight = torch.randn(HIDDEN, device=DEVICE, dtype=BF16)
    fn = lambda: rms_norm_triton.rms_norm(x, weight, 1e-6, residual)
    moved = 4 * x.numel() * 2
    return f"rms norm + residual rows={rows}", median_ms(fn), moved


def bench_gated_rms_norm(tokens: int):
    """The GDN output norm: x as the delta rule returns it, z the heads of z's projection."""
    x = torch.randn(tokens, GDN_VALUE_HEADS, GDN_DIM, device=DEVICE, dtype=BF16)
    z = torch.randn_like(x)
    weight = torch.randn(GDN_DIM, device=DEVICE, dtype=BF16)
    fn = lambda: gated_rms_norm_triton.gated_rms_norm(x, z, weight, 1e-6)
    moved = 3 * x.numel() * 2
    return f"gated rms norm tokens={tokens}", median_ms(fn), moved


def bench_gemv(format_name: str, m: int, n: int, k: int):
    fmt = get_format(format_name)
    weight_bytes = fmt.encoded_nbytes((n, k))
    sets = max(2, math.ceil(240e6 / weight_bytes))
    weights = []
    for _ in range(sets):
        encoded = fmt.encode(torch.randn(n, k, device=DEVICE) * 0.02)
        weights.append(encoded)
    x = torch.randn(m, k, device=DEVICE, dtype=BF16)
    calls = [lambda w=w: groupwise_gemv_triton.groupwise_linear(x, w) for w in weights]
    moved = weight_bytes + x.numel() * 2 + m * n * 2
    dense = torch.randn(n, k, device=DEVICE, dtype=BF16)
    bf16_ms = median_ms(lambda: x @ dense.T)
    label = f"{format_name} GEMV M={m} {n}x{k}"
    return label, median_ms(rotating(calls)), moved, bf16_ms


def bench_dequant(format_name: str, n: int, k: int):
    """Prefill's dequantization of one weight to bf16: codes and scales read, the dense weight
    written."""
    fmt = get_format(format_name)
    weight_bytes = fmt.encoded_nbytes((n, k))
    sets = max(2, math.ceil(240e6 / weight_bytes))
    weights = [fmt.encode(torch.randn(n, k, device=DEVICE) * 0.02) for _ in range(sets)]
    calls = [lambda w=w: groupwise_dequant_triton.groupwise_dequant(w, BF16) for w in weights]
    moved = weight_bytes + n * k * 2
    return f"{format_name} dequant {n}x{k} to bf16", median_ms(rotating(calls)), moved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    copy = copy_bandwidth(DEVICE)
    rows = [
        bench_attention(1, 32768),
        bench_attention(8, 4096),
        bench_attention(32, 8192),
        bench_gdn(1),
        bench_gdn(8),
        bench_gdn(64),
        bench_conv(1),
        bench_conv(64),
        bench_rms_norm(8),
        bench_rms_norm(8192),
        bench_gated_rms_norm(1),
        bench_gated_rms_norm(8),
        bench_gated_rms_norm(4096),
    ]
    gemv_rows = [
        bench_gemv(name, m, n, k)
        for name in FORMATS
        for m in (1, 8)
        for n, k in ((INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))
    ]
    rows += [bench_dequant(name, INTERMEDIATE, HIDDEN) for name in FORMATS]
    print(f"device copy: {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'kernel':44} {'us':>9} {'MB':>9} {'GB/s':>7} {'of copy':>8}")
    table = []
    for label, ms, moved, *extra in rows + gemv_rows:
        rate = moved / (ms * 1e-3)
        note = f"  (bf16 matmul {extra[0] * 1e3:.1f} us)" if extra else ""
        print(
            f"{label:44} {ms * 1e3:9.1f} {moved / 1e6:9.2f} {rate / 1e9:7.0f} {rate / copy:8.1%}"
            + note
        )
        table.append({"kernel": label, "ms": ms, "bytes": moved, "fraction_of_copy": rate / copy})
    print("variants (us):")
    for waves in (2, 4, 8):
        paged_attention_triton.SPLIT_WAVES = waves
        one, many = bench_attention(1, 32768)[1], bench_attention(8, 4096)[1]
        print(
            f"  attention waves={waves}: B=1 ctx=32768 {one * 1e3:.1f}, B=8 ctx=4096 {many * 1e3:.1f}"
        )
    paged_attention_triton.SPLIT_WAVES = 2
    tc_defaults = dict(groupwise_gemv_triton.TC_CONFIG), groupwise_gemv_triton.TC_PROGRAMS_PER_SM
    for config, per_sm in TC_VARIANTS:
        groupwise_gemv_triton.TC_CONFIG = dict.fromkeys(FORMATS, config)
        groupwise_gemv_triton.TC_PROGRAMS_PER_SM = per_sm
        for name in FORMATS:
            if name.startswith("q8") and config[1] > 128:
                continue  # scaled after its product, a q8 tile holds at most four groups
            times = [f"{n}x{k} {bench_gemv(name, 8, n, k)[1] * 1e3:.1f}" for n, k in TC_SHAPES]
            print(
                f"  {name[:2]} GEMV M=8, rows/columns/warps/stages {'/'.join(map(str, config))}, "
                f"{per_sm} programs per SM: {', '.join(times)}"
            )
    groupwise_gemv_triton.TC_CONFIG, groupwise_gemv_triton.TC_PROGRAMS_PER_SM = tc_defaults
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bytes_per_s": copy, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()

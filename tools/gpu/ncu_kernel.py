"""One decode kernel at a model's shape, for Nsight Compute, and the per-instruction samples
of its report.

Launching a kernel 30 times at the shapes of a decode step, so that `ncu` can pick one launch
past the first compiles (GPU only):

    ncu --clock-control none -k regex:KERNEL --launch-skip 20 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 \\
        --import-source no -o REPORT python tools/gpu/ncu_kernel.py run CASE
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > REPORT.csv

CASE (and the KERNEL it launches): `route` (`_moe_route_kernel`, 35B-A3B: 256 experts, top
8, one token), `router` (`_moe_router_route_kernel`, the 35B-A3B router with the norm
inside), `norm` (`_rms_norm_kernel`, a 27B decoder norm: 5120 wide, the residual, q4 codes),
`gated-norm` (`_gated_rms_norm_kernel`, the 35B-A3B GDN output norm: 32 heads of 128, q4
codes), and the 27B one-row q4 products (`_groupwise_gemv_int_kernel`, x split beforehand as
the step's producers split it): `in` (the GDN q|k|v|z, 16384 x 5120), `attention`
(q|gate|k|v, 14336 x 5120), `out` (5120 x 6144), `gate-up` (34816 x 5120), `down`
(5120 x 17408); and the same products at eight x rows in Gluon (`_q4_tc_kernel`), as a C=8
step runs them at the device's settings: `gate-up-8` (with the SwiGLU), `down-8`, `out-8`,
`attention-8` (q|gate, 12288 x 5120). Nsight Compute flushes the caches between its passes
(its default), so each product reads its weight from DRAM, as in a step.

Reading the report's source page, on any machine:

    python tools/gpu/ncu_kernel.py read REPORT.csv [--at-least N]

prints each instruction with N or more warp-state samples and its two largest stall reasons,
then the instructions executed and the samples summed. A warp's samples at an instruction,
over the sampling interval, are the cycles it spent there; instructions that one warp alone
executes (a poller's, a routing's) are that warp's timeline. Clocks are left as they are
(docs/performance.md, Method): durations under ncu run longer than in a step, where PDL
overlaps a kernel's start with the kernel before it."""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAUNCHES = 30
# The 27B one-row products: (rows, columns) of the q4 weight
PRODUCTS = {
    "in": (16384, 5120),
    "attention": (14336, 5120),
    "out": (5120, 6144),
    "gate-up": (34816, 5120),
    "down": (5120, 17408),
}
# ... and at eight x rows, in Gluon
EIGHT_ROW_PRODUCTS = {
    "gate-up-8": (34816, 5120),
    "down-8": (5120, 17408),
    "out-8": (5120, 6144),
    "attention-8": (12288, 5120),
}
CASES = "route, router, norm, gated-norm, " + ", ".join([*PRODUCTS, *EIGHT_ROW_PRODUCTS])


def _calls(case: str):
    """A function that launches CASE's kernel once."""
    import torch

    from ninfer.kernels import (
        gated_rms_norm_triton,
        moe_router_triton,
        moe_routing_triton,
        rms_norm_triton,
    )
    from ninfer.kernels.x_split import SplitRequest

    dev, bf16 = "cuda", torch.bfloat16
    split = SplitRequest.for_format("q4_g64_fp16", 64)
    if case == "route":
        logits = torch.randn(1, 257, device=dev, dtype=bf16)
        return lambda i: moe_routing_triton.moe_route(logits[:, :256], 8, bf16, 0, 256, True)
    if case == "router":
        x, residual = (torch.randn(1, 2048, device=dev, dtype=bf16) for _ in range(2))
        norm_weight = torch.randn(2048, device=dev, dtype=bf16) * 0.1
        routers = [torch.randn(257, 2048, device=dev, dtype=bf16) * 0.02 for _ in range(8)]
        return lambda i: moe_router_triton.moe_norm_router_route(
            x, residual, norm_weight, 1e-6, routers[i % 8], 256, 8, 0, 256, True, split
        )
    if case == "norm":
        x, residual = (torch.randn(1, 5120, device=dev, dtype=bf16) for _ in range(2))
        weight = torch.randn(5120, device=dev, dtype=bf16) * 0.1
        return lambda i: rms_norm_triton.rms_norm(x, weight, 1e-6, residual, split)
    if case == "gated-norm":
        x, z = (torch.randn(1, 32, 128, device=dev, dtype=bf16) for _ in range(2))
        weight = torch.randn(128, device=dev, dtype=bf16)
        return lambda i: gated_rms_norm_triton.gated_rms_norm(x, z, weight, 1e-6, split)
    if case in PRODUCTS:
        from ninfer.kernels import groupwise_gemv_triton
        from ninfer.kernels.x_split import attach
        from ninfer.quant import get_format

        n, k = PRODUCTS[case]
        weight = get_format("q4_g64_fp16").encode(torch.randn(n, k, device=dev) * 0.02)
        x = torch.randn(1, k, device=dev, dtype=bf16)
        attach(x, SplitRequest(4, 64, 1), groupwise_gemv_triton.split_x(x, 4, 64, k))
        return lambda i: groupwise_gemv_triton.integer_linear(x, weight)
    if case in EIGHT_ROW_PRODUCTS:
        from ninfer.kernels import groupwise_gemv_gluon
        from ninfer.quant import get_format

        n, k = EIGHT_ROW_PRODUCTS[case]
        weight = get_format("q4_g64_fp16").encode(torch.randn(n, k, device=dev) * 0.02)
        x = torch.randn(8, k, device=dev, dtype=bf16)
        if case == "gate-up-8":
            return lambda i: groupwise_gemv_gluon.q4_swiglu_linear(x, weight)
        return lambda i: groupwise_gemv_gluon.q4_linear(x, weight)
    raise SystemExit(f"ncu_kernel: no case {case!r} ({CASES})")


def run(case: str) -> None:
    import torch

    call = _calls(case)
    for i in range(LAUNCHES):
        call(i)
    torch.cuda.synchronize()
    print(f"{case}: {LAUNCHES} launches")


def read(path: Path, at_least: int) -> None:
    rows = list(csv.reader(path.open()))
    header, data = rows[1], rows[2:]
    column = {name: i for i, name in enumerate(header)}
    stalls = [h for h in header if h.startswith("stall_") and "(Not" not in h]
    totals: collections.Counter = collections.Counter()
    executed = samples = 0
    for index, row in enumerate(data):
        count = int(row[column["Warp Stall Sampling (All Samples)"]] or 0)
        executed += int(row[column["Instructions Executed"]] or 0)
        samples += count
        reasons = sorted(((int(row[column[h]] or 0), h[6:]) for h in stalls), reverse=True)
        for value, name in reasons:
            totals[name] += value
        if count >= at_least:
            top = ", ".join(f"{name} {value}" for value, name in reasons[:2] if value)
            source = row[column["Source"]].strip()
            print(
                f"{index:5} {row[column['Instructions Executed']]:>6} {count:5}  {source[:60]:60} {top}"
            )
    mix = ", ".join(f"{name} {value}" for name, value in totals.most_common(6))
    print(f"instructions executed {executed}, samples {samples}: {mix}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("run", help="launch CASE's kernel 30 times (GPU)")
    launch.add_argument("case", help=CASES)
    report = commands.add_parser("read", help="per-instruction samples of a source-page CSV")
    report.add_argument("csv", type=Path)
    report.add_argument("--at-least", type=int, default=5, help="samples to print a line")
    args = parser.parse_args()
    if args.command == "run":
        run(args.case)
    else:
        read(args.csv, args.at_least)


if __name__ == "__main__":
    main()

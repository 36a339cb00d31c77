"""Compile ninfer's Triton kernels for the GPU on a machine without one.

Triton's interpreter, which the CPU tests run the kernels in, never compiles them, so a kernel
that Triton cannot lower for the GPU (or that only the GPU machine's Triton version rejects)
fails first on the GPU machine, after the device time to get there is spent. This runs the
kernel cases of tests/kernel_cases.py on CPU tensors at the model shapes, through the kernels'
own Python wrappers, with every launch turned into a compile for sm_90 (front end, layouts,
ptxas) that launches nothing; the cases' result checks then fail on the unwritten outputs and
are ignored. Programmatic dependent launch is on, as on an H100/H200.

    python tools/gpu/compile_check.py [--capability 90] [-k NAME] [--sass]

With --sass, each compiled kernel also gets a line read from its SASS: registers, local
memory (spills), its instructions, and the instructions of its longest loop (the body of its longest backward
branch) with the most frequent opcodes, then the shared memory a program takes and, for
sm_90, how many programs an SM holds at once and what bounds that; the way to see what a
change to a kernel's inner loop or its footprint costs before timing it.

With the GPU machine's Triton installed beside the usual one
(`pip install --no-deps --target /tmp/triton-gpu triton==3.6.0`), run it with
`PYTHONPATH=/tmp/triton-gpu`. Prints a line per case and exits 1 if any kernel did not
compile."""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_check: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)")

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver, jit  # noqa: E402

import ninfer.kernels  # noqa: E402
from ninfer.kernels.triton_support import programs_per_sm  # noqa: E402

BF16 = torch.bfloat16
SMS = 132  # an H100/H200: the wrappers size grids and blocks by it


class KernelDidNotCompile(Exception):
    pass


class CompileOnlyDriver:
    """The driver Triton asks for a target, a device and a stream: a GPU of the given compute
    capability that is never launched on."""

    def __init__(self, capability: int) -> None:
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


@contextmanager
def compile_only(compiled: list):
    """Every `kernel[grid](...)` compiles (warm-up) instead of launching, for the target of the
    active driver (`CompileOnlyDriver`); the ninfer kernel modules see a GPU with PDL and SMS
    multiprocessors."""
    real_run = jit.JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:  # a compile error of any stage
            raise KernelDidNotCompile(f"{self.fn.__name__}: {error}") from error
        compiled.append((self.fn.__name__, kernel))
        return kernel

    patched = []
    for info in pkgutil.iter_modules(ninfer.kernels.__path__):
        if not info.name.endswith(("_triton", "_gluon")):
            continue
        module = importlib.import_module(f"ninfer.kernels.{info.name}")
        for name, value in (
            ("pdl_options", lambda device: {"PDL": True, "launch_pdl": True}),
            ("num_sms", lambda device: SMS),
        ):
            if hasattr(module, name):
                patched.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    jit.JITFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run = real_run
        for module, name, value in patched:
            setattr(module, name, value)


def sass_summary(cubin: bytes) -> str:
    """Registers, local memory and the longest loop's instruction mix of a compiled kernel,
    read with the cuobjdump that ships with Triton."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    lines = re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass, re.MULTILINE)
    addresses = [int(address, 16) for address, _ in lines]
    longest: list[str] = []
    for i, (_, text) in enumerate(lines):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) in addresses[:i]:
            body = [op for _, op in lines[addresses.index(int(target.group(1), 16)) : i + 1]]
            longest = max(longest, body, key=len)
    opcodes = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0] for op in longest
    )
    mix = " ".join(f"{name} {count}" for name, count in opcodes.most_common(8))
    loop = f"longest loop {len(longest)} instructions: {mix}" if longest else "no loop"
    return (
        f"registers {registers.group(1) if registers else '?'}, local "
        f"{local.group(1) if local else '?'} B, {len(lines)} instructions, {loop}"
    )


def cases():
    """(name, call) pairs: each call drives one family of kernels at the 27B or 35B-A3B shapes
    (the GPU tests' parameters, one of each specialization)."""
    import kernel_cases as kc

    from ninfer.kernels import (
        attention_prelude_triton,
        causal_conv1d_triton,
        gated_rms_norm_triton,
        gdn_gates_triton,
        gdn_recurrent_triton,
        groupwise_dequant_triton,
        groupwise_gemv_triton,
        kv_write_triton,
        moe_combine_triton,
        moe_router_triton,
        moe_routing_triton,
        output_gate_triton,
        paged_attention_prefill_triton,
        paged_attention_triton,
        rms_norm_triton,
        rotary_triton,
        swiglu_triton,
    )
    from ninfer.kernels.x_split import SplitRequest
    from ninfer.quant import EncodedTensor, get_format

    cpu, q4, q8 = "cpu", "q4_g64_fp16", "q8_g32_fp16"
    split = SplitRequest.for_format(q4)

    def gluon_q4(m: int, n: int, k: int) -> None:
        # `fits` takes CUDA tensors only; the kernel's own conditions hold at these shapes
        from ninfer.kernels import groupwise_gemv_gluon

        weight = get_format(q4).encode(torch.randn(n, k) * 0.05)
        groupwise_gemv_gluon.q4_linear(torch.randn(m, k, dtype=BF16), weight)

    def gluon_q6(m: int, n: int, k: int) -> None:
        from ninfer.kernels import groupwise_gemv_gluon

        weight = get_format("q6_g64_fp16").encode(torch.randn(n, k) * 0.05)
        groupwise_gemv_gluon.q6_linear(torch.randn(m, k, dtype=BF16), weight)

    def gluon_q4_swiglu(m: int, n: int, k: int) -> None:
        from ninfer.kernels import groupwise_gemv_gluon

        weight = get_format(q4).encode(torch.randn(n, k) * 0.05)
        groupwise_gemv_gluon.q4_swiglu_linear(torch.randn(m, k, dtype=BF16), weight)

    def gluon_q4_tail(m: int, n: int, k: int, swiglu: bool) -> None:
        # the row blocks past what the SMs hold split five ways (`TAIL_SPLITS`)
        from ninfer.kernels import groupwise_gemv_gluon

        weight = get_format(q4).encode(torch.randn(n, k) * 0.05)
        product = (
            groupwise_gemv_gluon.q4_swiglu_linear if swiglu else groupwise_gemv_gluon.q4_linear
        )
        held = groupwise_gemv_gluon.TAIL_SPLITS, groupwise_gemv_gluon.STAGES
        # two slots, as the H200's setting for the 27B gate|up: four programs an SM
        groupwise_gemv_gluon.TAIL_SPLITS, groupwise_gemv_gluon.STAGES = 5, 2
        try:
            product(torch.randn(m, k, dtype=BF16), weight)
        finally:
            groupwise_gemv_gluon.TAIL_SPLITS, groupwise_gemv_gluon.STAGES = held

    def gluon_q4_warp_specialized() -> None:
        # the producer warp and four consumers (`WARP_SPECIALIZED`): plain, split over K, the
        # SwiGLU with its tail split at two slots, and x a folded norm's rows
        from ninfer.kernels import groupwise_gemv_gluon
        from ninfer.kernels.norm_fold import NormedRows

        held = (
            groupwise_gemv_gluon.WARP_SPECIALIZED,
            groupwise_gemv_gluon.TAIL_SPLITS,
            groupwise_gemv_gluon.STAGES,
        )
        groupwise_gemv_gluon.WARP_SPECIALIZED = True
        try:
            gate_up = get_format(q4).encode(torch.randn(34816, 5120) * 0.05)
            x = torch.randn(8, 5120, dtype=BF16)
            groupwise_gemv_gluon.q4_linear(x, gate_up)
            down = get_format(q4).encode(torch.randn(5120, 17408) * 0.05)
            groupwise_gemv_gluon.q4_linear(torch.randn(3, 17408, dtype=BF16), down)
            groupwise_gemv_gluon.TAIL_SPLITS, groupwise_gemv_gluon.STAGES = 5, 2
            groupwise_gemv_gluon.q4_swiglu_linear(NormedRows(x, torch.rand(80, 8), 1e-6), gate_up)
        finally:
            (
                groupwise_gemv_gluon.WARP_SPECIALIZED,
                groupwise_gemv_gluon.TAIL_SPLITS,
                groupwise_gemv_gluon.STAGES,
            ) = held

    def gluon_q4_warp_specialized_norm_after() -> None:
        # the warp-specialized loop with the next norm folded in after it (`WS_NORM_AFTER`):
        # the 27B MLP down at eight rows (split over K, four slots) and the attention's out
        from ninfer.kernels import groupwise_gemv_gluon

        held = groupwise_gemv_gluon.WS_NORM_AFTER, groupwise_gemv_gluon.STAGES
        groupwise_gemv_gluon.WS_NORM_AFTER = True
        try:
            for stages, k in ((4, 17408), (3, 6144)):
                groupwise_gemv_gluon.STAGES = stages
                gluon_q4_folded(8, 5120, k)
        finally:
            groupwise_gemv_gluon.WS_NORM_AFTER, groupwise_gemv_gluon.STAGES = held

    def gluon_q4_narrow_codes() -> None:
        # the codes in one narrow box a tile (`WIDE_CODES` off; shipped on, which every other
        # Gluon case compiles): a plain product, one split over K, the SwiGLU with its tail split,
        # warp-specialized and in one partition, a folded norm after a split product, the GDN in
        # projection with its conv and gates, and a q6 head (its high bits in a narrow box too)
        from ninfer.kernels import groupwise_gemv_gluon

        held = groupwise_gemv_gluon.WIDE_CODES, groupwise_gemv_gluon.WARP_SPECIALIZED
        groupwise_gemv_gluon.WIDE_CODES = False
        try:
            gluon_q4(8, 34816, 5120)
            gluon_q4(3, 5120, 17408)
            for specialized in (True, False):
                groupwise_gemv_gluon.WARP_SPECIALIZED = specialized
                gluon_q4_tail(8, 34816, 5120, True)
            gluon_q4_folded(8, 5120, 17408)
            gluon_in_projection_with_conv_and_gates(True)
            gluon_q6(8, 248320, 5120)
        finally:
            groupwise_gemv_gluon.WIDE_CODES, groupwise_gemv_gluon.WARP_SPECIALIZED = held

    def gluon_q4_folded(m: int, n: int, k: int) -> None:
        # the producer's epilogue with the next norm, then a consumer taking its rows
        from ninfer.kernels import groupwise_gemv_gluon
        from ninfer.kernels.norm_fold import NormAfter

        weight = get_format(q4).encode(torch.randn(n, k) * 0.05)
        residual, norm = torch.randn(m, n, dtype=BF16), torch.randn(n, dtype=BF16)
        after = NormAfter(residual, norm, 1e-6)
        rows, _ = groupwise_gemv_gluon.q4_linear(torch.randn(m, k, dtype=BF16), weight, after)
        consumer = get_format(q4).encode(torch.randn(2 * k, n) * 0.05)
        groupwise_gemv_gluon.q4_linear(rows, consumer)
        groupwise_gemv_gluon.q4_swiglu_linear(rows, consumer)
        gdn_gates_triton.gdn_gates_from_x(
            rows, torch.randn(96, n, dtype=BF16), torch.randn(48), torch.randn(48)
        )

    def gdn_output_norm_folded() -> None:
        # the recurrent kernel writing the GDN output norm's parts, the out projection
        # taking them with the next norm folded in (27B, eight sequences)
        from ninfer.kernels import groupwise_gemv_gluon
        from ninfer.kernels.norm_fold import NormAfter

        t, hk, hv, dk, dv = 8, 16, 48, 128, 128
        q, k = torch.randn(t, hk, dk, dtype=BF16), torch.randn(t, hk, dk, dtype=BF16)
        v, z = torch.randn(t, hv, dv, dtype=BF16), torch.randn(t, hv, dv, dtype=BF16)
        g, beta = -torch.rand(t, hv), torch.rand(t, hv, dtype=BF16)
        states = torch.zeros(t, hv, dk, dv)
        slots, starts = torch.arange(t, dtype=torch.int32), torch.arange(t + 1, dtype=torch.int32)
        rows = gdn_recurrent_triton.recurrent_gated_delta_rule_normed(
            q, k, v, g, beta, states, slots, starts, z, torch.randn(dv, dtype=BF16), 1e-6
        )
        rows = type(rows)(torch.randn(t, hv * dv, dtype=BF16), rows.squares, dv, 1e-6)
        weight = get_format(q4).encode(torch.randn(5120, hv * dv) * 0.05)
        after = NormAfter(torch.randn(t, 5120, dtype=BF16), torch.randn(5120, dtype=BF16), 1e-6)
        groupwise_gemv_gluon.q4_linear(rows, weight, after)
        groupwise_gemv_gluon.q4_linear(rows, weight)

    def gluon_in_projection_with_conv_and_gates(folded: bool, token_shares: int = 2) -> None:
        # the 27B GDN in projection at eight sequences: the conv in its epilogue, the gates in
        # programs of its grid, x plain or a folded norm's rows
        from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv
        from ninfer.kernels.norm_fold import NormedRows

        t = 8
        weight = get_format(q4).encode(torch.randn(16384, 5120) * 0.02)
        conv = gluon_gemv.GdnConv(
            torch.randn(10240, 4, dtype=BF16),
            torch.randn(t, 10240, 3, dtype=BF16),
            torch.arange(t, dtype=torch.int32),
        )
        gates = gluon_gemv.GdnGates(
            torch.randn(96, 5120, dtype=BF16), torch.randn(48), torch.randn(48)
        )
        x = torch.randn(t, 5120, dtype=BF16)
        if folded:
            x = NormedRows(x, torch.rand(80, 8), 1e-6)
        held, gluon_gemv.GATE_TOKEN_SHARES = gluon_gemv.GATE_TOKEN_SHARES, token_shares
        try:
            gluon_gemv.q4_linear_conv(x, weight, conv, gates)
        finally:
            gluon_gemv.GATE_TOKEN_SHARES = held
        gluon_gemv.q4_linear_conv(x, weight, conv)

    def x_split_producers():
        x = torch.randn(1, 5120, dtype=BF16)
        rms_norm_triton.rms_norm(x, torch.randn(5120, dtype=BF16), 1e-6, x.clone(), split)
        row, router = torch.randn(1, 2048, dtype=BF16), torch.randn(257, 2048, dtype=BF16)
        norm_weight = torch.randn(2048, dtype=BF16)
        moe_router_triton.moe_norm_router_route(
            row, row.clone(), norm_weight, 1e-6, router, 256, 8, 0, 256, True, split
        )
        gate_up = torch.randn(1, 2 * 17408, dtype=BF16)
        swiglu_triton.silu_mul(gate_up[:, :17408], gate_up[:, 17408:], split)
        heads = torch.randn(1, 48, 128, dtype=BF16)
        gated_rms_norm_triton.gated_rms_norm(
            heads, heads, torch.randn(128, dtype=BF16), 1e-6, split
        )
        query_gate = torch.randn(1, 24, 512, dtype=BF16)
        output_gate_triton.sigmoid_gate(query_gate[..., :256], query_gate[..., 256:], split)

    def in_projection_with_the_conv():
        weight = get_format(q4).encode(torch.randn(16384, 5120) * 0.02)
        taps, windows = torch.randn(10240, 4, dtype=BF16), torch.randn(2, 10240, 3, dtype=BF16)
        slot = torch.tensor([1], dtype=torch.int32)
        groupwise_gemv_triton.integer_linear_conv(
            torch.randn(1, 5120, dtype=BF16), weight, taps, windows, slot
        )

    def integer_gemv_at_the_tuned_settings():
        """Every listed setting, in the forms a listed product may take: q4 with the conv
        inside and without, gathered (the experts' gate|up at nine pairs), and the q6 head's;
        then plain q4 at each stage count INT_TUNED_STAGES lists."""
        rule, stages_rule = groupwise_gemv_triton._int_config, groupwise_gemv_triton._int_stages
        tables = groupwise_gemv_triton.INT_TUNED.values()
        stage_tables = groupwise_gemv_triton.INT_TUNED_STAGES.values()
        head = get_format("q6_g64_fp16").encode(torch.randn(2048, 5120) * 0.02)
        try:
            for setting in sorted({setting for table in tables for setting in table.values()}):
                groupwise_gemv_triton._int_config = lambda *shape, setting=setting: setting
                in_projection_with_the_conv()
                groupwise_gemv_triton.integer_linear(torch.randn(1, 5120, dtype=BF16), head)
                # the check of outputs nothing wrote fails: the next setting still compiles
                with contextlib.suppress(AssertionError):
                    kc.check_groupwise_linear(
                        groupwise_gemv_triton, q4, 1, 2048, 5120, BF16, cpu, 1e-2
                    )
                with contextlib.suppress(AssertionError):
                    kc.check_grouped_groupwise_linear(
                        groupwise_gemv_triton, q4, 8, 1024, 2048, 1, 9, BF16, cpu, 1e-2
                    )
                for stages in sorted({n for table in stage_tables for n in table.values()}):
                    groupwise_gemv_triton._int_stages = lambda *shape, stages=stages: stages
                    with contextlib.suppress(AssertionError):
                        kc.check_groupwise_linear(
                            groupwise_gemv_triton, q4, 1, 2048, 5120, BF16, cpu, 1e-2
                        )
                    groupwise_gemv_triton._int_stages = stages_rule
        finally:
            groupwise_gemv_triton._int_config = rule
            groupwise_gemv_triton._int_stages = stages_rule

    def experts_down_with_the_swiglu():
        stacked = get_format(q4).encode(torch.randn(257 * 2048, 512) * 0.02)
        planes = {name: p.reshape(257, 2048, -1) for name, p in stacked.planes.items()}
        weight = EncodedTensor(stacked.format, stacked.layout, (257, 2048, 512), planes)
        pairs = torch.arange(9, dtype=torch.int32)
        gate_up = torch.randn(9, 1024, dtype=BF16)
        groupwise_gemv_triton.grouped_swiglu_linear(gate_up, weight, pairs, pairs)

    def gated_decode_attention():
        pages = torch.arange(8, dtype=torch.int32).reshape(1, 8)
        k_cache, v_cache = (torch.randn(8, 64, 4, 256, dtype=BF16) for _ in range(2))
        query_gate = torch.randn(1, 24, 512, dtype=BF16)
        lens = torch.tensor([300], dtype=torch.int32)
        paged_attention_triton.paged_attention_decode_gated(
            query_gate[..., :256].contiguous(),
            k_cache,
            v_cache,
            pages,
            lens,
            0.0625,
            query_gate[..., 256:],
            split,
            300,
        )

    def moe_routing():
        moe_routing_triton.moe_route(torch.randn(1, 256, dtype=BF16), 8, BF16, 0, 256, True)
        choices, shared = torch.randn(1, 8, 2048, dtype=BF16), torch.randn(1, 2048, dtype=BF16)
        weights, experts = torch.rand(1, 8, dtype=BF16), torch.randint(0, 256, (1, 8))
        gate = torch.randn(1, 1, dtype=BF16)
        moe_combine_triton.moe_combine(choices, weights, experts, 0, 256, shared, gate)

    return [
        ("paged decode attention", lambda: kc.check_paged_attention(
            paged_attention_triton, [1, 300], 24, 4, 256, BF16, cpu, 1e-2)),
        ("paged decode attention with the output gate", gated_decode_attention),
        # a run of several pages a program: the split kernel's loop
        ("paged decode attention, several pages a split", lambda: kc.check_paged_attention(
            paged_attention_triton, [1, 5000], 24, 4, 256, BF16, cpu, 1e-2)),
        ("paged prefill attention", lambda: kc.check_paged_prefill_attention(
            paged_attention_prefill_triton, [0, 40], [17, 64], 24, 4, 256, BF16, cpu, 1e-2)),
        ("kv write", lambda: kc.check_kv_write(kv_write_triton, 8, 4, 256, BF16, cpu)),
        ("rotary", lambda: kc.check_rotary(rotary_triton, 8, 24, 256, 64, BF16, cpu, 1e-2)),
        ("attention prelude", lambda: kc.check_attention_prelude(
            attention_prelude_triton, rms_norm_triton, rotary_triton, kv_write_triton,
            1, 24, 4, 256, 64, BF16, cpu, 1e-2)),
        ("gdn recurrent", lambda: kc.check_gdn_recurrent(
            gdn_recurrent_triton, [1, 2], 16, 48, 128, 128, BF16, cpu, 1e-2)),
        ("gdn recurrent, eight sequences, output norm folded", lambda:
            kc.check_gdn_recurrent_normed(
                gdn_recurrent_triton, [1] * 8, 16, 48, 128, 128, BF16, cpu)),
        ("gdn recurrent with the gates", lambda: kc.check_gdn_recurrent_from_x(
            gdn_recurrent_triton, gdn_gates_triton, [1], 16, 48, 128, 128, 5120, BF16, cpu,
            1e-2)),
        ("gdn recurrent with the gates and the output norm", lambda:
            kc.check_gdn_recurrent_from_x_normed(
                gdn_recurrent_triton, gated_rms_norm_triton, 16, 48, 128, 128, 5120,
                split, BF16, cpu)),
        ("gdn gates", lambda: kc.check_gdn_gates(gdn_gates_triton, 8, 48, BF16, cpu, 2e-5, 1)),
        ("gdn gates from x", lambda: kc.check_gdn_gates_from_x(
            gdn_gates_triton, 8, 48, 5120, BF16, cpu, 2e-5, 1)),
        ("causal conv, decode", lambda: kc.check_causal_conv1d(
            causal_conv1d_triton, [1], 10240, 4, BF16, cpu, 1e-2)),
        ("causal conv, prefill", lambda: kc.check_causal_conv1d(
            causal_conv1d_triton, [100, 3], 10240, 4, BF16, cpu, 1e-2)),
        ("causal conv and gates, decode", lambda: kc.check_causal_conv1d_and_gates(
            causal_conv1d_triton, gdn_gates_triton, [1] * 8, 10240, 48, 5120, BF16, cpu)),
        ("rms norm", lambda: kc.check_rms_norm(rms_norm_triton, 4, 5120, BF16, cpu, 1e-2, False)),
        ("gated rms norm", lambda: kc.check_gated_rms_norm(
            gated_rms_norm_triton, 2, 48, 128, BF16, cpu, 1e-2)),
        ("swiglu", lambda: kc.check_silu_mul(swiglu_triton, 8, 17408, BF16, cpu, 1e-2)),
        ("x split by its producers", x_split_producers),
        ("integer gemv q4", lambda: kc.check_groupwise_linear(
            groupwise_gemv_triton, q4, 1, 2048, 5120, BF16, cpu, 1e-2)),
        ("integer gemv q8", lambda: kc.check_groupwise_linear(
            groupwise_gemv_triton, q8, 1, 2048, 5120, BF16, cpu, 1e-2)),
        ("integer gemv q6 (planes read as stored)", lambda: kc.check_groupwise_linear(
            types.SimpleNamespace(groupwise_linear=groupwise_gemv_triton.integer_linear),
            "q6_g64_fp16", 1, 2048, 5120, BF16, cpu, 1e-2)),
        ("tensor-core gemv q4, split-K", lambda: kc.check_groupwise_linear(
            groupwise_gemv_triton, q4, 8, 512, 17408, BF16, cpu, 1e-2)),
        ("tensor-core gemv q4 in gluon", lambda: gluon_q4(8, 34816, 5120)),
        ("tensor-core gemv q4 in gluon, split-K", lambda: gluon_q4(3, 5120, 17408)),
        ("tensor-core gemv q4 in gluon, swiglu", lambda: gluon_q4_swiglu(8, 34816, 5120)),
        ("tensor-core gemv q4 in gluon, swiglu, tail split",
            lambda: gluon_q4_tail(8, 34816, 5120, True)),
        ("tensor-core gemv q4 in gluon, tail split", lambda: gluon_q4_tail(8, 34816, 5120, False)),
        ("tensor-core gemv q4 in gluon, warp-specialized", gluon_q4_warp_specialized),
        ("tensor-core gemv q4 in gluon, codes in narrow boxes", gluon_q4_narrow_codes),
        ("tensor-core gemv q4 in gluon, warp-specialized, norm folded after",
            gluon_q4_warp_specialized_norm_after),
        ("tensor-core gemv q6 in gluon", lambda: gluon_q6(8, 248320, 5120)),
        ("tensor-core gemv q4 in gluon, norm folded", lambda: gluon_q4_folded(8, 5120, 6144)),
        ("tensor-core gemv q4 in gluon, norm folded, split-K",
            lambda: gluon_q4_folded(8, 5120, 17408)),
        ("gdn output norm folded", gdn_output_norm_folded),
        ("gdn in projection in gluon with the conv and gates",
            lambda: gluon_in_projection_with_conv_and_gates(False)),
        ("gdn in projection in gluon with the conv and gates, norm folded",
            lambda: gluon_in_projection_with_conv_and_gates(True)),
        ("gdn in projection in gluon with the conv and gates, gates in one token share",
            lambda: gluon_in_projection_with_conv_and_gates(False, 1)),
        ("tensor-core gemv q8", lambda: kc.check_groupwise_linear(
            groupwise_gemv_triton, q8, 8, 34816, 5120, BF16, cpu, 1e-2)),
        ("integer gemv with the conv", in_projection_with_the_conv),
        ("integer gemv at the tuned settings", integer_gemv_at_the_tuned_settings),
        ("grouped gemv with the swiglu", experts_down_with_the_swiglu),
        ("grouped gemv with the swiglu and the combine", lambda: kc.check_swiglu_combine(
            groupwise_gemv_triton, moe_combine_triton, q4, 32, 2048, 512, 8, BF16, cpu)),
        ("grouped gemv", lambda: kc.check_grouped_groupwise_linear(
            groupwise_gemv_triton, q4, 8, 1024, 2048, 1, 9, BF16, cpu, 1e-2)),
        ("dequantization", lambda: kc.check_groupwise_dequant(
            groupwise_dequant_triton, q4, 512, 5120, BF16, cpu)),
        ("moe routing and combine", moe_routing),
        ("moe router with the routing", lambda: kc.check_moe_router_route(
            moe_router_triton, moe_routing_triton, 1, 256, 8, 2048, True, (0, 256), True,
            BF16, cpu)),
        ("moe router with the norm inside", lambda: kc.check_moe_norm_router_route(
            moe_router_triton, rms_norm_triton, moe_routing_triton.moe_route, 1, 256, 8, 2048,
            (0, 256), True, BF16, cpu)),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", type=int, default=90, help="compute capability, 90 = sm_90")
    parser.add_argument("-k", dest="only", help="only the cases whose name contains this")
    parser.add_argument("--sass", action="store_true", help="a line of SASS figures per kernel")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, compiling for sm_{args.capability}")
    # no GPU driver can load here, so this process never has another
    driver.set_active(CompileOnlyDriver(args.capability))
    failed = 0
    for name, call in cases():
        if args.only and args.only not in name:
            continue
        compiled: list = []
        with compile_only(compiled):
            try:
                torch.manual_seed(0)
                call()
                outcome = "ok"
            except KernelDidNotCompile as error:
                failed += 1
                outcome = f"FAILED {error}"
            except AssertionError:  # the case's checks of outputs that nothing wrote
                outcome = "ok"
            except Exception as error:  # the case itself is out of date
                failed += 1
                outcome = f"NOT DRIVEN {type(error).__name__}: {error}"
                traceback.print_exc()
        kernels = ", ".join(sorted({kernel_name for kernel_name, _ in compiled})) or "none"
        print(f"{outcome.splitlines()[0][:300]:<8} {name}: {kernels}")
        if args.sass:
            seen = set()
            for kernel_name, kernel in compiled:
                cubin = kernel.asm.get("cubin")
                if cubin is None or cubin in seen:
                    continue
                seen.add(cubin)
                shared = getattr(kernel.metadata, "shared", 0)
                line = f"{sass_summary(cubin)}, shared memory {shared} B"
                registers = re.match(r"registers (\d+)", line)
                if args.capability == 90 and registers:
                    warps = kernel.metadata.num_warps
                    count, bound = programs_per_sm(shared, int(registers.group(1)), warps)
                    line += f", {count} programs an SM ({bound})"
                print(f"         {kernel_name}: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

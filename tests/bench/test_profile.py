"""`ninfer bench --profile` on the CPU: each ninfer row gets the kernels of its timed steps (the
table's indented block, the JSON's `profile` fields) with times that add up; without the flag
the report is as before. Kernel names fall into their categories by the pattern list."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from ninfer.bench.cases import BenchCase, Row
from ninfer.bench.profile import TOP_KERNELS, category, trim_name
from ninfer.bench.shapes import SHAPES
from ninfer.bench.targets import NinferTarget, random_model
from ninfer.cli.main import main

TINY = ("--shape", "tiny", "--device", "cpu", "-r", "1", "--warmup", "0")


def bench_json(capsys, *argv: str) -> dict:
    assert main(["bench", *TINY, *argv, "-o", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_rows_carry_kernels_whose_times_add_up(capsys):
    report = bench_json(capsys, "-p", "8", "-n", "4", "-pg", "6,3", "--profile")
    rows = {row["test"]: row for row in report["rows"]}
    assert list(rows) == ["pp8", "tg4", "pp6+tg3"]
    for row in rows.values():
        kernels = row["profile"]
        assert kernels and row["profile_device_ms"] > 0
        assert all(k["calls"] >= 1 and k["total_ms"] >= 0 for k in kernels)
        assert [k["total_ms"] for k in kernels] == sorted(
            (k["total_ms"] for k in kernels), reverse=True
        )
        assert sum(k["total_ms"] for k in kernels) == pytest.approx(row["profile_device_ms"])
        assert sum(k["share"] for k in kernels) == pytest.approx(1.0)
        assert sum(row["profile_categories"].values()) == pytest.approx(row["profile_device_ms"])
    tg = rows["tg4"]
    assert tg["profile_decode_steps"] == 4
    assert all(k["step_ms"] == pytest.approx(k["total_ms"] / 4) for k in tg["profile"])
    assert all(k["step_ms"] is None for k in rows["pp8"]["profile"] + rows["pp6+tg3"]["profile"])
    assert rows["pp8"]["profile_decode_steps"] is None

    # Every step runs each linear once: pp8 is one prefill step, tg4 four decode steps (its
    # one-token prefill is not the test, so not profiled), pp6+tg3 one prefill and three decodes.
    def matmuls(test: str) -> int:
        return next(k["calls"] for k in rows[test]["profile"] if k["name"] == "aten::mm")

    assert matmuls("tg4") == 4 * matmuls("pp8")
    assert matmuls("pp6+tg3") == 4 * matmuls("pp8")
    assert rows["pp8"]["profile_categories"]["matmul"] > 0


def test_table_prints_the_profile_under_each_row(capsys):
    assert main(["bench", *TINY, "-p", "8", "-n", "4", "--profile"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for test, steps in (("pp8", None), ("tg4", 4)):
        at = next(
            i for i, line in enumerate(lines) if line.startswith("ninfer") and f" {test} " in line
        )
        head, by_category, columns = lines[at + 1 : at + 4]
        assert head.startswith("    profile (CUDA graphs off): ")
        assert (f"in {steps} decode steps" in head) == (steps is not None)
        assert by_category.startswith("    by category: ") and "matmul" in by_category
        assert columns.split() == ["calls", "total", "ms", "share", "us/step", "kernel"]
        block = []
        for line in lines[at + 4 :]:
            if not line.startswith("    "):
                break
            block.append(line.split())
        assert 1 <= len(block) <= TOP_KERNELS
        assert all(int(calls) >= 1 and float(ms) >= 0 for calls, ms, *_ in block)
        assert any(cells[-1] == "aten::mm" for cells in block)
        per_step = [cells[3] for cells in block]
        assert all(p != "-" for p in per_step) if steps else all(p == "-" for p in per_step)


def test_without_the_flag_rows_have_no_profile(capsys):
    report = bench_json(capsys, "-n", "2")
    assert set(report["rows"][0]) == {f.name for f in fields(Row)}
    assert main(["bench", *TINY, "-n", "2"]) == 0
    assert "profile" not in capsys.readouterr().out


def test_profiling_switches_graphs_off_for_the_run_only():
    model = random_model(SHAPES["tiny"], torch.device("cpu"), torch.float32)
    target = NinferTarget(model, [BenchCase("tg", 1, 2, 1)], prefill_chunk=64)
    graphs = object()  # stands in for captured CUDA graphs, which the CPU has none of
    target.recorder.runner.graphs = graphs
    with target.profiling():
        assert target.recorder.runner.graphs is None and target.recorder.label_steps
    assert target.recorder.runner.graphs is graphs and not target.recorder.label_steps


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_groupwise_gemv_kernel", "gemv"),
        ("_groupwise_gemv_int_kernel", "gemv"),
        ("_q4_tc_kernel", "gemv"),  # the Gluon product
        ("_quantize_x_kernel", "gemv"),  # the integer GEMV's x split
        ("nvjet_tst_128x64_64x8_1x1_v_bz_coopB_NNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        (
            "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)",
            "matmul",
        ),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16>(Params)", "matmul"),
        ("aten::mm", "matmul"),
        ("_decode_split_kernel", "attention"),
        ("_prefill_kernel", "attention"),
        ("_write_kernel", "attention"),
        ("_attention_prelude_kernel", "attention"),
        ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
        ("solve_tril_16x16_kernel", "gdn"),
        ("_recurrent_kernel", "gdn"),
        ("_causal_conv1d_kernel", "conv"),
        ("_conv_and_gates_kernel", "conv"),
        ("_gdn_gates_from_x_kernel", "gdn"),
        ("_moe_router_route_kernel", "moe"),
        ("_moe_combine_kernel", "moe"),
        ("_gated_rms_norm_kernel", "norm"),
        ("_rms_norm_kernel", "norm"),
        ("Memcpy HtoD (Pageable -> Device)", "copy"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>(int)",
            "other",
        ),
        ("_rotary_kernel", "other"),
    ],
)
def test_kernel_names_fall_into_their_category(name, expected):
    assert category(name) == expected


def test_trimmed_names_lose_the_void_and_the_parameter_list_only():
    assert (
        trim_name("void foo::bar<(anonymous)::Op<float>, 4>(int, float*)")
        == "foo::bar<(anonymous)::Op<float>, 4>"
    )
    assert trim_name("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"
    assert trim_name("_groupwise_gemv_kernel") == "_groupwise_gemv_kernel"

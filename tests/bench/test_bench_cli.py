"""`ninfer bench` end to end on the CPU: tiny shapes with random weights, a tiny `.ninfer`
file, the transformers peer, and the rows' bookkeeping (steps counted, ratios, tokens)."""

from __future__ import annotations

import json

import pytest

from ninfer.bench.cases import (
    BenchCase,
    Ceilings,
    StepRecord,
    host_time,
    make_cases,
    summarize,
)
from ninfer.bench.shapes import SHAPES
from ninfer.bench.traffic import Traffic, profile_formats
from ninfer.cli.main import main


def run_json(capsys, *argv: str) -> dict:
    assert main(["bench", *argv, "-o", "json", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_shape_reports_every_case_with_its_ratio(capsys):
    report = run_json(
        capsys,
        *("--shape", "tiny", "--weights", "q8", "-p", "8", "-n", "4", "-pg", "6,3"),
        *("-r", "2", "--warmup", "0", "--concurrency", "1,2"),
    )
    tests = [(row["test"], row["concurrency"]) for row in report["rows"]]
    assert tests == [
        ("pp8", 1),
        ("pp8", 2),
        ("tg4", 1),
        ("tg4", 2),
        ("pp6+tg3", 1),
        ("pp6+tg3", 2),
    ]
    for row in report["rows"]:
        assert row["engine"] == "ninfer" and row["weights"] == "q8"
        assert row["tokens_per_s"] > 0 and 0 < row["speed_of_light"] < 1
        assert row["repetitions"] == 2
    assert report["ceilings"]["copy_bytes_per_s"] > 0
    assert report["ceilings"]["matmul_flops_per_s"] > 0
    assert report["stored_weight_bytes"]["q8_g32_fp16"] > 0
    by_test = {(row["test"], row["concurrency"]): row for row in report["rows"]}
    assert by_test[("pp8", 1)]["decode_step_ms"] is None
    assert by_test[("tg4", 1)]["prefill_flops_per_s"] is None
    # the CPU has no device clock to split a step into host and device time
    assert all(row["decode_host_ms"] is None for row in report["rows"])
    assert all(row["decode_host_share"] is None for row in report["rows"])
    # two sequences read more state and KV per step than one
    assert (
        by_test[("tg4", 2)]["decode_bytes_per_step"] > by_test[("tg4", 1)]["decode_bytes_per_step"]
    )


def test_bf16_states_are_run_and_counted_at_two_bytes(capsys):
    """`--gdn-state-dtype bfloat16`: the engine holds bf16 states, and a decode step's bytes
    count the state read and written at two bytes a value instead of four."""
    argv = ("--shape", "tiny", "-n", "3", "-r", "1", "--warmup", "0")
    rows = {}
    for state in ("float32", "bfloat16"):
        report = run_json(capsys, *argv, "--gdn-state-dtype", state)
        assert report["gdn_state_dtype"] == state
        rows[state] = report["rows"][0]
    traffic = Traffic(SHAPES["tiny"], profile_formats(SHAPES["tiny"], "q4"), kv_itemsize=4)
    halved = traffic.state_bytes_per_sequence()  # fp32 state read + written, halved
    assert (
        rows["float32"]["decode_bytes_per_step"] - rows["bfloat16"]["decode_bytes_per_step"]
        == halved
    )
    with pytest.raises(SystemExit):  # argparse's one-line choice error
        main(["bench", *argv, "--gdn-state-dtype", "float16"])


def test_the_benched_engine_holds_the_state_in_the_dtype_asked_for():
    import torch

    from ninfer.bench.targets import NinferTarget, random_model

    model = random_model(SHAPES["tiny"], torch.device("cpu"), torch.float32)
    case = BenchCase("tg", 1, 2, 1)
    target = NinferTarget(model, [case], prefill_chunk=64, gdn_state_dtype="bfloat16")
    assert all(state.dtype == torch.bfloat16 for state in target.core.cache.gdn_state)


def test_table_output_on_a_moe_shape(capsys):
    argv = ["bench", "--shape", "tiny-moe", "-n", "3", "-r", "1", "--warmup", "0"]
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ceilings  copy" in out
    assert "tg3" in out and "copy" in out
    header = next(line for line in out.splitlines() if line.startswith("engine"))
    row = next(line for line in out.splitlines() if " tg3 " in line)
    assert "host ms" in header and "host%" in header
    # step ms, host ms, host share: the CPU row shows a step time and no host split
    step, host, share = row.split()[8:11]
    assert float(step) > 0 and (host, share) == ("-", "-")


def test_each_row_reaches_stderr_as_soon_as_it_is_timed(capsys, monkeypatch):
    """A run cut short (a time limit) must still have shown the rows it finished: each row is
    printed to stderr when timed, before the next case runs; the report stays on stdout."""
    from ninfer.bench import run as bench_run

    seen_before_second_case = []
    real = bench_run.summarize

    def watching(*args, **kwargs):
        seen_before_second_case.append(capsys.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_run, "summarize", watching)
    argv = ["bench", "--shape", "tiny", "-p", "4", "-n", "2", "-r", "1", "--warmup", "0"]
    assert main([*argv, "--device", "cpu", "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert " pp4 " in seen_before_second_case[1]  # printed before tg2 was summarized
    assert " tg2 " in captured.err
    assert json.loads(captured.out)["rows"][1]["test"] == "tg2"


def test_a_ninfer_file_is_benched_with_its_stored_formats(capsys, tiny_artifact):
    _, artifact_path = tiny_artifact(weights="groupwise-int")
    report = run_json(capsys, str(artifact_path), "-n", "2", "-r", "1", "--warmup", "0")
    assert report["rows"][0]["weights"] == "artifact"
    assert "q4_g64_fp16" in report["stored_weight_bytes"]


def test_hf_peer_rows_follow_ours(capsys):
    pytest.importorskip("transformers")
    report = run_json(
        capsys, "--shape", "tiny", "-p", "4", "-n", "2", "-r", "1", "--warmup", "0", "--peer", "hf"
    )
    assert [(r["engine"], r["test"]) for r in report["rows"]] == [
        ("ninfer", "pp4"),
        ("ninfer", "tg2"),
        ("hf", "pp4"),
        ("hf", "tg2"),
    ]
    assert all(r["weights"] == "fp32" for r in report["rows"] if r["engine"] == "hf")


def test_a_file_or_a_shape_is_required(capsys):
    assert main(["bench", "-n", "2"]) == 1
    assert "--shape" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--device", "tpu"), "device 'tpu': give cpu, cuda or cuda:N"),
        (("--device", "meta"), "device 'meta': give cpu, cuda or cuda:N"),
        (("--output-file", "."), "--output-file . is a directory"),
        (("--output-file", "no/such/folder/b.json"), "no directory no/such/folder"),
    ],
)
def test_a_bad_device_or_output_file_is_one_line_before_anything_runs(
    capsys, monkeypatch, extra, message
):
    from ninfer.bench import run as bench_run

    ran = []
    monkeypatch.setattr(bench_run, "_time_cases", lambda *a, **k: ran.append(1))
    assert main(["bench", "--shape", "tiny", "-n", "2", *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not ran


def test_rows_count_decode_steps_for_tg_and_prefill_steps_for_pp():
    traffic = Traffic(SHAPES["tiny"], profile_formats(SHAPES["tiny"], "bf16"))
    ceilings = Ceilings(copy_bytes_per_s=1e9, matmul_flops_per_s=1e9, matmul_dtype="float32")
    prefill = StepRecord(False, (0, 0), (1, 1), (True, True), 1.0)
    decodes = [StepRecord(True, (1 + i, 1 + i), (1, 1), (True, True), 0.5) for i in range(4)]
    tg = summarize(
        "ninfer", "bf16", BenchCase("tg", 1, 4, 2), [[prefill, *decodes]], traffic, ceilings
    )
    assert tg.tokens_per_s == pytest.approx(2 * 4 / 2.0)  # 8 tokens over the 4 decode steps
    floor = sum(traffic.decode_bytes(s.context_lens).total for s in decodes) / 1e9
    assert tg.speed_of_light == pytest.approx(floor / 2.0)
    assert tg.decode_step_ms == pytest.approx(500.0)
    pg = summarize(
        "ninfer", "bf16", BenchCase("pg", 1, 4, 2), [[prefill, *decodes]], traffic, ceilings
    )
    assert pg.tokens_per_s == pytest.approx(2 * 5 / 3.0)
    flops = traffic.prefill_flops((0, 0), (1, 1), (True, True))
    assert pg.speed_of_light == pytest.approx((floor + flops / 1e9) / 3.0)


def test_host_time_is_the_step_minus_its_device_time():
    def decode(seconds, device_seconds):
        return StepRecord(True, (1,), (1,), (True,), seconds, device_seconds)

    steps = [decode(0.010, 0.009), decode(0.012, 0.010), decode(0.014, 0.014)]
    host, share = host_time(steps)
    assert host == pytest.approx((0.001 + 0.002 + 0.0) / 3)
    assert share == pytest.approx(0.003 / 0.036)
    assert host_time([decode(0.010, 0.009), decode(0.010, None)]) is None
    assert host_time([]) is None


def test_rows_report_host_time_of_decode_steps_only():
    traffic = Traffic(SHAPES["tiny"], profile_formats(SHAPES["tiny"], "bf16"))
    ceilings = Ceilings(copy_bytes_per_s=1e9, matmul_flops_per_s=1e9, matmul_dtype="float32")
    prefill = StepRecord(False, (0,), (6,), (True,), 0.030)
    decodes = [StepRecord(True, (6 + i,), (1,), (True,), 0.020, 0.018) for i in range(3)]
    pg = summarize(
        "ninfer", "bf16", BenchCase("pg", 6, 3, 1), [[prefill, *decodes]] * 2, traffic, ceilings
    )
    assert pg.decode_step_ms == pytest.approx(20.0)
    assert pg.decode_host_ms == pytest.approx(2.0)
    assert pg.decode_host_share == pytest.approx(0.1)
    pp = summarize("ninfer", "bf16", BenchCase("pp", 6, 0, 1), [[prefill]], traffic, ceilings)
    assert pp.decode_host_ms is None and pp.decode_host_share is None


def test_make_cases_crosses_tests_with_concurrency():
    cases = make_cases([512, 4096], [128], [(2048, 128)], [1, 8])
    assert [(c.label, c.concurrency) for c in cases] == [
        ("pp512", 1),
        ("pp512", 8),
        ("pp4096", 1),
        ("pp4096", 8),
        ("tg128", 1),
        ("tg128", 8),
        ("pp2048+tg128", 1),
        ("pp2048+tg128", 8),
    ]


def test_two_ranks_report_rows_per_gpu(capsys):
    argv = ("--shape", "tiny", "--weights", "bf16", "-n", "4", "-r", "1", "--warmup", "0")
    one = run_json(capsys, *argv)
    two = run_json(capsys, *argv, "--tensor-parallel", "2")
    assert (one["tensor_parallel"], two["tensor_parallel"]) == (1, 2)
    assert [r["engine"] for r in two["rows"]] == ["ninfer-tp2"]
    # the same bytes per step over two GPUs' bandwidth
    assert two["rows"][0]["decode_bytes_per_step"] == one["rows"][0]["decode_bytes_per_step"]
    assert 0 < two["rows"][0]["speed_of_light"] < 1
    assert two["executed_weights"] == "float32"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--weights", "bf16", "--profile"), "--profile"),
        (("--weights", "bf16", "--expert-parallel"), "--expert-parallel"),
    ],
)
def test_a_split_the_bench_cannot_time_is_refused(capsys, extra, message):
    argv = ["bench", "--shape", "tiny", "-n", "2", "--device", "cpu", *extra]
    assert main([*argv, "--tensor-parallel", "2" if "--expert-parallel" not in extra else "1"]) == 1
    assert message in capsys.readouterr().err


def test_the_floor_of_a_split_step_is_shared_by_its_ranks():
    config = SHAPES["tiny"]
    traffic = Traffic(config, profile_formats(config, "bf16"), kv_itemsize=4, conv_itemsize=4)
    ceilings = Ceilings(1e9, 1e12, "float32")
    case = BenchCase("tg", prompt=1, gen=2, concurrency=1)
    steps = [StepRecord(True, (1,), (1,), (True,), 0.01) for _ in range(2)]
    one = summarize("ninfer", "bf16", case, [steps], traffic, ceilings)
    two = summarize("ninfer", "bf16", case, [steps], traffic, ceilings, ranks=2)
    assert two.speed_of_light == pytest.approx(one.speed_of_light / 2)


def test_experts_split_by_rows_are_counted_in_the_dense_dtype_they_run_in():
    from ninfer.bench.run import _as_run

    stored = profile_formats(SHAPES["tiny-moe"], "q4")
    name = "text/layers.0.mlp.experts.gate_up_proj"
    shared = "text/layers.0.mlp.shared_expert.up_proj.weight"
    split = _as_run(stored, 2, False, "bf16")
    assert split(name, (4, 64, 64)) == "bf16"
    assert split(shared, (32, 64)) == stored(shared, (32, 64))
    assert _as_run(stored, 2, True, "bf16")(name, (4, 64, 64)) == stored(name, (4, 64, 64))

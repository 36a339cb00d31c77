"""The Triton kernels run by Triton's CPU interpreter on tiny shapes, against the torch
references (tests/triton_interpreter.py says when the interpreter runs and why half precision
is fp16 here: the norm, whose residual sum must match exactly, and the dequantization too)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import (
    check_causal_conv1d,
    check_causal_conv1d_and_gates,
    check_gated_rms_norm,
    check_gdn_recurrent,
    check_groupwise_dequant,
    check_groupwise_linear,
    check_integer_gemv_at_extreme_q4_codes,
    check_kv_write,
    check_paged_attention,
    check_paged_prefill_attention,
    check_rms_norm,
    check_rotary,
    check_silu_mul,
    gdn_inputs,
    query_start_of,
    relative_error,
)
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels import causal_conv1d as conv_reference
from ninfer.kernels import gated_rms_norm as gated_norm_reference
from ninfer.kernels import gdn_gates as gates_reference
from ninfer.quant import EncodedTensor, get_format
from ninfer.quant.groupwise import widen_to_q8

require_interpreter()


@pytest.fixture
def interpreted():
    torch.manual_seed(0)
    return load_kernel_module


def record_launches(monkeypatch, module, kernel_name: str, constant: str) -> list:
    """Launches of `module.<kernel_name>` run as before, each noting the value of its launch
    constant or option `constant` (None where not given) in the list returned."""
    launches = []
    kernel = getattr(module, kernel_name)

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs.get(constant))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, kernel_name, Recording())
    return launches


def test_paged_decode_attention_matches_reference(interpreted):
    module = interpreted("paged_attention_triton")
    check_paged_attention(module, [1, 70, 200], 4, 2, 32, torch.float16, "cpu", 2e-3)


@pytest.mark.parametrize(
    ("dtype", "state_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_gdn_recurrent_matches_reference_and_updates_slots(interpreted, dtype, state_dtype):
    module = interpreted("gdn_recurrent_triton")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    check_gdn_recurrent(module, [1, 3, 1], 2, 4, 16, 32, dtype, "cpu", tol, state_dtype)


@pytest.mark.parametrize(("query_lens", "first"), [([1], True), ([3], True), ([1, 1], False)])
def test_gdn_recurrent_reads_the_state_before_the_wait_at_one_sequence_only(
    interpreted, monkeypatch, query_lens, first
):
    """`STATE_FIRST_MAX_SEQS`: the kernel is launched with its state read before the wait
    (`pdl_triton.READ_BEFORE_WAIT`) where it runs one sequence, whatever its tokens, and with
    the wait first above that (slower at eight sequences on the GPU machine)."""
    module = interpreted("gdn_recurrent_triton")
    launches = record_launches(monkeypatch, module, "_recurrent_kernel", "STATE_FIRST")
    q, k, v, g, beta, states, slots, query_start = gdn_inputs(
        query_lens, 2, 4, 16, 32, torch.float32, "cpu", 1.0
    )
    module.recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, query_start)
    assert launches == [first]


@pytest.mark.parametrize(("query_lens", "several"), [([1], False), ([3], False), ([1, 1], True)])
def test_gdn_recurrent_takes_its_several_sequence_setting(
    interpreted, monkeypatch, query_lens, several
):
    """`SEQS_SETTING`: at several sequences the kernel launches at its warps and register
    cap, at one sequence as before (uncapped, its programs at 27B fit in one wave)."""
    module = interpreted("gdn_recurrent_triton")
    monkeypatch.setattr(module, "SEQS_SETTING", (64, 2, 160))
    launches = record_launches(monkeypatch, module, "_recurrent_kernel", "num_warps")
    caps = record_launches(monkeypatch, module, "_recurrent_kernel", "maxnreg")
    q, k, v, g, beta, states, slots, query_start = gdn_inputs(
        query_lens, 2, 4, 16, 32, torch.float32, "cpu", 1.0
    )
    module.recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, query_start)
    assert launches == [2 if several else module.RECURRENT_WARPS]
    assert caps == ([160] if several else [None])


def test_causal_conv1d_prefill_and_decode_update_windows(interpreted):
    module = interpreted("causal_conv1d_triton")
    check_causal_conv1d(module, [1, 2, 19], 40, 4, torch.bfloat16, "cpu", 1e-2)
    check_causal_conv1d(module, [1, 1, 1], 40, 4, torch.float32, "cpu", 1e-5)


@pytest.mark.parametrize(
    ("query_lens", "dtype", "tol"),
    [
        ([23], torch.float32, 1e-5),
        ([2, 30, 1, 5, 1, 9], torch.float32, 1e-5),
        ([3, 6, 3, 5], torch.float32, 1e-5),
        ([1, 1, 13, 2], torch.bfloat16, 1e-2),
    ],
)
def test_causal_conv1d_spreads_sequences_over_spans(interpreted, query_lens, dtype, tol):
    """Spans of 4 tokens: several per sequence, sequences shorter than K - 1 continuing from
    their window beside much longer ones, more programs than spans where lengths leave room,
    and each program's search for its span scanning the sequences two at a time."""
    module = interpreted("causal_conv1d_triton")
    module.SPAN, module.SEARCH_BLOCK = 4, 2
    check_causal_conv1d(module, query_lens, 40, 4, dtype, "cpu", tol)


@pytest.mark.parametrize(
    "query_lens", [[1, 1, 1], [1, 2, 19], [70]], ids=["decode", "mixed", "two spans"]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_conv_and_gates_in_one_launch_match_the_two_kernels(interpreted, query_lens, dtype):
    """Conv programs first, then the gates' (token, b|a row) programs, in one grid: a decode
    step, a mixed batch and a prompt over two spans (channels over two blocks, hidden over
    two column blocks of the gates' dot products)."""
    check_causal_conv1d_and_gates(
        interpreted("causal_conv1d_triton"),
        interpreted("gdn_gates_triton"),
        query_lens,
        300,
        3,
        1100,
        dtype,
        "cpu",
    )


def test_conv_and_gates_reference_and_dispatch_are_the_two_references():
    from ninfer.kernels import dispatch

    check_causal_conv1d_and_gates(
        conv_reference, gates_reference, [1, 3], 24, 2, 40, torch.float32, "cpu"
    )
    check_causal_conv1d_and_gates(
        dispatch, gates_reference, [1, 3], 24, 2, 40, torch.float32, "cpu"
    )


def test_causal_conv1d_continues_a_prompt_split_across_calls(interpreted):
    """Two prefill chunks then a decode token, each call continuing from the windows the one
    before left: the outputs and windows of the reference over each whole prompt at once."""
    module = interpreted("causal_conv1d_triton")
    module.SPAN = 4
    channels, width = 24, 4
    calls = [[2, 11], [9, 1], [1, 1]]  # tokens of each of the two sequences per call
    lens = [sum(call[i] for call in calls) for i in range(2)]
    xs = [torch.randn(n, channels) for n in lens]
    weight = torch.randn(channels, width) / width**0.5
    windows = torch.randn(5, channels, width - 1)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    ref_windows = windows.clone()
    ref = conv_reference.causal_conv1d(
        torch.cat(xs), weight, ref_windows, slots, query_start_of(lens, "cpu")
    )
    done = [0, 0]
    outs: list[list[torch.Tensor]] = [[], []]
    for call in calls:
        x = torch.cat([xs[i][done[i] : done[i] + n] for i, n in enumerate(call)])
        out = module.causal_conv1d(x, weight, windows, slots, query_start_of(call, "cpu"))
        for i, piece in enumerate(out.split(call)):
            outs[i].append(piece)
            done[i] += call[i]
    assert torch.allclose(torch.cat(outs[0] + outs[1]), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(windows, ref_windows)


@pytest.mark.parametrize("strided", [False, True])
def test_rms_norm_with_and_without_residual(interpreted, strided):
    module = interpreted("rms_norm_triton")
    check_rms_norm(module, 5, 48, torch.float16, "cpu", 2e-3, strided)


@pytest.mark.parametrize("dim", [128, 20])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(torch.float32, 1e-6, id="fp32"),
        pytest.param(torch.float16, torch.finfo(torch.float16).eps, id="fp16"),
    ],
)
def test_gated_rms_norm_matches_reference(interpreted, dim, dtype, tol):
    """35 rows: two full blocks of 16 rows at dim 128 and a partial third; one partial block of
    64 at dim 20 (padded to 32 columns)."""
    module = interpreted("gated_rms_norm_triton")
    check_gated_rms_norm(module, 5, 7, dim, dtype, "cpu", tol)


def test_gated_rms_norm_takes_rows_without_unit_stride_and_flat_rows(interpreted):
    """x with heads and dims transposed (copied to unit stride by the launcher) and a plain
    [rows, dim] pair (one token of `rows` heads) give the reference's values."""
    module = interpreted("gated_rms_norm_triton")
    weight = torch.randn(24)
    x = torch.randn(3, 24, 5).transpose(1, 2)
    z = torch.randn(3, 5, 24)
    out = module.gated_rms_norm(x, z, weight, 1e-6)
    assert torch.allclose(out, gated_norm_reference.gated_rms_norm(x, z, weight, 1e-6), atol=1e-6)
    x, z = torch.randn(9, 24), torch.randn(9, 24)
    out = module.gated_rms_norm(x, z, weight, 1e-6)
    assert torch.allclose(out, gated_norm_reference.gated_rms_norm(x, z, weight, 1e-6), atol=1e-6)


@pytest.mark.parametrize(("format_name", "k"), [("q8_g32_fp16", 200), ("q4_g64_fp16", 300)])
@pytest.mark.parametrize("m", [3, 20])
def test_groupwise_linear_matches_dequantized_product(interpreted, format_name, k, m):
    module = interpreted("groupwise_gemv_triton")
    check_groupwise_linear(module, format_name, m, 40, k, torch.float16, "cpu", 2e-3)


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
def test_tensor_core_gemv_on_whole_tiles_loads_without_masks_alike(
    interpreted, monkeypatch, format_name
):
    """Where the tiles cover the weight exactly, the loop loads without masks, bit for bit the
    masked loop; shapes that do not fit take the masked one."""
    module = interpreted("groupwise_gemv_triton")
    block_n, block_k = module.TC_CONFIG[format_name][:2]
    assert module.whole_tiles(2 * block_n, 2 * block_k, 2 * block_k, block_n, block_k)
    assert not module.whole_tiles(2 * block_n + 8, 2 * block_k, 2 * block_k, block_n, block_k)
    assert not module.whole_tiles(2 * block_n, 2 * block_k - 32, 2 * block_k, block_n, block_k)
    encoded = get_format(format_name).encode(torch.randn(2 * block_n, 2 * block_k) * 0.05)
    x = torch.randn(5, 2 * block_k).half()
    whole = module.groupwise_linear(x, encoded)
    monkeypatch.setattr(module, "whole_tiles", lambda *shape: False)
    assert torch.equal(whole, module.groupwise_linear(x, encoded))
    exact = x.float() @ encoded.decode(torch.float16).float().T
    assert (whole.float() - exact).abs().max() <= 2e-3 * exact.abs().max()


def test_gemv_rejects_an_x_of_another_width(interpreted):
    """x's columns must be the weight's K, at one row, at more and for the grouped form: the
    kernels would otherwise read a short x as zeros and a long one in part."""
    module = interpreted("groupwise_gemv_triton")
    weight = get_format("q4_g64_fp16").encode(torch.randn(32, 128))
    for rows in (1, 4):
        with pytest.raises(ValueError, match="x has 64 columns"):
            module.groupwise_linear(torch.randn(rows, 64).half(), weight)
    stacked = get_format("q4_g64_fp16").encode(torch.randn(2 * 32, 128))
    planes = {name: plane.reshape(2, 32, -1) for name, plane in stacked.planes.items()}
    stacked = EncodedTensor(stacked.format, stacked.layout, (2, 32, 128), planes)
    ids = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="x has 192 columns"):
        module.grouped_groupwise_linear(torch.randn(1, 192).half(), stacked, ids, ids)


def test_integer_gemv_reads_short_rows_whole(interpreted):
    """Rows of at most `INT_SHORT_ROW_WORDS` code words (the 35B-A3B experts' down projection,
    K = 512) are read whole, in one step, by programs of `INT_SHORT_ROWS_WORDS` words; longer
    rows keep the grid rule (16 rows, halved while the SMs would get fewer than
    `INT_MIN_PROGRAMS_PER_SM` programs each) and `INT_STEP_WORDS` spread over them."""
    module = interpreted("groupwise_gemv_triton")
    cpu = torch.device("cpu")  # eight SMs, as the interpreter's grids count them
    assert module._int_config(2048, 64, 9, cpu) == (64, 64, 4)  # q4, K = 512, nine pairs
    assert module._int_config(2048, 128, 1, cpu) == (32, 128, 4)  # q4 K = 1024, q8 K = 512
    assert module._int_config(64, 40, 1, cpu) == (64, 64, 4)  # padded to a power of two
    assert module._int_config(5120, 640, 1, cpu) == (16, 128, 4)  # q4, K = 5120
    assert module._int_config(384, 640, 1, cpu) == (16, 128, 4)  # 24 programs: at least two per SM
    assert module._int_config(40, 288, 1, cpu) == (4, 512, 4)  # few rows: four per program


def test_integer_gemv_reads_weights_before_the_wait_in_one_step_programs(interpreted, monkeypatch):
    """`INT_WEIGHTS_BEFORE_WAIT`: a program that reads its rows in one step reads its codes and
    scales before the wait (`pdl_triton.READ_BEFORE_WAIT`), in a dense product or the experts'
    down one with the SwiGLU inside (its pairs are two kernels old), not in the gate|up one
    (the routing just before it writes its pairs) or where the loop has later steps; the
    product is the same bit for bit either way."""
    module = interpreted("groupwise_gemv_triton")
    launches = record_launches(
        monkeypatch, module, "_groupwise_gemv_int_kernel", "WEIGHTS_BEFORE_WAIT"
    )
    fmt = get_format("q4_g64_fp16")
    one_step = fmt.encode(torch.randn(40, 320) * 0.05)  # 40 words a row, read whole
    two_steps = fmt.encode(torch.randn(512, 2048) * 0.05)  # 16 rows, 128 of 256 words a step
    stacked = fmt.encode(torch.randn(3 * 48, 512) * 0.05)
    planes = {name: p.reshape(3, 48, -1) for name, p in stacked.planes.items()}
    experts = EncodedTensor(stacked.format, stacked.layout, (3, 48, 512), planes)
    x_rows = torch.tensor([0, -1, 1], dtype=torch.int32)
    ids = torch.tensor([2, 0, 1], dtype=torch.int32)
    q8, q6 = (
        get_format(f).encode(torch.randn(40, 320) * 0.05) for f in ("q8_g32_fp16", "q6_g64_fp16")
    )
    taps, windows = torch.randn(24, 4).half(), torch.randn(2, 24, 3).half()

    def with_the_conv():  # the product and the window it shifted, from the same windows
        shifted = windows.clone()
        slot = torch.tensor([1], dtype=torch.int32)
        out = module.integer_linear_conv(torch.randn(1, 320).half(), one_step, taps, shifted, slot)
        return torch.cat([out.flatten(), shifted.flatten()])[None, :]

    calls = [
        lambda: module.integer_linear(torch.randn(1, 320).half(), one_step),
        lambda: module.integer_linear(torch.randn(1, 2048).half(), two_steps),
        lambda: module.grouped_groupwise_linear(torch.randn(2, 512).half(), experts, x_rows, ids),
        lambda: module.grouped_swiglu_linear(torch.randn(2, 1024).half(), experts, x_rows, ids),
        lambda: module.integer_linear(torch.randn(1, 320).half(), q8),
        lambda: module.integer_linear(torch.randn(1, 320).half(), q6),
        with_the_conv,
    ]
    outputs = {}
    for early in (True, False):
        monkeypatch.setattr(module, "INT_WEIGHTS_BEFORE_WAIT", early)
        launches.clear()
        torch.manual_seed(3)
        outputs[early] = [call() for call in calls]
        assert launches == [early, False, False, early, early, early, early]
    for with_early, without in zip(outputs[True], outputs[False]):
        assert torch.equal(with_early[[0, -1]], without[[0, -1]])


def test_integer_gemv_takes_the_tuned_setting_of_a_listed_product(interpreted, monkeypatch):
    """A product that `INT_TUNED` lists for the device takes its setting; the same shape on
    another device, in another format or at another count of x rows or pairs takes the rule."""
    module = interpreted("groupwise_gemv_triton")
    cuda = torch.device("cuda")
    monkeypatch.setattr(module, "num_sms", lambda device: 132)
    monkeypatch.setattr(module, "device_name", lambda device: "NVIDIA H200")
    assert module._int_config(16384, 640, 1, cuda, 4) == (16, 64, 4)  # 27B GDN in projection
    assert module._int_config(14336, 640, 1, cuda, 4) == (32, 64, 4)  # 27B attention
    assert module._int_config(5120, 768, 1, cuda, 4) == (8, 256, 2)  # 27B out projections
    assert module._int_config(5120, 2176, 1, cuda, 4) == (8, 128, 2)  # 27B MLP down
    assert module._int_config(12288, 256, 1, cuda, 4) == (16, 64, 2)  # 35B-A3B GDN in projection
    assert module._int_config(1024, 256, 9, cuda, 4) == (8, 256, 2)  # 35B-A3B experts' gate|up
    assert module._int_config(1024, 256, 1, cuda, 4) == (4, 512, 4)
    assert module._int_config(1024, 256, 18, cuda, 4) == (16, 128, 4)
    assert module._int_config(16384, 640, 1, cuda, 8) == (16, 128, 4)
    assert module._int_config(16384, 640, 2, cuda, 4) == (16, 128, 4)
    assert module._int_config(5120, 640, 1, cuda, 4) == (16, 128, 4)
    monkeypatch.setattr(module, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert module._int_config(16384, 640, 1, cuda, 4) == (16, 128, 4)


def test_integer_gemv_takes_the_tuned_stages_of_a_listed_product(interpreted, monkeypatch):
    """The 27B out projections and MLP down run four stages on the H200 (`INT_TUNED_STAGES`);
    every other product, another device and the CPU keep `INT_STAGES`."""
    module = interpreted("groupwise_gemv_triton")
    cuda = torch.device("cuda")
    monkeypatch.setattr(module, "device_name", lambda device: "NVIDIA H200")
    assert module._int_stages(5120, 768, 1, cuda, 4) == 4  # 27B out projections
    assert module._int_stages(5120, 2176, 1, cuda, 4) == 4  # 27B MLP down
    assert module._int_stages(34816, 640, 1, cuda, 4) == module.INT_STAGES == 3
    assert module._int_stages(5120, 768, 2, cuda, 4) == 3
    assert module._int_stages(5120, 768, 1, torch.device("cpu"), 4) == 3
    monkeypatch.setattr(module, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert module._int_stages(5120, 768, 1, cuda, 4) == 3


@pytest.mark.parametrize("warps", [2, 4])
def test_integer_gemv_launches_with_its_settings_warps(interpreted, monkeypatch, warps):
    """The warps `_int_config` gives a product (`INT_TUNED` lists two for some) are the warps
    its kernel launches with; the product is the same either way."""
    module = interpreted("groupwise_gemv_triton")
    weight = get_format("q4_g64_fp16").encode(torch.randn(40, 320) * 0.05)
    x = torch.randn(1, 320, dtype=torch.bfloat16)
    monkeypatch.setattr(module, "_int_config", lambda *shape: (16, 16, warps))
    launches = record_launches(monkeypatch, module, "_groupwise_gemv_int_kernel", "num_warps")
    out = module.integer_linear(x, weight)
    assert launches == [warps]
    exact = x.float() @ weight.decode(torch.float32).T
    assert (out.float() - exact).abs().max() <= 1e-2 * exact.abs().max()


def test_tensor_core_splits_of_k_bound_the_partials_traffic(interpreted):
    """K is split to fill the H200's 132 SMs, but never so far that the splits' fp32 partials
    move more than `TC_PARTIAL_SHARE` of the weight's bytes: at eight rows the SMs set every
    27B product's splits; at sixteen the partials cap 5120x6144's at 6 instead of 8."""
    module = interpreted("groupwise_gemv_triton")
    block_n, block_k = module.TC_CONFIG["q4_g64_fp16"][:2]

    def splits(n: int, k: int, m: int = 8) -> tuple[int, int]:
        return module.split_k(m, k, 4, n // block_n, k // block_k, 132)

    assert splits(5120, 6144) == (8, 3)
    assert splits(5120, 6144, m=16) == (6, 4)
    assert splits(5120, 17408) == (10, 7)
    assert splits(12288, 5120) == (5, 4)
    assert splits(34816, 5120) == (2, 10)
    for m in (8, 16):
        for n, k in ((5120, 6144), (5120, 17408), (12288, 5120)):
            count, _ = splits(n, k, m)
            assert 8 * m * n * count <= module.TC_PARTIAL_SHARE * n * k * 4 / 8
    assert splits(5120, 6144, m=64) == (1, 24)  # many rows: the partials would cost more


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("counters", [True, False], ids=["counters", "torch-sum"])
def test_tensor_core_gemv_rounds_the_weight_as_decode_does(interpreted, format_name, counters):
    """More than one x row: every weight becomes exactly decode's value in x's dtype (the fp32
    product of code and scale, rounded once), so the result is the product with the decoded
    weight up to fp32 summation order. K is split across programs (8 SMs in the interpreter); the last
    split of each output tile sums the partials and leaves its counter at zero, or, without
    counters (none yet inside a graph capture), torch sums them."""
    module = interpreted("groupwise_gemv_triton")
    module.TC_SCALE_AFTER = False  # the form that rounds the weight (below, the other)
    if not counters:
        module.TILE_COUNTERS = 0
    encoded = get_format(format_name).encode(torch.randn(150, 1000) * 0.05)
    x = torch.randn(5, 1000).half()
    out = module.groupwise_linear(x, encoded)
    assert out.dtype == torch.float16 and out.shape == (5, 150)
    exact = x.float() @ encoded.decode(torch.float16).float().T
    assert (out.float() - exact).abs().max() <= 2e-3 * exact.abs().max()
    assert (out != exact.half()).float().mean() < 0.05
    if counters:
        assert module._counters and not module._counters[torch.device("cpu")].any()


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("counters", [True, False], ids=["counters", "torch-sum"])
@pytest.mark.parametrize(("n", "k"), [(150, 1000), (256, 512), (24, 60)], ids=str)
def test_tensor_core_scaled_after_its_product_is_the_exact_product(
    interpreted, format_name, counters, n, k
):
    """With `TC_SCALE_AFTER`: each group's codes enter the product as exact integers and its
    scale multiplies the product, so the weight is never rounded. The result is the exact
    product of x and the decoded weight (fp64 here) to within the output's rounding and fp32
    sums (masked tiles at 150 x 1000, whole ones at 256 x 512, fewer groups per tile at
    K = 60), and nearer it than the form that rounds the weight to x's dtype."""
    module = interpreted("groupwise_gemv_triton")
    assert module.TC_SCALE_AFTER
    if not counters:
        module.TILE_COUNTERS = 0
    encoded = get_format(format_name).encode(torch.randn(n, k) * 0.05)
    encoded.planes["scales"][1::7] *= -1  # the product is code * scale whatever the sign
    x = torch.randn(5, k).half()
    out = module.groupwise_linear(x, encoded).double()
    weight = encoded.decode(torch.float32).double()  # code * scale is exact in fp32
    exact = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    assert ((out - exact).abs() <= 2**-11 * exact.abs() + 1e-5 * magnitude).all()
    module.TC_SCALE_AFTER = False
    rounded = module.groupwise_linear(x, encoded).double()
    assert (out - exact).abs().mean() < (rounded - exact).abs().mean()


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("m", [2, 7])
def test_tensor_core_weight_first_and_x_first_give_one_product(interpreted, format_name, m):
    """At up to eight x rows the weight is the product's first operand (`TC_WEIGHTS_FIRST`);
    x first, as above eight rows, multiplies the same exact codes and scales: the same
    products to within their fp32 sums' order, on masked tiles."""
    module = interpreted("groupwise_gemv_triton")
    assert module.TC_WEIGHTS_FIRST and module.TC_SCALE_AFTER
    encoded = get_format(format_name).encode(torch.randn(150, 1000) * 0.05)
    x = torch.randn(m, 1000).half()
    first = module.groupwise_linear(x, encoded).float()
    module.TC_WEIGHTS_FIRST = False
    second = module.groupwise_linear(x, encoded).float()
    torch.testing.assert_close(first, second, rtol=2e-3, atol=1e-3 * second.abs().max().item())


@pytest.mark.parametrize(
    ("format_name", "n", "k"),
    [
        ("q4_g64_fp16", 40, 300),
        ("q8_g32_fp16", 40, 200),
        ("q4_g64_fp16", 12, 1000),
        ("q4_g64_fp16", 256, 2304),  # long rows: 288 words in two or three steps, the last masked
    ],
)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_groupwise_linear_integer_kernel_matches_dequantized_product(
    interpreted, format_name, n, k, m
):
    """The integer kernel (dp4a spelled out in shifts here), at one row as decode runs it and
    at up to eight rows as it can run; its only error beyond the output's rounding is x's
    split, under 1/64516 of a group's largest value."""
    module = interpreted("groupwise_gemv_triton")
    assert module.INT_MAX_ROWS == 1
    integer = SimpleNamespace(groupwise_linear=module.integer_linear)
    check_groupwise_linear(integer, format_name, m, n, k, torch.float16, "cpu", 1e-3)
    if m == 1:
        check_groupwise_linear(module, format_name, m, n, k, torch.float16, "cpu", 1e-3)


@pytest.mark.parametrize("codes", ["low", "high", "mixed"])
def test_integer_kernel_is_exact_at_the_extreme_q4_codes(interpreted, codes):
    """Codes -8 and 7, int32 group sums near their bound
    (`check_integer_gemv_at_extreme_q4_codes`)."""
    check_integer_gemv_at_extreme_q4_codes(interpreted("groupwise_gemv_triton"), codes, "cpu")


@pytest.mark.parametrize(("n", "k"), [(40, 300), (12, 1000), (256, 2304)], ids=str)
@pytest.mark.parametrize("m", [1, 3])
def test_integer_kernel_reads_q6_planes_as_the_dequantized_product(interpreted, n, k, m):
    """q6_g64 (the head's stored format) read as its two planes, u = code + 32 per byte: the
    product of the dequantized weight up to x's split, every code -32..31 among the values;
    and the same as the q8_g32 it widens to within that split's error."""
    module = interpreted("groupwise_gemv_triton")
    integer = SimpleNamespace(groupwise_linear=module.integer_linear)
    check_groupwise_linear(integer, "q6_g64_fp16", m, n, k, torch.float16, "cpu", 1e-3)
    encoded = get_format("q6_g64_fp16").encode(torch.randn(n, k) * 0.05)
    assert set(get_format("q6_g64_fp16").unpack_codes(encoded.planes).unique().tolist()) >= set(
        range(-31, 32)
    )
    x = torch.randn(m, k).half()
    out = module.integer_linear(x, encoded).float()
    widened = module.integer_linear(x, widen_to_q8(encoded)).float()
    assert relative_error(out, widened) < 1e-3


@pytest.mark.parametrize(("format_name", "k"), [("q4_g64_fp16", 300), ("q8_g32_fp16", 200)])
def test_x_split_into_coarse_and_fine_codes_represents_x(interpreted, format_name, k):
    """x = s * (254 * coarse + fine) within half a fine step s per value (plus the residual's
    fp32 rounding, 2^-24 of |x| <= 32258 s: under 0.002 s), codes in [-127, 127],
    words packed in the weight's value order, and (q4) the correction 8 * sum of each group."""
    module = interpreted("groupwise_gemv_triton")
    fmt = get_format(format_name)
    bits, group = module.SUPPORTED[format_name]
    padded = fmt.padded_k(k)
    x = torch.randn(3, k, dtype=torch.float16) * torch.logspace(-3, 2, k, dtype=torch.float16)
    x[1, :group] = 0  # an all-zero group has step 0 and codes 0
    codes, corr, steps = module.split_x(x, bits, group, padded)
    raw = codes.reshape(3, 2, -1, 1).view(torch.int8).reshape(3, 2, -1).to(torch.int32)
    if bits == 4:  # per word: its even values' bytes, then (after all words) the odd ones'
        words = padded // 8
        even, odd = raw[:, :, : 4 * words], raw[:, :, 4 * words :]
        raw = torch.stack([even, odd], dim=-1).reshape(3, 2, padded)
    assert raw.abs().max() <= 127
    combined = (254 * raw[:, 0] + raw[:, 1]).reshape(3, padded // group, group)
    rebuilt = (combined.double() * steps.double().unsqueeze(-1)).reshape(3, padded)[:, :k]
    assert (
        (rebuilt - x.double()).abs() <= steps.double().repeat_interleave(group, 1)[:, :k] * 0.502
    ).all()
    assert (steps[1, 0] == 0) and (combined[1, 0] == 0).all()
    if bits == 4:
        assert torch.equal(corr, 8 * combined.sum(-1))


@pytest.mark.parametrize(("format_name", "k"), [("q4_g64_fp16", 2100), ("q8_g32_fp16", 1100)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # fp16 to inf
def test_groupwise_dequant_equals_the_reference_bit_for_bit(interpreted, format_name, k, dtype):
    """K padded up to the group and spanning several programs, rows spanning two."""
    check_groupwise_dequant(
        interpreted("groupwise_dequant_triton"), format_name, 37, k, dtype, "cpu"
    )


@pytest.mark.parametrize(
    ("context_lens", "query_lens", "head_dim"),
    [([0], [70], 32), ([0, 100, 3, 64], [5, 1, 80, 64], 32), ([130, 0], [2, 3], 20)],
    ids=["one-fresh", "mixed-prefixes", "head-dim-20"],
)
def test_paged_prefill_attention_matches_reference(interpreted, context_lens, query_lens, head_dim):
    module = interpreted("paged_attention_prefill_triton")
    check_paged_prefill_attention(
        module, context_lens, query_lens, 4, 2, head_dim, torch.float16, "cpu", 2e-3
    )


def test_paged_prefill_attention_blocks_cover_every_token(interpreted):
    """The device-side block list names each sequence's blocks in order, then spare entries."""
    module = interpreted("paged_attention_prefill_triton")
    query_start = torch.tensor([0, 3, 3, 133, 134], dtype=torch.int32)
    block_seq, block_index = module.query_blocks(query_start, 134, 64)
    assert block_seq.tolist() == [0, 2, 2, 2, 3] + [4] * 2
    assert block_index[:5].tolist() == [0, 0, 1, 2, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_scatters_rows_exactly(interpreted, dtype):
    check_kv_write(interpreted("kv_write_triton"), 70, 2, 24, dtype, "cpu")


def test_kv_write_skips_negative_slots(interpreted):
    module = interpreted("kv_write_triton")
    k_cache, v_cache = torch.randn(2, 64, 1, 16), torch.randn(2, 64, 1, 16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    module.write_kv(k, v, k_cache, v_cache, torch.tensor([-1, 65]))
    assert torch.equal(k_cache[1, 1], k[1]) and torch.equal(v_cache[1, 1], v[1])
    k_cache[1, 1], v_cache[1, 1] = before_k[1, 1], before_v[1, 1]
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_matches_exact(interpreted, dtype):
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    check_silu_mul(interpreted("swiglu_triton"), 5, 1500, dtype, "cpu", tol)


@pytest.mark.parametrize(("head_dim", "rot_dim"), [(32, 8), (20, 6), (16, 16)])
def test_rotary_rotates_the_first_dims_in_place(interpreted, head_dim, rot_dim):
    module = interpreted("rotary_triton")
    check_rotary(module, 9, 3, head_dim, rot_dim, torch.float32, "cpu", 1e-6)
    check_rotary(module, 9, 3, head_dim, rot_dim, torch.float16, "cpu", 2e-3)

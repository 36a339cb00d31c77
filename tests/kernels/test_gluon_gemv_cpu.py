"""The Gluon q4 product (`groupwise_gemv_gluon`) where CI can check it without a GPU: its
settings per product, that CPU tensors never reach it, and its column map: the permutations that carry a group's dequantized codes and x's values into
the MMA operands give every operand column the same column of the group on both sides, and
each operand column is held by the thread of the m16n8k16 fragment that holds it (column
2t + e + 8p + 16c by thread t of a row quad), which loaded that column."""

from __future__ import annotations

import torch

from ninfer.kernels.groupwise_gemv_gluon import GROUP, WEIGHT_ORDER, X_ORDER


def _weight_columns() -> torch.Tensor:
    """The group column of each operand position on the weight's side: word w (thread t's
    words 2t + h) holds columns 8w .. 8w + 7, and its pair q (q0 + 2 q1) gives values q and
    q + 4 (e), in the join order of `_weight_operand`: [word, e, q0, q1]."""
    w, e, q0, q1 = torch.meshgrid(*(torch.arange(n) for n in (8, 2, 2, 2)), indexing="ij")
    columns = 8 * w + (2 * q1 + q0) + 4 * e
    return columns.reshape(1, 2, 2, 2, 2, 2, 2).permute(WEIGHT_ORDER).reshape(GROUP)


def _x_columns() -> torch.Tensor:
    """... and on x's side: thread t holds columns 16t .. 16t + 15 in order."""
    return torch.arange(GROUP).reshape(1, 2, 2, 2, 2, 2, 2).permute(X_ORDER).reshape(GROUP)


def test_both_operands_read_the_same_group_column_at_each_position():
    weight, x = _weight_columns(), _x_columns()
    assert torch.equal(weight, x)
    assert sorted(weight.tolist()) == list(range(GROUP))  # every column once


def test_each_operand_column_is_one_its_thread_loaded():
    positions = torch.arange(GROUP)
    fragment_thread = (positions // 2) % 4  # operand column 2t + e + 8p + 16c
    assert torch.equal(_weight_columns() // 16, fragment_thread)


def test_a_listed_product_takes_its_setting_and_others_the_defaults(monkeypatch):
    from ninfer.kernels import groupwise_gemv_gluon as gluon_q4

    cuda = torch.device("cuda")
    defaults = (gluon_q4.BLOCK_N, gluon_q4.STAGES, gluon_q4.PROGRAMS_PER_SM)
    monkeypatch.setattr(gluon_q4, "device_name", lambda device: "NVIDIA H200")
    assert gluon_q4._config(34816, 5120, cuda) == (64, 2, 2)  # 27B MLP gate|up
    assert gluon_q4._config(5120, 17408, cuda) == (64, 4, 2)  # 27B MLP down
    assert gluon_q4._config(5120, 6144, cuda) == defaults
    assert gluon_q4._config(17408, 5120, cuda) == defaults  # N and K are not interchangeable
    monkeypatch.setattr(gluon_q4, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert gluon_q4._config(34816, 5120, cuda) == defaults
    assert gluon_q4._config(34816, 5120, torch.device("cpu")) == defaults


def test_cpu_tensors_keep_the_other_kernels():
    from ninfer.kernels import groupwise_gemv_gluon
    from ninfer.quant import get_format

    weight = get_format("q4_g64_fp16").encode(torch.randn(64, 512) * 0.05)
    assert not groupwise_gemv_gluon.fits(torch.randn(8, 512).bfloat16(), weight)


def test_the_halves_view_puts_gate_rows_over_the_same_up_rows():
    """`weight_views(halves=True)`: word [t, h, f] is word t of row h * F + f, and scale
    [h, f, g] group g's scale of that row, so a box of rows f .. f + B/2 of both halves holds
    the gate and up rows of the same outputs."""
    from ninfer.kernels.groupwise_gemv_gluon import weight_views
    from ninfer.quant import get_format

    f, k = 24, 1024
    weight = get_format("q4_g64_fp16").encode(torch.randn(2 * f, k) * 0.05)
    codes, scales = weight.planes["codes"], weight.planes["scales"]
    words, scale_view = weight_views(codes, scales, halves=True)
    flat = codes.view(torch.int32)
    assert words.shape == (k // GROUP, 2, f, 8) and scale_view.shape == (2, f, k // GROUP)
    for t, h, row in ((0, 0, 0), (3, 1, 5), (15, 1, f - 1), (7, 0, 11)):
        assert torch.equal(words[t, h, row], flat[h * f + row, 8 * t : 8 * t + 8])
        assert torch.equal(scale_view[h, row], scales[h * f + row])
    plain, same = weight_views(codes, scales, halves=False)
    assert torch.equal(plain[2, 30], flat[30, 16:24]) and same is scales


def test_swiglu_linear_on_the_cpu_is_the_product_then_silu():
    from ninfer.kernels import dispatch, groupwise_gemv
    from ninfer.quant import get_format

    weight = get_format("q4_g64_fp16").encode(torch.randn(2 * 96, 512) * 0.05)
    x = torch.randn(4, 512)
    assert not dispatch.takes_swiglu_linear(x.bfloat16(), weight)
    gate, up = groupwise_gemv.groupwise_linear(x, weight).chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(dispatch.swiglu_linear(x, weight), expected)
    assert torch.equal(groupwise_gemv.swiglu_linear(x, weight), expected)


def _lop3(a: torch.Tensor, b: int, c, lut: int) -> torch.Tensor:
    """PTX lop3.b32 on int64 tensors holding 32-bit words, for the two tables the kernel uses."""
    if lut == 0x6A:  # (a & b) ^ c
        return (a & b) ^ c
    assert lut == 0xEA  # (a & b) | c
    return (a & b) | c


def _bf16_halves(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    def value(half):
        return (half.to(torch.int32) << 16).view(torch.float32)

    return value(word & 0xFFFF), value((word >> 16) & 0xFFFF)


def test_the_q6_pairs_are_the_codes_of_values_q_and_q_plus_4():
    """The q6 unpack as the kernel does it, its PTX (`_Q6_PAIRS_PTX`) and `_high_bits` written
    out on integers: for thread t's code word 2t + h and high word t of a group, pair q holds
    the signed codes of the thread's values 8h + q and 8h + q + 4 (group columns 16t + ...),
    for random q6 weights with codes over the whole range."""
    from ninfer.quant import get_format

    fmt = get_format("q6_g64_fp16")
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(-31, 32, (16, 256), generator=generator)
    codes[:, ::64] = 31
    planes = fmt.encode(codes.float()).planes
    assert torch.equal(fmt.unpack_codes(planes).long(), codes)
    words = planes["codes"].view(torch.int32).long() & 0xFFFFFFFF  # [rows, K/8]
    highs = planes["high"].view(torch.int32).long() & 0xFFFFFFFF  # [rows, K/16]
    mask = 0xFFFFFFFF
    for group in range(codes.shape[1] // GROUP):
        for t in range(4):
            hw = highs[:, 4 * group + t]
            selected = [
                (hw & 0xFF) | ((hw & 0xFF00) << 8),  # word 2t: bytes 0, 1 of high word t
                ((hw >> 16) & 0xFF) | ((hw >> 8) & 0xFF0000),  # word 2t + 1: bytes 2, 3
            ]
            for h in range(2):
                w, hs = words[:, 8 * group + 2 * t + h], selected[h]
                shifted_high = [(hs << 4) & mask, (hs << 2) & mask, hs, hs >> 2]
                for q in range(4):
                    m = _lop3(shifted_high[q], 0x00300030, 0x43204320, 0x6A)
                    pair = _lop3(w >> (4 * q), 0x000F000F, m, 0xEA)
                    low, high = _bf16_halves(pair)
                    column = 64 * group + 16 * t + 8 * h + q
                    assert torch.equal(low - 160, codes[:, column].float())
                    assert torch.equal(high - 160, codes[:, column + 4].float())


def test_the_q6_pair_instructions_are_the_ones_emulated():
    """The constants and tables of `_Q6_PAIRS_PTX` are those the emulation above uses."""
    from ninfer.kernels import groupwise_gemv_gluon

    if groupwise_gemv_gluon.gluon is None:
        import pytest

        pytest.skip("this Triton has no Gluon")
    ptx = groupwise_gemv_gluon._Q6_PAIRS_PTX.value
    for line in (
        "shl.b32 h0, $5, 4;",
        "shl.b32 h1, $5, 2;",
        "shr.u32 h3, $5, 2;",
        "lop3.b32 m2, $5, 0x00300030, 0x43204320, 0x6a;",
        "lop3.b32 p3, t3, 0x000F000F, m3, 0xea;",
        "mov.b32 bias, 0x43204320;",
    ):
        assert line in ptx


def test_a_norm_folds_into_a_split_product_only_with_its_counters(monkeypatch):
    """The folded epilogue runs in the last split to arrive, so a product whose K is split
    folds only where the split-K counters exist (not allocated inside a graph capture): else
    the dispatch folds after the product. Shapes of the 27B down (split) and gate|up (not)."""
    from ninfer.kernels import groupwise_gemv_gluon, groupwise_gemv_triton
    from ninfer.quant import get_format

    monkeypatch.setattr(groupwise_gemv_gluon, "fits_normed", lambda x, weight: True)
    monkeypatch.setattr(groupwise_gemv_gluon, "num_sms", lambda device: 132)
    x = torch.zeros(8, 64)
    down = get_format("q4_g64_fp16").encode(torch.zeros(5120, 17408))
    gate_up = get_format("q4_g64_fp16").encode(torch.zeros(34816, 512))
    assert groupwise_gemv_gluon._splits(5120, 17408, x.device)[0] > 1
    assert groupwise_gemv_gluon._splits(34816, 512, x.device)[0] == 1
    for counters in (torch.zeros(4096, dtype=torch.int32), None):
        monkeypatch.setattr(groupwise_gemv_triton, "tile_counters", lambda d, n, c=counters: c)
        assert groupwise_gemv_gluon.takes_norm_after(x, down) == (counters is not None)
        assert groupwise_gemv_gluon.takes_norm_after(x, gate_up)
    q8 = get_format("q8_g32_fp16").encode(torch.zeros(64, 512))
    assert not groupwise_gemv_gluon.takes_norm_after(x, q8)


def test_row_blocks_past_a_full_wave_split_where_they_are_a_short_second_wave(monkeypatch):
    """`TAIL_SPLITS`: at 132 SMs, 64 rows and two ring slots (51,216 bytes, four programs an
    SM), the 27B gate|up's 544 row blocks are 528 whole ones and 16 split; nothing splits
    where the blocks fit, where the tail would be a wave of its own, without the counters, or
    with the switch at one."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_q4
    from ninfer.kernels import groupwise_gemv_triton

    cuda = torch.device("cuda")
    monkeypatch.setattr(gluon_q4, "num_sms", lambda device: 132)
    monkeypatch.setattr(groupwise_gemv_triton, "tile_counters", lambda device, needed: object())
    monkeypatch.setattr(gluon_q4, "TAIL_SPLITS", 5)
    # the compiled kernel's shared memory (`tools/gpu/compile_check.py --sass`, sm_90)
    assert gluon_q4.shared_bytes(64, 2) == 51216 and gluon_q4.shared_bytes(64, 3) == 76824
    assert gluon_q4.resident_programs(64, 2, cuda) == 528
    assert gluon_q4.resident_programs(64, 3, cuda) == 264  # two an SM
    assert gluon_q4._tail(544, 10, 64, 2, cuda) == (528, 16, 5, 2)
    assert gluon_q4._tail(528, 10, 64, 2, cuda) == (528, 0, 1, 10)  # exactly one wave
    assert gluon_q4._tail(544, 8, 64, 2, cuda) == (528, 16, 4, 2)  # 2, 2, 2, 2 tiles
    assert gluon_q4._tail(544, 3, 64, 2, cuda) == (528, 16, 3, 1)
    assert gluon_q4._tail(256, 10, 64, 3, cuda) == (256, 0, 1, 10)  # one wave
    assert gluon_q4._tail(700, 10, 64, 2, cuda) == (700, 0, 1, 10)  # 172 x 5 > 528
    monkeypatch.setattr(groupwise_gemv_triton, "tile_counters", lambda device, needed: None)
    assert gluon_q4._tail(544, 10, 64, 2, cuda) == (544, 0, 1, 10)
    monkeypatch.setattr(groupwise_gemv_triton, "tile_counters", lambda device, needed: object())
    monkeypatch.setattr(gluon_q4, "TAIL_SPLITS", 1)
    assert gluon_q4._tail(544, 10, 64, 2, cuda) == (544, 0, 1, 10)

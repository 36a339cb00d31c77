"""The q4 tensor-core product for two to eight x rows in Gluon (`groupwise_gemv_gluon`) on the
GPU: within the bf16 rounding of its output of the fp32 product of the dequantized weight, at
the 27B and 35B-A3B widths, with K split or not, row counts that do not fill a block, with and
without PDL and split-K counters; and the dispatch sending these products to it."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_groupwise_linear, relative_error

from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")
Q4 = "q4_g64_fp16"


def _counting(monkeypatch):
    from ninfer.kernels import groupwise_gemv_gluon

    calls = []
    real = groupwise_gemv_gluon.q4_linear

    def counted(x, weight):
        calls.append(tuple(x.shape))
        return real(x, weight)

    monkeypatch.setattr(groupwise_gemv_gluon, "q4_linear", counted)
    return calls


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize(
    ("n", "k"),
    [(34816, 5120), (5120, 17408), (5120, 6144), (2048, 4096), (1000, 512), (70, 1024)],
    ids=str,
)
def test_gluon_q4_product(monkeypatch, n, k, m):
    from ninfer.kernels import groupwise_gemv_triton

    calls = _counting(monkeypatch)
    torch.manual_seed(m)
    check_groupwise_linear(groupwise_gemv_triton, Q4, m, n, k, torch.bfloat16, "cuda", 4e-3)
    assert calls == [(m, k)]


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("counters", [True, False], ids=["counters", "torch sum"])
def test_gluon_q4_product_split_forms(monkeypatch, pdl, counters):
    """K split with the last split adding up (counters) or torch summing the partials (no
    counters, as inside a graph capture that would have to allocate them), PDL on and off,
    and weights asked for before the wait or after it: all the same result."""
    from ninfer.kernels import groupwise_gemv_gluon, groupwise_gemv_triton

    monkeypatch.setenv("NINFER_PDL", pdl)
    if not counters:
        monkeypatch.setattr(groupwise_gemv_triton, "tile_counters", lambda device, needed: None)
    torch.manual_seed(3)
    weight = get_format(Q4).encode(torch.randn(5120, 17408, device="cuda") * 0.05)
    x = torch.randn(7, 17408, device="cuda").to(torch.bfloat16)
    exact = x.float() @ weight.decode(torch.float32).T
    outs = []
    for first in (True, False):
        monkeypatch.setattr(groupwise_gemv_gluon, "WEIGHTS_BEFORE_WAIT", first)
        outs.append(groupwise_gemv_gluon.q4_linear(x, weight))
        assert relative_error(outs[-1], exact) < 4e-3
    assert torch.equal(outs[0], outs[1])


def test_gluon_q4_product_repeats_exactly_and_leaves_counters_reset():
    """The split-K counters are reset by the last split: a second call gives the same bits."""
    from ninfer.kernels import groupwise_gemv_gluon

    torch.manual_seed(4)
    weight = get_format(Q4).encode(torch.randn(2048, 4096, device="cuda") * 0.05)
    x = torch.randn(8, 4096, device="cuda").to(torch.bfloat16)
    first = groupwise_gemv_gluon.q4_linear(x, weight)
    for _ in range(3):
        assert torch.equal(groupwise_gemv_gluon.q4_linear(x, weight), first)


def test_gluon_q4_product_takes_only_what_fits():
    from ninfer.kernels import groupwise_gemv_gluon

    weight = get_format(Q4).encode(torch.randn(256, 1024, device="cuda") * 0.05)
    x = torch.randn(8, 1024, device="cuda").to(torch.bfloat16)
    assert groupwise_gemv_gluon.fits(x, weight)
    assert not groupwise_gemv_gluon.fits(x[:1], weight)  # one row: the integer GEMV
    assert not groupwise_gemv_gluon.fits(torch.randn(9, 1024, device="cuda").bfloat16(), weight)
    assert not groupwise_gemv_gluon.fits(x.half(), weight)
    assert not groupwise_gemv_gluon.fits(x[:, 1:], weight)  # misaligned, and K no longer fits
    short = get_format(Q4).encode(torch.randn(256, 960, device="cuda") * 0.05)
    assert not groupwise_gemv_gluon.fits(x[:, :960], short)  # K not a multiple of 512
    q8 = get_format("q8_g32_fp16").encode(torch.randn(256, 1024, device="cuda") * 0.05)
    assert not groupwise_gemv_gluon.fits(x, q8)


@pytest.mark.parametrize("setting", [(64, 2, 2), (64, 4, 3), (128, 3, 1)])
@pytest.mark.parametrize(("n", "k"), [(34816, 5120), (5120, 17408), (200, 1024)], ids=str)
def test_gluon_q4_product_at_every_setting(monkeypatch, setting, n, k):
    """Rows per program (16 or 32 a warp), ring slots and split, as a TUNED entry or the
    defaults may give them."""
    from ninfer.kernels import groupwise_gemv_gluon, groupwise_gemv_triton

    monkeypatch.setattr(groupwise_gemv_gluon, "TUNED", {})
    for name, value in zip(("BLOCK_N", "STAGES", "PROGRAMS_PER_SM"), setting):
        monkeypatch.setattr(groupwise_gemv_gluon, name, value)
    torch.manual_seed(5)
    check_groupwise_linear(groupwise_gemv_triton, Q4, 6, n, k, torch.bfloat16, "cuda", 4e-3)


def _swiglu_then(x, weight):
    """The two-launch form `q4_swiglu_linear` replaces: the product, then `silu_mul`."""
    from ninfer.kernels import groupwise_gemv_gluon, swiglu_triton

    gate, up = groupwise_gemv_gluon.q4_linear(x, weight).chunk(2, dim=-1)
    return swiglu_triton.silu_mul(gate, up)


def _unsplit(monkeypatch):
    """No K split for any product (the SwiGLU form never splits; a split product sums in
    another order), at the default rows and slots."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setattr(groupwise_gemv_gluon, "TUNED", {})
    monkeypatch.setattr(groupwise_gemv_gluon, "PROGRAMS_PER_SM", 0)


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize(
    ("n", "k"), [(34816, 5120), (2 * 1000, 1024), (2 * 70, 512), (2 * 2048, 4096)], ids=str
)
def test_gluon_swiglu_product_is_the_product_then_silu_mul(monkeypatch, n, k, m):
    """Bit for bit the two launches it replaces, at the 27B gate|up and at halves that do not
    fill a program's rows (1000, 70: 32 a program), and near the fp32 SwiGLU."""
    from ninfer.kernels import groupwise_gemv_gluon

    _unsplit(monkeypatch)
    torch.manual_seed(m + n)
    weight = get_format(Q4).encode(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    assert groupwise_gemv_gluon.swiglu_fits(x, weight)
    out = groupwise_gemv_gluon.q4_swiglu_linear(x, weight)
    assert out.shape == (m, n // 2) and out.dtype == torch.bfloat16
    assert torch.equal(out, _swiglu_then(x, weight))
    gate, up = (x.float() @ weight.decode(torch.float32).T).chunk(2, dim=-1)
    assert relative_error(out, torch.nn.functional.silu(gate) * up) < 8e-3


def test_gluon_swiglu_product_takes_the_27b_gate_up_and_no_split_product():
    """At the shipped settings the 27B gate|up product is not split, so the SwiGLU form takes
    it; a product the plain kernel would split keeps the two launches."""
    from ninfer.kernels import groupwise_gemv_gluon

    x = torch.randn(8, 5120, device="cuda").to(torch.bfloat16)
    gate_up = get_format(Q4).encode(torch.randn(34816, 5120, device="cuda") * 0.05)
    assert groupwise_gemv_gluon.swiglu_fits(x, gate_up)
    small = get_format(Q4).encode(torch.randn(2 * 1000, 1024, device="cuda") * 0.05)
    assert not groupwise_gemv_gluon.swiglu_fits(x[:, :1024], small)  # 32 row blocks: K split
    odd = get_format(Q4).encode(torch.randn(34815, 5120, device="cuda") * 0.05)
    assert not groupwise_gemv_gluon.swiglu_fits(x, odd)


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("setting", [(64, 2), (64, 4), (128, 3)])
def test_gluon_swiglu_product_at_every_setting(monkeypatch, pdl, setting):
    """Rows per program, ring slots, PDL on and off, weights before the wait or after it."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setenv("NINFER_PDL", pdl)
    _unsplit(monkeypatch)
    monkeypatch.setattr(groupwise_gemv_gluon, "BLOCK_N", setting[0])
    monkeypatch.setattr(groupwise_gemv_gluon, "STAGES", setting[1])
    torch.manual_seed(6)
    weight = get_format(Q4).encode(torch.randn(2 * 1500, 2048, device="cuda") * 0.05)
    x = torch.randn(7, 2048, device="cuda").to(torch.bfloat16)
    expected = _swiglu_then(x, weight)
    for first in (True, False):
        monkeypatch.setattr(groupwise_gemv_gluon, "WEIGHTS_BEFORE_WAIT", first)
        assert torch.equal(groupwise_gemv_gluon.q4_swiglu_linear(x, weight), expected)


def _tailed(monkeypatch, splits):
    """64 rows and two slots for every product (four programs an SM), K never split, the
    tail blocks split `splits` ways."""
    from ninfer.kernels import groupwise_gemv_gluon

    _unsplit(monkeypatch)
    monkeypatch.setattr(groupwise_gemv_gluon, "BLOCK_N", 64)
    monkeypatch.setattr(groupwise_gemv_gluon, "STAGES", 2)
    monkeypatch.setattr(groupwise_gemv_gluon, "TAIL_SPLITS", splits)


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_gluon_tail_blocks_split_at_the_27b_gate_up(monkeypatch, swiglu, m):
    """`TAIL_SPLITS`: the 27B gate|up's row blocks past a full wave (16 of 544 on an H200)
    split five ways. The whole blocks give the unsplit kernel's bits, the split ones its
    values within the partials' rounding, all near the fp32 product; a second call the same
    bits (the counters reset)."""
    from ninfer.kernels import groupwise_gemv_gluon

    _tailed(monkeypatch, 5)
    full, tail, _, _ = groupwise_gemv_gluon._tail(544, 10, 64, 2, torch.device("cuda"))
    if not tail:
        pytest.skip("this GPU holds every row block at once")
    torch.manual_seed(m)
    weight = get_format(Q4).encode(torch.randn(34816, 5120, device="cuda") * 0.05)
    x = torch.randn(m, 5120, device="cuda").to(torch.bfloat16)
    product = groupwise_gemv_gluon.q4_swiglu_linear if swiglu else groupwise_gemv_gluon.q4_linear
    out = product(x, weight)
    assert torch.equal(product(x, weight), out)
    monkeypatch.setattr(groupwise_gemv_gluon, "TAIL_SPLITS", 1)
    whole = product(x, weight)
    edge = full * (32 if swiglu else 64)  # outputs of the whole blocks
    assert torch.equal(out[:, :edge], whole[:, :edge])
    assert relative_error(out[:, edge:], whole[:, edge:].float()) < 4e-3
    exact = x.float() @ weight.decode(torch.float32).T
    if swiglu:
        gate, up = exact.chunk(2, dim=-1)
        exact = torch.nn.functional.silu(gate) * up
    assert relative_error(out, exact) < 8e-3


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_gluon_tail_blocks_split_where_few_programs_fit(monkeypatch, pdl, swiglu):
    """With the SMs said to hold 24 programs, 32 row blocks of 64 (the last not full) are 24
    whole and 8 split three ways over 8 tiles (3, 3 and 2): the fp32 product's values, with
    PDL on and off."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setenv("NINFER_PDL", pdl)
    _tailed(monkeypatch, 3)
    monkeypatch.setattr(groupwise_gemv_gluon, "resident_programs", lambda *args: 24)
    n = 2 * 1000 if swiglu else 2000
    # 32 row blocks either way: 1000 rows of each half, 32 a block, or 2000 rows, 64 a block
    assert groupwise_gemv_gluon._tail(32, 8, 64, 2, torch.device("cuda")) == (24, 8, 3, 3)
    torch.manual_seed(7)
    weight = get_format(Q4).encode(torch.randn(n, 4096, device="cuda") * 0.05)
    x = torch.randn(6, 4096, device="cuda").to(torch.bfloat16)
    exact = x.float() @ weight.decode(torch.float32).T
    if swiglu:
        gate, up = exact.chunk(2, dim=-1)
        out, exact = (
            groupwise_gemv_gluon.q4_swiglu_linear(x, weight),
            torch.nn.functional.silu(gate) * up,
        )
    else:
        out = groupwise_gemv_gluon.q4_linear(x, weight)
    assert relative_error(out, exact) < 8e-3
    monkeypatch.setattr(groupwise_gemv_gluon, "TAIL_SPLITS", 1)
    product = groupwise_gemv_gluon.q4_swiglu_linear if swiglu else groupwise_gemv_gluon.q4_linear
    whole = product(x, weight)
    edge = 24 * (32 if swiglu else 64)
    assert torch.equal(out[:, :edge], whole[:, :edge])


def _product_case(form: str):
    """(product, x, weight) of a `test_gluon_warp_specialized_product_gives_the_same_bits`
    form; the product of "folded" (the 27B down at eight rows, the next norm folded in after
    it) gives (its output rows, the sum, the squares table)."""
    from ninfer.kernels import groupwise_gemv_gluon
    from ninfer.kernels.norm_fold import NormAfter, NormedRows

    if form == "folded":
        weight = get_format(Q4).encode(torch.randn(5120, 17408, device="cuda") * 0.05)
        x = torch.randn(8, 17408, device="cuda").to(torch.bfloat16)
        after = NormAfter(
            torch.randn(8, 5120, device="cuda").to(torch.bfloat16),
            torch.randn(5120, device="cuda").to(torch.bfloat16),
            1e-6,
        )

        def product(x, weight):
            rows, total = groupwise_gemv_gluon.q4_linear(x, weight, after)
            return rows.weighted, total, rows.squares

        return product, x, weight
    shapes = {"plain": (34816, 5120, 8), "split": (5120, 17408, 5), "swiglu": (3000, 2048, 7)}
    n, k, m = shapes.get(form, (34816, 5120, 8))
    weight = get_format(Q4).encode(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    if form == "normed":
        x = NormedRows(x, torch.rand(k // 64, 8, device="cuda") * 2, 1e-6)
    if form in ("plain", "split"):
        return groupwise_gemv_gluon.q4_linear, x, weight
    return groupwise_gemv_gluon.q4_swiglu_linear, x, weight


@pytest.mark.parametrize("first", [True, False], ids=["weights first", "after the wait"])
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("form", ["plain", "split", "swiglu", "tail", "normed", "folded"])
def test_gluon_warp_specialized_product_gives_the_same_bits(monkeypatch, form, pdl, first):
    """`WARP_SPECIALIZED`: a producer warp keeping the ring full and four consumer warps give
    the one-partition kernel's bits: a plain product, one split over K, the SwiGLU form, the
    SwiGLU with its tail blocks split (two slots), x a folded norm's rows, and (with
    `WS_NORM_AFTER`) the next norm folded in after a split product; PDL on and off, the codes
    asked for before the wait or after it."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setenv("NINFER_PDL", pdl)
    monkeypatch.setattr(groupwise_gemv_gluon, "WEIGHTS_BEFORE_WAIT", first)
    monkeypatch.setattr(groupwise_gemv_gluon, "WS_NORM_AFTER", True)
    if form == "tail":
        _tailed(monkeypatch, 5)
    torch.manual_seed(11)
    product, x, weight = _product_case(form)
    outs = []
    for specialized in (False, True, True):  # twice: the counters and barriers left reset
        monkeypatch.setattr(groupwise_gemv_gluon, "WARP_SPECIALIZED", specialized)
        out = product(x, weight)
        outs.append(out if isinstance(out, tuple) else (out,))
    for one_partition, *others in zip(*outs, strict=True):
        assert all(torch.equal(one_partition, each) for each in others)


@pytest.mark.parametrize("specialized", [True, False], ids=["specialized", "one partition"])
@pytest.mark.parametrize("form", ["plain", "split", "swiglu", "tail", "normed", "folded", "q6"])
def test_gluon_codes_in_wide_boxes_give_the_same_bits(monkeypatch, form, specialized):
    """`WIDE_CODES`: a tile's codes asked for as two [rows, 32-word] boxes and read back
    through their swizzle give the narrow boxes' bits, in every form of the product (the
    warp-specialized forms and the one-partition loop), a SwiGLU whose last gate box runs
    past gate's 1500 rows, a split product with the next norm folded in and a q6 weight,
    its high bits in one wide box a tile, among them."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setattr(groupwise_gemv_gluon, "WARP_SPECIALIZED", specialized)
    if form == "tail":
        _tailed(monkeypatch, 5)
    torch.manual_seed(13)
    if form == "q6":
        product = groupwise_gemv_gluon.q6_linear
        weight = get_format(Q6).encode(torch.randn(2000, 5120, device="cuda") * 0.05)
        x = torch.randn(8, 5120, device="cuda").to(torch.bfloat16)
    else:
        product, x, weight = _product_case(form)
    outs = []
    for wide in (False, True, True):  # twice: the counters and barriers left reset
        monkeypatch.setattr(groupwise_gemv_gluon, "WIDE_CODES", wide)
        out = product(x, weight)
        outs.append(out if isinstance(out, tuple) else (out,))
    for narrow, *wide in zip(*outs, strict=True):
        assert all(torch.equal(narrow, each) for each in wide)


@pytest.mark.parametrize("rows", [1, 4, 8, 12])
def test_mlp_runs_its_swiglu_in_the_product_at_two_to_eight_rows(monkeypatch, rows):
    """An MLP with q4 weights: at two to eight rows one launch does gate|up and the SwiGLU,
    elsewhere the product and `silu_mul`; the results are the same bits either way."""
    from ninfer.kernels import groupwise_gemv_gluon
    from ninfer.models.layers import mlp as mlp_module
    from ninfer.models.layers.linear import GroupwiseLinear

    _unsplit(monkeypatch)
    torch.manual_seed(rows)
    hidden, inner = 1024, 1536
    layer = mlp_module.MLP(hidden, inner)
    for name, shape in (("gate_proj", (inner, hidden)), ("up_proj", (inner, hidden))):
        encoded = get_format(Q4).encode(torch.randn(*shape) * 0.05)
        encoded.planes = {key: plane.cuda() for key, plane in encoded.planes.items()}
        setattr(layer, name, GroupwiseLinear(encoded))
    layer.down_proj = layer.down_proj.to("cuda", torch.bfloat16)
    assert layer.fuse_projections() == ["gate_up_proj"]
    x = torch.randn(rows, hidden, device="cuda").to(torch.bfloat16)
    calls = []
    real = groupwise_gemv_gluon.q4_swiglu_linear
    monkeypatch.setattr(
        groupwise_gemv_gluon, "q4_swiglu_linear", lambda *a: calls.append(1) or real(*a)
    )
    fused = layer(x)
    assert len(calls) == (1 if 2 <= rows <= 8 else 0)
    monkeypatch.setattr(mlp_module, "takes_swiglu_linear", lambda x, weight: False)
    assert torch.equal(fused, layer(x))


Q6 = "q6_g64_fp16"


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize(
    ("n", "k"), [(248320, 5120), (248320, 2048), (1000, 512), (70, 1024)], ids=str
)
def test_gluon_q6_product(monkeypatch, n, k, m):
    """The q6 heads of both models read as stored, and rows that leave a block part full."""
    from ninfer.kernels import dispatch, groupwise_gemv_gluon

    calls = []
    real = groupwise_gemv_gluon.q6_linear
    monkeypatch.setattr(groupwise_gemv_gluon, "q6_linear", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(m + k)
    weight = get_format(Q6).encode(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = dispatch.groupwise_linear(x, weight)
    assert calls == [1] and out.shape == (m, n) and out.dtype == torch.bfloat16
    exact = x.float() @ weight.decode(torch.float32).T
    assert relative_error(out, exact) < 4e-3


def test_gluon_q6_product_reads_every_code():
    """Codes drawn from all of -31 .. 31 with scale 1 (each group holds a 31): the product is
    the exact integer one, within the output's bf16 rounding."""
    from ninfer.kernels import groupwise_gemv_gluon

    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(-31, 32, (256, 2048), generator=generator)
    codes[:, ::64] = 31
    weight = get_format(Q6).encode(codes.float().cuda())
    assert torch.equal(weight.decode(torch.float32).cpu(), codes.float())
    x = torch.randn(8, 2048, generator=generator).cuda().to(torch.bfloat16)
    out = groupwise_gemv_gluon.q6_linear(x, weight)
    exact = x.double() @ codes.double().cuda().T
    assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 8, 9])
def test_a_q6_head_reads_its_stored_weight_at_one_to_eight_rows(monkeypatch, rows):
    """`GroupwiseLinear` with a q6 weight kept as stored beside its q8 widening: one row takes
    the integer GEMV, two to eight the Gluon kernel, more the widened weight; all agree."""
    from ninfer.kernels import groupwise_gemv_gluon
    from ninfer.models.layers.linear import GroupwiseLinear
    from ninfer.quant.groupwise import widen_to_q8

    calls = []
    real = groupwise_gemv_gluon.q6_linear
    monkeypatch.setattr(groupwise_gemv_gluon, "q6_linear", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(rows)
    stored = get_format(Q6).encode(torch.randn(3000, 2048, device="cuda") * 0.05)
    layer = GroupwiseLinear(widen_to_q8(stored), one_row=stored)
    x = torch.randn(rows, 2048, device="cuda").to(torch.bfloat16)
    out = layer(x)
    assert len(calls) == (1 if 2 <= rows <= 8 else 0)
    exact = x.float() @ stored.decode(torch.float32).T
    assert relative_error(out, exact) < 4e-3

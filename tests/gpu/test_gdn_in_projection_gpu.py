"""A GDN layer's in projection at a decode step of two to eight sequences in one Gluon kernel
(`groupwise_gemv_gluon.q4_linear_conv`) on the GPU: the causal conv in the product's epilogue
bit for bit the product followed by the conv kernel (outputs and windows), the gates in
programs of its grid within a rounding of the exact b|a product, at the 27B and 35B-A3B
shapes, x plain or a folded norm's rows, PDL on and off, each gates row in one program or
split by tokens; what the kernel refuses; and a GDN layer's decode step through it against
the step with the conv and gates kernel apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import check_gates_of_product, query_start_of, relative_error
from torch import nn

from ninfer.kernels.norm_fold import NormedRows
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

BF16 = torch.bfloat16
Q4 = "q4_g64_fp16"
# (q|k|v channels, z channels, value heads, hidden) of a GDN layer
SHAPES = {"27b": (10240, 6144, 48, 5120), "35b-a3b": (8192, 4096, 32, 2048)}


def _layer(shape: str, m: int, slots: int = 12):
    channels, z, heads, hidden = SHAPES[shape]
    weight = get_format(Q4).encode(torch.randn(channels + z, hidden) * hidden**-0.5)
    weight.planes = {name: plane.cuda() for name, plane in weight.planes.items()}
    taps = torch.randn(channels, 4, device="cuda").to(BF16)
    windows = torch.randn(slots, channels, 3, device="cuda").to(BF16)
    state_slots = torch.randperm(slots, device="cuda")[:m].to(torch.int32)
    ba = (torch.randn(2 * heads, hidden, device="cuda") * 8 * hidden**-0.5).to(BF16)
    A_log = (torch.randn(heads, device="cuda") * 0.5).to(BF16)
    dt_bias = torch.randn(heads, device="cuda").to(BF16)
    return weight, taps, windows, state_slots, (ba, A_log, dt_bias)


def _input(m: int, hidden: int, folded: bool):
    """x [m, hidden] bf16, or a folded norm's rows and the rows they stand for (float64)."""
    u = torch.randn(m, hidden, device="cuda").to(BF16)
    if not folded:
        return u, u.double()
    squares = torch.rand(80, 8, device="cuda") * hidden / 80 * 4
    rows = NormedRows(u, squares, 1e-6)
    scale = torch.rsqrt(squares.double()[:, :m].sum(0) / hidden + 1e-6)
    return rows, u.double() * scale[:, None]


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "folded"])
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_in_projection_with_conv_and_gates(monkeypatch, shape, m, folded, pdl):
    """The conv's outputs, z and every window (touched or not) bit for bit the product, then
    `causal_conv1d_triton.causal_conv1d`; g and beta within `check_gates_of_product`'s bounds
    of the exact product (the gates kernel's own tolerances); and the same conv without the
    gates programs."""
    from ninfer.kernels import causal_conv1d_triton
    from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv

    monkeypatch.setenv("NINFER_PDL", pdl)
    torch.manual_seed(m)
    weight, taps, windows, state_slots, (ba, A_log, dt_bias) = _layer(shape, m)
    channels, hidden = taps.shape[0], ba.shape[1]
    x, rows = _input(m, hidden, folded)
    conv = gluon_gemv.GdnConv(taps, windows.clone(), state_slots)
    gates = gluon_gemv.GdnGates(ba, A_log, dt_bias)
    assert gluon_gemv.takes_conv(x, weight, conv, gates)

    product = gluon_gemv.q4_linear(x, weight)
    ref_windows = windows.clone()
    starts = query_start_of([1] * m, "cuda")
    ref = causal_conv1d_triton.causal_conv1d(
        product[:, :channels], taps, ref_windows, state_slots, starts
    )
    out, (g, beta) = gluon_gemv.q4_linear_conv(x, weight, conv, gates)
    assert out.shape == product.shape
    assert torch.equal(out[:, :channels], ref)
    assert torch.equal(out[:, channels:], product[:, channels:])
    assert torch.equal(conv.windows, ref_windows)
    assert not torch.equal(ref_windows, windows)
    exact = rows @ ba.double().T
    check_gates_of_product(g, beta, exact, None, A_log, dt_bias, 2e-5, 1)

    alone = gluon_gemv.GdnConv(taps, windows.clone(), state_slots)
    out_alone, no_gates = gluon_gemv.q4_linear_conv(x, weight, alone)
    assert no_gates is None
    assert torch.equal(out_alone, out) and torch.equal(alone.windows, ref_windows)


def _same_bits_under(monkeypatch, switch: str, values, m: int, folded: bool, seed: int):
    """The 27B in projection with its conv and gates at m tokens, run with the module
    constant `switch` at each of `values`: outputs, g, beta and conv windows the same bits."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv

    torch.manual_seed(seed)
    weight, taps, windows, state_slots, (ba, A_log, dt_bias) = _layer("27b", m)
    x, _ = _input(m, ba.shape[1], folded)
    gates = gluon_gemv.GdnGates(ba, A_log, dt_bias)
    runs = []
    for value in values:
        monkeypatch.setattr(gluon_gemv, switch, value)
        conv = gluon_gemv.GdnConv(taps, windows.clone(), state_slots)
        out, (g, beta) = gluon_gemv.q4_linear_conv(x, weight, conv, gates)
        runs.append((out, g, beta, conv.windows))
    for first, *others in zip(*runs, strict=True):
        assert all(torch.equal(first, other) for other in others)


@pytest.mark.parametrize("shares", [2, 4, 8])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "folded"])
@pytest.mark.parametrize("m", [2, 5, 8])
def test_gates_split_by_tokens_give_the_same_bits(monkeypatch, m, folded, shares):
    """`GATE_TOKEN_SHARES`: a gates row split among programs of 8 / shares tokens each (as
    many as the step's tokens need) gives g and beta bit for bit the one-program form, and
    the same conv outputs, at the 27B shape."""
    _same_bits_under(monkeypatch, "GATE_TOKEN_SHARES", (1, shares), m, folded, m + 10)


@pytest.mark.parametrize("folded", [False, True], ids=["plain", "folded"])
@pytest.mark.parametrize("m", [2, 8])
def test_codes_in_wide_boxes_give_the_same_bits(monkeypatch, m, folded):
    """`WIDE_CODES`: the in projection with its conv and gates, its codes asked for as wide
    boxes, gives the narrow boxes' outputs, g, beta and conv windows bit for bit (27B shape)."""
    _same_bits_under(monkeypatch, "WIDE_CODES", (False, True), m, folded, m + 20)


def test_in_projection_with_conv_takes_only_what_fits():
    """One or nine rows, a product whose K is split, a q8 weight, slots not one per row, taps
    not of width 4, a b|a weight of another width: refused (the model then runs them apart)."""
    from ninfer.kernels import groupwise_gemv_gluon as gluon_gemv

    torch.manual_seed(0)
    weight, taps, windows, state_slots, (ba, A_log, dt_bias) = _layer("35b-a3b", 8)
    conv = gluon_gemv.GdnConv(taps, windows, state_slots)
    gates = gluon_gemv.GdnGates(ba, A_log, dt_bias)
    x = torch.randn(8, 2048, device="cuda").to(BF16)
    assert gluon_gemv.takes_conv(x, weight, conv, gates)
    assert gluon_gemv.takes_conv(x, weight, conv, None)
    for rows in (1, 9):
        slots = torch.arange(rows, device="cuda", dtype=torch.int32)
        fewer = gluon_gemv.GdnConv(taps, windows, slots)
        assert not gluon_gemv.takes_conv(x[:1].expand(rows, -1).contiguous(), weight, fewer, None)
    assert not gluon_gemv.takes_conv(
        x, weight, gluon_gemv.GdnConv(taps, windows, state_slots[:4]), None
    )
    wide = taps.new_zeros(taps.shape[0], 5)
    assert not gluon_gemv.takes_conv(
        x, weight, gluon_gemv.GdnConv(wide, windows, state_slots), None
    )
    other = gluon_gemv.GdnGates(ba[:, :1024].contiguous(), A_log, dt_bias)
    assert not gluon_gemv.takes_conv(x, weight, conv, other)
    q8 = get_format("q8_g32_fp16").encode(torch.randn(12288, 2048) * 0.05)
    q8.planes = {name: plane.cuda() for name, plane in q8.planes.items()}
    assert not gluon_gemv.takes_conv(x, q8, conv, None)
    # 8320 q|k|v|z rows of K = 17408: 130 row blocks, K split for two programs an SM
    split = get_format(Q4).encode(torch.randn(8320, 17408) * 0.01)
    split.planes = {name: plane.cuda() for name, plane in split.planes.items()}
    long_x = torch.randn(8, 17408, device="cuda").to(BF16)
    assert gluon_gemv._splits(8320, 17408, long_x.device)[0] > 1
    assert not gluon_gemv.takes_conv(long_x, split, conv, None)


@pytest.mark.parametrize("folded", [False, True], ids=["plain", "folded"])
@pytest.mark.parametrize("sequences", [2, 8])
def test_gdn_decode_step_through_the_one_kernel(monkeypatch, sequences, folded):
    """A GDN layer (27B widths, q4 projections stacked, b|a dense) at a decode step of several
    sequences: one in-projection kernel (`groupwise_linear_conv_and_gates`) and no conv and
    gates launch; its output and states within bf16 rounding of the step with the conv and
    gates kernel apart (the gates' sums run in another order), its conv windows bit for bit."""
    from ninfer.models.layers import gated_deltanet

    layer, ctx = _gdn_layer(sequences)
    x, _ = _input(sequences, 5120, folded)
    windows = ctx.cache.conv_window[0].clone()
    states = ctx.cache.gdn_state[0].clone()
    apart = []
    real_apart = gated_deltanet.causal_conv1d_and_gates
    monkeypatch.setattr(
        gated_deltanet,
        "causal_conv1d_and_gates",
        lambda *args: apart.append(1) or real_apart(*args),
    )
    one = layer(x, ctx)
    assert apart == []
    one_windows, one_states = ctx.cache.conv_window[0].clone(), ctx.cache.gdn_state[0].clone()

    ctx.cache.conv_window[0].copy_(windows)
    ctx.cache.gdn_state[0].copy_(states)
    monkeypatch.setattr(gated_deltanet, "groupwise_linear_conv_and_gates", lambda *a: None)
    two = layer(x, ctx)
    assert apart == [1]
    assert torch.equal(ctx.cache.conv_window[0], one_windows)
    assert relative_error(one, two) < 1e-2
    assert relative_error(one_states, ctx.cache.gdn_state[0]) < 1e-2


def _gdn_layer(sequences: int):
    """A 27B-wide GDN layer on the GPU with q4 q|k|v, z and out projections, stacked as a q4
    model stacks them (q|k|v|z encoded, b|a dense), and a decode context of `sequences`
    sequences over shuffled state slots."""
    from ninfer.models.layers.gated_deltanet import GatedDeltaNet
    from ninfer.models.layers.linear import GroupwiseLinear

    torch.manual_seed(sequences)
    hidden, key_heads, value_heads, head_dim = 5120, 16, 48, 128
    layer = GatedDeltaNet(hidden, key_heads, value_heads, head_dim, head_dim, 4, 1e-6, 0)
    for param in layer.parameters():
        nn.init.normal_(param, std=hidden**-0.5)
    layer = layer.to(device="cuda", dtype=BF16)  # before the encoded planes: fp16 scales stay
    for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
        encoded = get_format(Q4).encode(getattr(layer, name).weight.detach().float().cpu())
        encoded.planes = {plane: value.cuda() for plane, value in encoded.planes.items()}
        setattr(layer, name, GroupwiseLinear(encoded))
    assert layer.fuse_projections() == ["in_proj_qkvz", "in_proj_ba"]
    assert isinstance(layer.in_proj_qkvz.linear, GroupwiseLinear)
    slots = sequences + 4
    ctx = SimpleNamespace(
        is_decode=True,
        cache=SimpleNamespace(
            conv_window=[torch.randn(slots, layer.conv_dim, 3, device="cuda").to(BF16)],
            gdn_state=[torch.randn(slots, value_heads, head_dim, head_dim, device="cuda") * 0.5],
        ),
        state_slots=torch.randperm(slots, device="cuda")[:sequences].to(torch.int32),
        query_start=query_start_of([1] * sequences, "cuda"),
    )
    return layer, ctx

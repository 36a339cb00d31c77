"""Producers of an integer GEMV's input write its codes beside it (`kernels/x_split.py`),
under Triton's CPU interpreter: RMSNorm(+residual) alone and inside the MoE router, the
SwiGLU product, the attention output gate (alone, and in the decode attention's merge kernel)
and the GDN gated norm each attach exactly what the split kernel makes of their output (in the consumer's shape), nothing when
not asked or over more rows than the GEMV takes, and the GEMV then computes the same product
without splitting x again. fp16 here (tests/triton_interpreter.py says why)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_swiglu_combine
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.kernels.x_split import SplitRequest, attached
from ninfer.quant import EncodedTensor, get_format

require_interpreter()

FORMATS = ["q4_g64_fp16", "q8_g32_fp16"]
DTYPE = torch.float16


def rms_norm(request, tokens):
    module = load_kernel_module("rms_norm_triton")
    x, residual = torch.randn(tokens, 2048).to(DTYPE), torch.randn(tokens, 2048).to(DTYPE)
    normed, _ = module.rms_norm(x, torch.randn(2048) * 0.1, 1e-6, residual, request)
    return normed


def norm_in_router(request, tokens):
    module = load_kernel_module("moe_router_triton")
    x, residual = torch.randn(tokens, 2048).to(DTYPE), torch.randn(tokens, 2048).to(DTYPE)
    router = (torch.randn(9, 2048) * 0.02).to(DTYPE)
    norm_weight = torch.randn(2048) * 0.1
    return module.moe_norm_router_route(
        x, residual, norm_weight, 1e-6, router, 8, 2, 0, 8, False, request
    )[2]


def silu_mul(request, tokens):
    module = load_kernel_module("swiglu_triton")
    gate_up = torch.randn(tokens, 2 * 3072).to(DTYPE)  # two fused halves: strided rows
    gate, up = gate_up.chunk(2, dim=-1)
    return module.silu_mul(gate, up, request)


def sigmoid_gate(request, tokens):
    module = load_kernel_module("output_gate_triton")
    query_gate = torch.randn(tokens, 8, 2 * 256).to(DTYPE)
    attn = torch.randn(tokens, 8, 256).to(DTYPE)
    return module.sigmoid_gate(attn, query_gate[..., 256:], request)


def gated_rms_norm(request, tokens):
    module = load_kernel_module("gated_rms_norm_triton")
    x, z = torch.randn(tokens, 32, 128).to(DTYPE), torch.randn(tokens, 32, 128).to(DTYPE)
    return module.gated_rms_norm(x, z, torch.randn(128).to(DTYPE), 1e-6, request).reshape(
        tokens, 32 * 128
    )


def gated_attention(request, tokens):
    module = load_kernel_module("paged_attention_triton")
    pages = torch.arange(tokens * 2, dtype=torch.int32).reshape(tokens, 2)
    k_cache, v_cache = (torch.randn(tokens * 2, 64, 2, 256).to(DTYPE) for _ in range(2))
    query_gate = torch.randn(tokens, 8, 2 * 256).to(DTYPE)
    lens = torch.full((tokens,), 100, dtype=torch.int32)
    query, gate = query_gate[..., :256].contiguous(), query_gate[..., 256:]
    return module.paged_attention_decode_gated(
        query, k_cache, v_cache, pages, lens, 256**-0.5, gate, request
    )


PRODUCERS = [rms_norm, norm_in_router, silu_mul, sigmoid_gate, gated_rms_norm, gated_attention]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("produce", PRODUCERS, ids=lambda f: f.__name__)
def test_producer_attaches_the_split_of_its_output(produce, fmt):
    torch.manual_seed(0)
    gemv = load_kernel_module("groupwise_gemv_triton")
    request = SplitRequest.for_format(fmt)
    x = produce(request, 1)
    bits, group = request.bits, request.group
    split = attached(x, bits, group, x.shape[1] // group)
    assert split is not None
    codes, corr, steps = gemv.split_x(x.contiguous(), bits, group, x.shape[1])
    assert torch.equal(split.codes, codes) and torch.equal(split.steps, steps)
    if bits == 4:  # q8 has no correction term
        assert torch.equal(split.corr, corr)


@pytest.mark.parametrize("produce", PRODUCERS, ids=lambda f: f.__name__)
def test_nothing_attached_unasked_or_over_the_rows_the_gemv_takes(produce):
    request = SplitRequest.for_format("q4_g64_fp16")
    assert attached(produce(None, 1), 4, 64, 32) is None
    two_rows = produce(request, 2)
    assert attached(two_rows, 4, 64, two_rows.shape[1] // 64) is None


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_takes_the_attached_codes_and_gives_the_same_product(fmt, monkeypatch):
    torch.manual_seed(1)
    gemv = load_kernel_module("groupwise_gemv_triton")
    x = rms_norm(SplitRequest.for_format(fmt), 1)
    weight = get_format(fmt).encode(torch.randn(96, x.shape[1]) * 0.05)
    expected = gemv.integer_linear(x.clone(), weight)

    def no_split(*args):
        raise AssertionError("x split again")

    monkeypatch.setattr(gemv, "split_x", no_split)
    assert torch.equal(gemv.integer_linear(x, weight), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("width", [2112, 5120])  # 33 groups of 64: the last part is partial
def test_rms_norm_split_in_parts_writes_the_rows_it_writes_unsplit(fmt, width):
    """Splitting, RMSNorm runs a program per part of the row; together they write the same
    normed row and residual sum as the one program that does not split, and the codes of it."""
    torch.manual_seed(1)
    module = load_kernel_module("rms_norm_triton")
    gemv = load_kernel_module("groupwise_gemv_triton")
    x, residual = torch.randn(1, width).to(DTYPE), torch.randn(1, width).to(DTYPE)
    weight = torch.randn(width) * 0.1
    request = SplitRequest.for_format(fmt)
    normed, total = module.rms_norm(x, weight, 1e-6, residual, request)
    plain_normed, plain_total = module.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(normed, plain_normed) and torch.equal(total, plain_total)
    split = attached(normed, request.bits, request.group, width // request.group)
    codes, _, steps = gemv.split_x(plain_normed, request.bits, request.group, width)
    assert torch.equal(split.codes, codes) and torch.equal(split.steps, steps)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("produce", PRODUCERS, ids=lambda f: f.__name__)
def test_writing_the_codes_leaves_the_output_as_it_was(produce, fmt):
    """The codes come from the output's values in registers: the output itself is the same
    bit for bit with and without them."""
    torch.manual_seed(1)
    with_codes = produce(SplitRequest.for_format(fmt), 1)
    torch.manual_seed(1)
    assert torch.equal(with_codes, produce(None, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_inside_the_down_product_gives_the_two_kernels_bit_for_bit(fmt, monkeypatch):
    """The experts' down projection with the SwiGLU in its kernel (`grouped_swiglu_linear`,
    rows of K = 512 read whole) gives SwiGLU with its codes and then the grouped product, bit
    for bit, a padding pair (x row -1) writing nothing in both (outputs start as NaN here)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", poisoned)
    gemv = load_kernel_module("groupwise_gemv_triton")
    swiglu = load_kernel_module("swiglu_triton")
    experts, rows, k, pairs = 5, 48, 512, 4
    stacked = get_format(fmt).encode(torch.randn(experts * rows, k) * 0.05)
    planes = {name: p.reshape(experts, rows, -1) for name, p in stacked.planes.items()}
    weight = EncodedTensor(stacked.format, stacked.layout, (experts, rows, k), planes)
    assert gemv.swiglu_fits(weight)
    gate_up = (torch.randn(pairs, 2 * k) * 2).to(DTYPE)
    x_rows = torch.tensor([0, 1, -1, 3], dtype=torch.int32)
    ids = torch.tensor([4, 0, 2, 4], dtype=torch.int32)
    fused = gemv.grouped_swiglu_linear(gate_up, weight, x_rows, ids)
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = swiglu.silu_mul(gate, up, SplitRequest.for_format(fmt, pairs))
    bits, group = gemv.SUPPORTED[fmt]
    assert attached(hidden, bits, group, k // group) is not None  # the product reads the codes
    unfused = gemv.grouped_groupwise_linear(hidden, weight, x_rows, ids)
    assert torch.equal(fused[[0, 1, 3]], unfused[[0, 1, 3]])
    assert fused[2].isnan().all() and unfused[2].isnan().all()
    with pytest.raises(ValueError, match=f"takes {2 * k}"):  # gate|up is twice K wide
        gemv.grouped_swiglu_linear(gate_up[:, :k], weight, x_rows, ids)


@pytest.mark.parametrize("early", [False, True], ids=["routes-after-poll", "routes-early"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("top_k", [8, 2])
def test_the_combine_inside_the_down_product_gives_the_two_kernels_bit_for_bit(
    fmt, top_k, early, monkeypatch
):
    """One token's down product with the SwiGLU and the MoE combine in its kernel
    (`grouped_swiglu_combine`): the block's output of `grouped_swiglu_linear` then the combine
    kernel, bit for bit, the mailbox left at zero (80 rows: two row blocks, the second
    partly masked). `early`: the poller's routes read before the product
    (`COMBINE_ROUTES_EARLY`)."""
    gemv = load_kernel_module("groupwise_gemv_triton")
    monkeypatch.setattr(gemv, "COMBINE_ROUTES_EARLY", early)
    check_swiglu_combine(
        gemv,
        load_kernel_module("moe_combine_triton"),
        fmt,
        12,
        80,
        512,
        top_k,
        DTYPE,
        "cpu",
    )


def test_the_combine_inside_refuses_what_it_cannot_carry(monkeypatch):
    """None (the caller runs the two kernels) for fp32 rows, whose values do not fit a word
    beside a mark, a top-k that is not a power of two, a routes list without the shared
    pair, weights or ids not side by side, and with `INT_COMBINE_INSIDE` off."""
    from ninfer.kernels.moe_routing import Routes

    gemv = load_kernel_module("groupwise_gemv_triton")
    stacked = get_format("q4_g64_fp16").encode(torch.randn(3 * 64, 512) * 0.05)
    planes = {name: p.reshape(3, 64, -1) for name, p in stacked.planes.items()}
    weight = EncodedTensor(stacked.format, stacked.layout, (3, 64, 512), planes)
    gate = torch.zeros(1, 1, dtype=DTYPE)

    def routes(top_k: int, pairs: int) -> Routes:
        ids = torch.zeros(1, top_k, dtype=torch.int32)
        lists = torch.zeros(3, pairs, dtype=torch.int32)
        return Routes(torch.ones(1, top_k, dtype=DTYPE), ids, *lists)

    def combined(rows, top_k, pairs):
        return gemv.grouped_swiglu_combine(rows, weight, routes(top_k, pairs), 0, 2, gate)

    gate_up = torch.randn(3, 1024).to(DTYPE)
    assert combined(gate_up, 2, 3) is not None
    assert combined(gate_up.float(), 2, 3) is None
    assert combined(torch.randn(4, 1024).to(DTYPE), 3, 4) is None
    assert combined(gate_up[:2], 2, 2) is None
    apart = routes(2, 3)._replace(weights=torch.ones(1, 4, dtype=DTYPE)[:, ::2])
    assert gemv.grouped_swiglu_combine(gate_up, weight, apart, 0, 2, gate) is None
    monkeypatch.setattr(gemv, "INT_COMBINE_INSIDE", False)
    assert combined(gate_up, 2, 3) is None

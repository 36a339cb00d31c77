"""The Triton decode kernels on the GPU against their torch references, on fresh random inputs
in the real model shapes (Qwen3.5-27B and -35B-A3B heads) and several batch compositions."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import (
    check_causal_conv1d,
    check_causal_conv1d_and_gates,
    check_gated_rms_norm,
    check_gdn_recurrent,
    check_gdn_recurrent_from_x,
    check_gdn_recurrent_from_x_normed,
    check_groupwise_dequant,
    check_groupwise_linear,
    check_paged_attention,
    check_rms_norm,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize(
    "seq_lens",
    [[1], [64], [65, 3, 128, 4000], [9000], [int(n) for n in torch.randint(1, 3000, (13,))]],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(24, 4), (16, 2), (8, 8)])
def test_paged_decode_attention(seq_lens, num_heads, num_kv_heads):
    from ninfer.kernels import paged_attention_triton

    check_paged_attention(
        paged_attention_triton, seq_lens, num_heads, num_kv_heads, 256, BF16, "cuda", 1e-2
    )


@pytest.mark.parametrize("seq_lens", [[1], [300], [65, 3, 128, 4000, 9000]], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(24, 4), (16, 2)])
@pytest.mark.parametrize("fmt", [None, "q4_g64_fp16", "q8_g32_fp16"])
def test_paged_decode_attention_with_the_gate_in_the_merge(seq_lens, num_heads, num_kv_heads, fmt):
    """Bit for bit the attention followed by the output-gate kernel, o_proj's codes included
    (one sequence: the codes are written for the integer GEMV's one row)."""
    from ninfer.kernels import output_gate_triton, paged_attention_triton
    from ninfer.kernels.x_split import SplitRequest, attached

    pages_each = [(n + 63) // 64 for n in seq_lens]
    num_pages = sum(pages_each) + 5
    k_cache, v_cache = (
        torch.randn(num_pages, 64, num_kv_heads, 256, device="cuda", dtype=BF16) for _ in range(2)
    )
    order = torch.randperm(num_pages).tolist()
    page_table = torch.full((len(seq_lens), max(pages_each)), -1, dtype=torch.int32)
    for i, count in enumerate(pages_each):
        page_table[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    page_table = page_table.cuda()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    query_gate = torch.randn(len(seq_lens), num_heads, 512, device="cuda", dtype=BF16)
    q, gate = query_gate[..., :256].contiguous(), query_gate[..., 256:]
    request = SplitRequest.for_format(fmt) if fmt else None
    args = (q, k_cache, v_cache, page_table, lens, 256**-0.5)
    fused = paged_attention_triton.paged_attention_decode_gated(*args, gate, request, max(seq_lens))
    attn = paged_attention_triton.paged_attention_decode(*args, max(seq_lens))
    separate = output_gate_triton.sigmoid_gate(attn, gate, request)
    assert torch.equal(fused, separate)
    if request is not None and len(seq_lens) == 1:
        groups = fused.shape[1] // request.group
        mine = attached(fused, request.bits, request.group, groups)
        theirs = attached(separate, request.bits, request.group, groups)
        assert torch.equal(mine.codes, theirs.codes) and torch.equal(mine.steps, theirs.steps)
        if request.bits == 4:
            assert torch.equal(mine.corr, theirs.corr)


@pytest.mark.parametrize("query_lens", [[1], [1] * 8, [1] * 33, [2, 1, 4]])
@pytest.mark.parametrize(("num_key_heads", "num_value_heads"), [(16, 48), (16, 32), (4, 4)])
def test_gdn_recurrent(query_lens, num_key_heads, num_value_heads):
    from ninfer.kernels import gdn_recurrent_triton

    check_gdn_recurrent(
        gdn_recurrent_triton,
        query_lens,
        num_key_heads,
        num_value_heads,
        128,
        128,
        BF16,
        "cuda",
        1e-2,
    )


@pytest.mark.parametrize("query_lens", [[1], [1] * 8, [2, 1, 3]])
def test_gdn_recurrent_with_bf16_states(query_lens):
    """bf16 state slots (`EngineConfig.gdn_state_dtype`): read as fp32, updated in fp32 and
    rounded once when stored, as the reference does."""
    from ninfer.kernels import gdn_recurrent_triton

    check_gdn_recurrent(
        gdn_recurrent_triton, query_lens, 16, 48, 128, 128, BF16, "cuda", 1e-2, BF16
    )


def test_gdn_recurrent_fp32_is_tight():
    from ninfer.kernels import gdn_recurrent_triton

    check_gdn_recurrent(gdn_recurrent_triton, [1, 3, 1], 2, 6, 128, 64, torch.float32, "cuda", 1e-5)


@pytest.mark.parametrize("query_lens", [[1], [1] * 8, [1] * 16, [2, 1, 3]])
@pytest.mark.parametrize(
    ("num_value_heads", "hidden"), [(48, 5120), (32, 2048)], ids=["27b", "35b-a3b"]
)
def test_gdn_recurrent_with_the_gates_inside(query_lens, num_value_heads, hidden):
    """bf16 at the model shapes (16 key heads, dk = dv = 128): bit for bit the gates-from-x
    kernel followed by the delta rule, both computing b and a in `_x_dot_rows` with 4 warps
    over the same [1, 1024] tiles, so in one summation order; within the delta rule's bf16
    tolerance of the torch reference."""
    from ninfer.kernels import gdn_gates_triton, gdn_recurrent_triton

    check_gdn_recurrent_from_x(
        gdn_recurrent_triton,
        gdn_gates_triton,
        query_lens,
        16,
        num_value_heads,
        128,
        128,
        hidden,
        BF16,
        "cuda",
        1e-2,
    )


@pytest.mark.parametrize("split", [None, (4, 64), (8, 32)], ids=["no-codes", "q4", "q8"])
@pytest.mark.parametrize(
    ("num_value_heads", "hidden"), [(48, 5120), (32, 2048)], ids=["27b", "35b-a3b"]
)
def test_gdn_recurrent_with_the_output_norm_inside(monkeypatch, num_value_heads, hidden, split):
    """bf16 at the model shapes, one token: each head's last column block to arrive runs the
    output norm, bit for bit the norm kernel after the rule (output, codes, states), three
    calls over the same arrival counters; the 35B-A3B's eight blocks a head too, which the
    model leaves to the norm's kernel (`NORM_LAST_MAX_BLOCKS`)."""
    from ninfer.kernels import gated_rms_norm_triton, gdn_recurrent_triton
    from ninfer.kernels.x_split import SplitRequest

    monkeypatch.setattr(gdn_recurrent_triton, "NORM_LAST_MAX_BLOCKS", 8)

    check_gdn_recurrent_from_x_normed(
        gdn_recurrent_triton,
        gated_rms_norm_triton,
        16,
        num_value_heads,
        128,
        128,
        hidden,
        SplitRequest(*split, 1) if split else None,
        BF16,
        "cuda",
    )


@pytest.mark.parametrize("query_lens", [[1], [1] * 8, [1, 100, 700], [3, 1, 2]])
@pytest.mark.parametrize("channels", [10240, 8192, 200])
def test_causal_conv1d(query_lens, channels):
    from ninfer.kernels import causal_conv1d_triton

    check_causal_conv1d(causal_conv1d_triton, query_lens, channels, 4, BF16, "cuda", 1e-2)


@pytest.mark.parametrize("query_lens", [[1024], [1000] + [3] * 150, [130] * 31 + [2, 1]])
def test_causal_conv1d_prefill_over_spans(query_lens):
    """One long prompt over many spans; a long prompt beside 150 short ones (each program's span
    search walks two blocks of sequences); many equal prompts with a few shorter than K - 1."""
    from ninfer.kernels import causal_conv1d_triton

    check_causal_conv1d(causal_conv1d_triton, query_lens, 10240, 4, BF16, "cuda", 1e-2)


@pytest.mark.parametrize("query_lens", [[1] * 8, [1, 1], [3, 1, 2], [16]])
@pytest.mark.parametrize(
    ("channels", "heads", "hidden"), [(10240, 48, 5120), (8192, 32, 2048)], ids=["27B", "35B-A3B"]
)
def test_causal_conv1d_and_gates(query_lens, channels, heads, hidden):
    """Decode steps of eight and two sequences, a verification-sized batch and a small prompt
    at the 27B and 35B-A3B GDN shapes: the same bits as the two kernels apart."""
    from ninfer.kernels import causal_conv1d_triton, gdn_gates_triton

    check_causal_conv1d_and_gates(
        causal_conv1d_triton, gdn_gates_triton, query_lens, channels, heads, hidden, BF16, "cuda"
    )


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize(("dim", "strided"), [(5120, False), (2048, False), (256, True)])
def test_rms_norm(rows, dim, strided):
    from ninfer.kernels import rms_norm_triton

    check_rms_norm(rms_norm_triton, rows, dim, BF16, "cuda", 1e-2, strided)


@pytest.mark.parametrize("tokens", [1, 8, 4096])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(BF16, torch.finfo(BF16).eps, id="bf16"),
        pytest.param(torch.float32, 1e-5, id="fp32"),
    ],
)
def test_rms_norm_fused_with_residual_add_at_27b_hidden(tokens, dtype, tol):
    """A decoder layer's residual add fused into the norm after it (hidden 5120): the sum
    equals torch's add bit for bit; the norm of it is within tol * |ref| at every element (in
    bf16 one rounding step: fp32 sum and rsqrt differing from torch's in the last bits flip a
    rounding at most)."""
    from ninfer.kernels import rms_norm as norm_reference
    from ninfer.kernels import rms_norm_triton

    mixer_out = torch.randn(tokens, 5120, device="cuda").to(dtype)
    residual = (torch.randn(tokens, 5120, device="cuda") * 4).to(dtype)
    weight = (torch.randn(5120, device="cuda") * 0.1).to(dtype)
    normed, stream = rms_norm_triton.rms_norm(mixer_out, weight, 1e-6, residual)
    ref_normed, ref_stream = norm_reference.rms_norm(mixer_out, weight, 1e-6, residual)
    assert torch.equal(stream, residual + mixer_out)
    assert torch.equal(stream, ref_stream)
    bound = tol * ref_normed.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((normed.float() - ref_normed.float()).abs() <= bound).all()


@pytest.mark.parametrize("tokens", [1, 8, 4096])
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(BF16, torch.finfo(BF16).eps, id="bf16"),
        pytest.param(torch.float32, 1e-6, id="fp32"),
    ],
)
def test_sigmoid_gate_at_27b_attention_shape(tokens, dtype, tol):
    """The attention output gate, 24 heads of 256, gate read from q_proj's [query | gate] rows:
    within tol * |ref| at every element (in bf16 one rounding step: exp differing from torch's
    in the last fp32 bits flips the rounding of sigmoid or of the product at most)."""
    from ninfer.kernels import output_gate as gate_reference
    from ninfer.kernels import output_gate_triton

    query_gate = (torch.randn(tokens, 24, 512, device="cuda") * 3).to(dtype)
    gate = query_gate[..., 256:]
    attn = torch.randn(tokens, 24, 256, device="cuda").to(dtype)
    out = output_gate_triton.sigmoid_gate(attn, gate)
    ref = gate_reference.sigmoid_gate(attn, gate)
    assert out.shape == (tokens, 24 * 256)
    bound = tol * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.float() - ref.float()).abs() <= bound).all()


@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_gated_rms_norm(tokens):
    """The 27B GDN output norm shape, [tokens, 48 value heads, 128]. bf16 within one rounding
    step at the output's scale (finfo.eps * max|ref|): fp32 sum and rsqrt differing from torch's
    in the last bits flip the bf16 rounding of normed or of the output by at most a step."""
    from ninfer.kernels import gated_rms_norm_triton

    check_gated_rms_norm(
        gated_rms_norm_triton, tokens, 48, 128, BF16, "cuda", torch.finfo(BF16).eps
    )
    check_gated_rms_norm(gated_rms_norm_triton, tokens, 48, 128, torch.float32, "cuda", 1e-5)


@pytest.mark.parametrize("m", [1, 4, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(1024, 5120), (4000, 1000), (320, 17408)])
@pytest.mark.parametrize("format_name", ["q8_g32_fp16", "q4_g64_fp16"])
def test_groupwise_linear(format_name, m, n, k):
    from ninfer.kernels import groupwise_gemv_triton

    check_groupwise_linear(groupwise_gemv_triton, format_name, m, n, k, BF16, "cuda", 1e-2)


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(17408, 5120), (5120, 17408), (4001, 1000)])
@pytest.mark.parametrize("format_name", ["q8_g32_fp16", "q4_g64_fp16"])
def test_groupwise_dequant(format_name, n, k, dtype):
    from ninfer.kernels import groupwise_dequant_triton

    check_groupwise_dequant(groupwise_dequant_triton, format_name, n, k, dtype, "cuda")


def test_groupwise_dequant_covers_the_gemv_formats():
    from ninfer.kernels import groupwise_dequant_triton, groupwise_gemv_triton

    assert set(groupwise_dequant_triton.SUPPORTED) == set(groupwise_gemv_triton.SUPPORTED)


def test_dispatch_sends_cuda_tensors_to_triton(monkeypatch):
    from ninfer.kernels import dispatch, rms_norm_triton

    calls = []
    real = rms_norm_triton.rms_norm
    monkeypatch.setattr(rms_norm_triton, "rms_norm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 64, device="cuda", dtype=BF16)
    dispatch.rms_norm(x, torch.zeros(64, device="cuda", dtype=BF16), 1e-6)
    dispatch.rms_norm(x.cpu(), torch.zeros(64, dtype=BF16), 1e-6)
    assert calls == [1]


def test_dispatch_sends_cuda_gated_rms_norm_to_triton(monkeypatch):
    from ninfer.kernels import dispatch, gated_rms_norm_triton

    calls = []
    real = gated_rms_norm_triton.gated_rms_norm
    monkeypatch.setattr(
        gated_rms_norm_triton, "gated_rms_norm", lambda *a: calls.append(1) or real(*a)
    )
    x = torch.randn(1, 48, 128, device="cuda", dtype=BF16)
    weight = torch.ones(128, device="cuda", dtype=BF16)
    dispatch.gated_rms_norm(x, x, weight, 1e-6)
    dispatch.gated_rms_norm(x.cpu(), x.cpu(), weight.cpu(), 1e-6)
    assert calls == [1]

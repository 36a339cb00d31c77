"""Decoder norms folded into the Gluon q4 products beside them (`kernels/norm_fold.py`) on the
GPU: the producer's epilogue writes the add bit for bit and the weighted rows as the
reference does; a consumer's epilogue (plain, split K, SwiGLU) and the GDN gates take the
rows' factors within the bf16 rounding of the fp32 product; and a q4 model folds at two to
eight rows with the tokens of its graphs those of its eager steps, and the logits of the
unfolded model."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_causal_conv1d_and_gates, relative_error

from ninfer.kernels.norm_fold import SQUARE_COLUMNS, NormAfter, fold_norm
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")
Q4 = "q4_g64_fp16"


def _weight(n: int, k: int):
    return get_format(Q4).encode(torch.randn(n, k, device="cuda") * 0.05)


def _after(m: int, n: int) -> NormAfter:
    residual = (torch.randn(m, n, device="cuda") * 4).to(torch.bfloat16)
    return NormAfter(residual, (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16), 1e-6)


@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(5120, 6144), (5120, 17408), (1000, 512)], ids=str)
def test_product_writes_the_add_and_the_norms_parts(monkeypatch, n, k, m, pdl):
    """K split (the 27B out projections and down) or not, part-full blocks: the sum is the
    unfused add of the plain product's output, bit for bit, and so are the weighted rows; each
    row block's sums of squares those of the sum's block, in another order."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setenv("NINFER_PDL", pdl)
    torch.manual_seed(m * n)
    weight, after = _weight(n, k), _after(m, n)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    block = groupwise_gemv_gluon._config(n, k, x.device)[0]
    want_rows, want_total = fold_norm(groupwise_gemv_gluon.q4_linear(x, weight), after, block)
    rows, total = groupwise_gemv_gluon.q4_linear(x, weight, after)
    assert torch.equal(total, want_total)
    assert torch.equal(rows.weighted, want_rows.weighted)
    assert rows.squares.shape == (-(-n // block), SQUARE_COLUMNS) and rows.eps == after.eps
    torch.testing.assert_close(rows.squares, want_rows.squares, rtol=1e-5, atol=0)
    again, _ = groupwise_gemv_gluon.q4_linear(x, weight, after)  # the counters were reset
    assert torch.equal(again.squares, rows.squares)


def _rows(m: int, k: int):
    """A folded norm's rows of width k, from the reference, with their exact fp32 values."""
    y = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    rows, _ = fold_norm(y, _after(m, k), 64)
    return rows, rows.weighted.float() * rows.row_scale()[:, None]


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize(
    ("n", "k"), [(14336, 5120), (16384, 5120), (5120, 17408), (70, 1024)], ids=str
)
def test_product_takes_a_folded_norms_rows(n, k, m):
    """The 27B attention q|k|v and GDN in projections, a split product, a part-full block:
    within the bf16 rounding of the fp32 product of the rows' exact values."""
    from ninfer.kernels import dispatch, groupwise_gemv_gluon

    torch.manual_seed(m + n)
    weight = _weight(n, k)
    rows, exact_x = _rows(m, k)
    exact = exact_x @ weight.decode(torch.float32).T
    out = groupwise_gemv_gluon.q4_linear(rows, weight)
    assert out.shape == (m, n) and relative_error(out, exact) < 4e-3
    assert torch.equal(dispatch.groupwise_linear(rows, weight), out)


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize(("n", "k"), [(34816, 5120), (2 * 70, 512)], ids=str)
def test_swiglu_product_takes_a_folded_norms_rows(n, k, m):
    from ninfer.kernels import groupwise_gemv_gluon

    torch.manual_seed(m + n)
    weight = _weight(n, k)
    rows, exact_x = _rows(m, k)
    gate, up = (exact_x @ weight.decode(torch.float32).T).chunk(2, dim=-1)
    out = groupwise_gemv_gluon.q4_swiglu_linear(rows, weight)
    assert relative_error(out, torch.nn.functional.silu(gate) * up) < 1e-2


def test_gates_take_a_folded_norms_rows():
    """The GDN gates at the 27B shape, alone and in the conv's launch (bit for bit apart)."""
    from ninfer.kernels import causal_conv1d_triton, gdn_gates_triton

    torch.manual_seed(7)
    rows, _ = _rows(8, 5120)
    w_ba = (torch.randn(96, 5120, device="cuda") * 8 * 5120**-0.5).to(torch.bfloat16)
    A_log = (torch.randn(48, device="cuda") * 0.5).to(torch.bfloat16)
    dt_bias = torch.linspace(-3, 3, 48, device="cuda").to(torch.bfloat16)
    g, beta = gdn_gates_triton.gdn_gates_from_x(rows, w_ba, A_log, dt_bias)
    want_g, want_beta = gdn_gates_triton.gdn_gates_from_x(rows.materialize(), w_ba, A_log, dt_bias)
    assert relative_error(g, want_g) < 1e-2 and relative_error(beta, want_beta) < 1e-2
    check_causal_conv1d_and_gates(
        causal_conv1d_triton,
        gdn_gates_triton,
        [1] * 8,
        10240,
        48,
        5120,
        torch.bfloat16,
        "cuda",
        normed_rows=True,
    )


@pytest.fixture(scope="module")
def q4_artifact(tmp_path_factory):
    """A tiny q4 model whose products the Gluon kernel takes (every width a multiple of 512)."""
    from helpers import convert_tiny

    _, path = convert_tiny(
        tmp_path_factory.mktemp("fold"), weights="groupwise-int", layers=4, hidden=512
    )
    return path


def test_q4_model_folds_its_norms_at_two_to_eight_rows(q4_artifact, monkeypatch):
    """The model folds (every layer's products take it): each forward of two to eight rows
    calls the norm twice (the first input norm, the final norm), others once per norm; greedy
    tokens with graphs equal those without; and the folded logits are the unfolded model's
    within bf16 rounding (same best token, log-probability within 0.05)."""
    from test_graphs_gpu import mixed_requests, tokens

    import ninfer
    from ninfer.engine.config import EngineConfig
    from ninfer.engine.engine import load_core
    from ninfer.engine.request import SamplingParams
    from ninfer.models import qwen3_5
    from ninfer.models.layers import norms

    core = load_core(q4_artifact, EngineConfig(device="cuda", dtype="bfloat16", cuda_graph=False))
    assert core.runner.model.fold_norms
    layers = len(core.runner.model.layers)
    del core
    forwards: list[list] = []
    real_norm, real_takes = norms.rms_norm, qwen3_5.takes_norm_folds

    def norm(*args):
        forwards[-1].append(args[0].shape[0])
        return real_norm(*args)

    def takes(x):
        folds = real_takes(x)
        forwards.append([x.shape[0], folds])
        return folds

    monkeypatch.setattr(norms, "rms_norm", norm)
    monkeypatch.setattr(qwen3_5, "takes_norm_folds", takes)
    requests = mixed_requests(11, 8, vocab=512)
    fields = dict(max_context=512, max_concurrency=8, prefill_chunk=128)
    eager = tokens(q4_artifact, requests, cuda_graph=False, **fields)
    assert any(rows == 8 and folds for rows, folds, *_ in forwards)
    for rows, folds, *norm_calls in forwards:
        assert folds == (2 <= rows <= 8)
        assert len(norm_calls) == (2 if folds else 2 * layers + 1)
    monkeypatch.setattr(norms, "rms_norm", real_norm)
    monkeypatch.setattr(qwen3_5, "takes_norm_folds", real_takes)
    assert eager == tokens(q4_artifact, requests, cuda_graph=True, **fields)

    params = SamplingParams.greedy(max_tokens=1, ignore_eos=True, logprobs=5)
    prompt = list(range(20, 26))  # a six-token prefill: folded

    def top():
        with ninfer.Engine(q4_artifact, device="cuda", dtype="bfloat16", max_context=256) as e:
            return dict(e.generate(prompt, params).logprobs[0].top)

    folded = top()
    monkeypatch.setattr(qwen3_5, "NORM_FOLDS", False)
    plain = top()
    best = max(plain, key=plain.get)
    assert max(folded, key=folded.get) == best
    assert abs(folded[best] - plain[best]) < 0.05


@pytest.mark.parametrize("seqs", [2, 8])
def test_recurrent_rule_folds_the_output_norm(seqs):
    """The 27B GDN heads at a decode step of two and eight sequences (column blocks of 32 and
    64)."""
    from kernel_cases import check_gdn_recurrent_normed

    from ninfer.kernels import gdn_recurrent_triton

    torch.manual_seed(seqs)
    check_gdn_recurrent_normed(
        gdn_recurrent_triton, [1] * seqs, 16, 48, 128, 128, torch.bfloat16, "cuda"
    )


@pytest.mark.parametrize("m", [2, 8])
@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_out_projection_takes_the_output_norms_rows(m, blocks):
    """The 27B GDN out projection (K split in three): each group scaled by its head's factors,
    within the bf16 rounding of the fp32 product of the rows' exact values; with the next norm
    folded in, the sum and weighted rows bit for bit the plain product's then the fold's."""
    from ninfer.kernels import groupwise_gemv_gluon
    from ninfer.kernels.norm_fold import HeadNormedRows

    torch.manual_seed(m * blocks)
    heads, dim = 48, 128
    weighted = torch.randn(m, heads * dim, device="cuda").to(torch.bfloat16)
    squares = torch.rand(m, heads, blocks, device="cuda") * dim / blocks * 4
    rows = HeadNormedRows(weighted, squares, dim, 1e-6)
    exact_x = weighted.float().view(m, heads, dim) * rows.head_scale()[:, :, None]
    weight = _weight(5120, heads * dim)
    exact = exact_x.view(m, -1) @ weight.decode(torch.float32).T
    out = groupwise_gemv_gluon.q4_linear(rows, weight)
    assert relative_error(out, exact) < 4e-3
    after = _after(m, 5120)
    normed, total = groupwise_gemv_gluon.q4_linear(rows, weight, after)
    want_normed, want_total = fold_norm(out, after, 64)
    assert torch.equal(total, want_total) and torch.equal(normed.weighted, want_normed.weighted)

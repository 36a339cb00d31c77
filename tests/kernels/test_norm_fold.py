"""A decoder norm folded into its neighbouring products (`norm_fold`): the reference's parts
against the plain norm, and the GDN gates kernel (Triton's CPU interpreter, tiny shapes)
reading a folded norm's rows as it reads a plain input. The Gluon products' epilogues run in
tests/gpu/test_gluon_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_causal_conv1d_and_gates, relative_error

from ninfer.kernels import norm_fold
from ninfer.kernels import rms_norm as norm_reference
from ninfer.kernels.norm_fold import SQUARE_COLUMNS, NormAfter, NormedRows, fold_norm


def _folded(rows: int, width: int, dtype: torch.dtype, block: int):
    y = torch.randn(rows, width).to(dtype)
    residual = (torch.randn(rows, width) * 4).to(dtype)
    weight = (torch.randn(width) * 0.1).to(dtype)
    after = NormAfter(residual, weight, 1e-6)
    return y, after, fold_norm(y, after, block)


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("block", [64, 100])
def test_fold_norm_sum_is_the_add_and_its_rows_the_norm(rows, block):
    """h bit for bit the unfused add; the materialized rows the norm within one bf16 rounding
    of each (u is rounded before the factor); the squares' blocks add up to each row's sum,
    columns past the rows zero."""
    torch.manual_seed(rows * block)
    y, after, (normed, total) = _folded(rows, 640, torch.bfloat16, block)
    want_normed, want_total = norm_reference.rms_norm(y, after.weight, after.eps, after.residual)
    assert torch.equal(total, want_total)
    assert normed.squares.shape == (-(-640 // block), SQUARE_COLUMNS)
    assert torch.equal(normed.squares[:, rows:], torch.zeros_like(normed.squares[:, rows:]))
    sums = total.float().pow(2).sum(dim=-1)
    torch.testing.assert_close(normed.squares.sum(dim=0)[:rows], sums, rtol=1e-6, atol=0)
    got = normed.materialize()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 640)
    bound = 2 * torch.finfo(torch.bfloat16).eps * want_normed.float().abs()
    assert ((got.float() - want_normed.float()).abs() <= bound + 1e-30).all()


def test_fold_norm_in_fp32_is_the_norm():
    torch.manual_seed(0)
    y, after, (normed, _) = _folded(8, 512, torch.float32, 64)
    want, _ = norm_reference.rms_norm(y, after.weight, after.eps, after.residual)
    torch.testing.assert_close(normed.materialize(), want, rtol=1e-6, atol=1e-6)
    assert (normed.shape, normed.dtype, normed.device) == (want.shape, want.dtype, want.device)


def test_fold_norm_takes_at_most_a_squares_table_of_rows():
    y = torch.zeros(SQUARE_COLUMNS + 1, 64)
    after = NormAfter(torch.zeros_like(y), torch.zeros(64), 1e-6)
    with pytest.raises(ValueError, match="at most 8 rows"):
        fold_norm(y, after, norm_fold.REFERENCE_BLOCK)


triton_interpreter = pytest.importorskip("triton_interpreter")


@pytest.mark.parametrize("tokens", [2, 8])
@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"]
)
def test_gates_kernel_takes_a_folded_norms_rows(tokens, dtype, tol):
    """g and beta from a folded norm's rows equal those from the rows materialized, within the
    rounding of u that the fold moves (none in fp32 but the order of operations)."""
    triton_interpreter.require_interpreter()
    module = triton_interpreter.load_kernel_module("gdn_gates_triton")
    torch.manual_seed(tokens)
    heads, hidden = 6, 640
    _, _, (normed, _) = _folded(tokens, hidden, dtype, 64)
    w_ba = (torch.randn(2 * heads, hidden) * 8 * hidden**-0.5).to(dtype)
    A_log = (torch.randn(heads) * 0.5).to(dtype)
    dt_bias = torch.linspace(-3, 3, heads).to(dtype)
    g, beta = module.gdn_gates_from_x(normed, w_ba, A_log, dt_bias)
    want_g, want_beta = module.gdn_gates_from_x(normed.materialize(), w_ba, A_log, dt_bias)
    assert relative_error(g, want_g) < tol
    assert relative_error(beta, want_beta) < tol


def test_conv_and_gates_kernel_takes_a_folded_norms_rows():
    """The conv and the gates in one launch give what each kernel gives apart, bit for bit,
    with the gates' input a folded norm's rows."""
    triton_interpreter.require_interpreter()
    conv = triton_interpreter.load_kernel_module("causal_conv1d_triton")
    gates = triton_interpreter.load_kernel_module("gdn_gates_triton")
    torch.manual_seed(1)
    check_causal_conv1d_and_gates(
        conv, gates, [1] * 4, 96, 6, 640, torch.float16, "cpu", normed_rows=True
    )


def test_a_plain_consumer_reads_the_rows_materialized():
    """The CPU (reference) product of a folded norm's rows is the product of its materialized
    rows (`dispatch.groupwise_linear`), as is the folded product's fallback."""
    from ninfer.kernels import dispatch
    from ninfer.quant import get_format

    torch.manual_seed(2)
    _, after, (normed, _) = _folded(4, 512, torch.float32, 64)
    weight = get_format("q4_g64_fp16").encode(torch.randn(96, 512) * 0.05)
    got = dispatch.groupwise_linear(normed, weight)
    assert torch.equal(got, dispatch.groupwise_linear(normed.materialize(), weight))
    y = torch.randn(4, 512)
    weight = get_format("q4_g64_fp16").encode(torch.randn(512, 512) * 0.05)
    rows, total = dispatch.groupwise_linear_then_norm(y, weight, after)
    want_rows, want_total = fold_norm(dispatch.groupwise_linear(y, weight), after, 64)
    assert torch.equal(total, want_total)
    assert torch.equal(rows.materialize(), want_rows.materialize())
    assert isinstance(rows, NormedRows)


@pytest.mark.parametrize(("dtype"), [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("implementation", ["triton", "reference"])
def test_recurrent_rule_folds_the_output_norm(monkeypatch, implementation, dtype):
    """Three sequences of one token (a decode step) and a verification-sized one, column
    blocks narrower than a head (the kernel's at few sequences on a GPU of 132 SMs: two per
    head here)."""
    from kernel_cases import check_gdn_recurrent_normed

    from ninfer.kernels import dispatch

    torch.manual_seed(3)
    if implementation == "triton":
        triton_interpreter.require_interpreter()
        module = triton_interpreter.load_kernel_module("gdn_recurrent_triton")
        monkeypatch.setattr(module, "num_sms", lambda device: 132)
    else:  # the CPU path of the entry point, the rule then the fold
        module = dispatch
    check_gdn_recurrent_normed(module, [1, 1, 3, 1], 2, 4, 16, 32, dtype, "cpu")


def test_gated_fold_materializes_to_the_gated_norm():
    from ninfer.kernels import gated_rms_norm as gated_norm_reference
    from ninfer.kernels.norm_fold import fold_gated_norm

    torch.manual_seed(4)
    o, z = torch.randn(5, 6, 64), torch.randn(5, 6, 64)
    weight = torch.randn(64) * 0.5 + 1
    rows = fold_gated_norm(o, z, weight, 1e-6, 16)
    assert rows.squares.shape == (5, 6, 4)
    want = gated_norm_reference.gated_rms_norm(o, z, weight, 1e-6)
    torch.testing.assert_close(rows.materialize(), want.view(5, 384), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="do not tile"):
        fold_gated_norm(o, z, weight, 1e-6, 48)

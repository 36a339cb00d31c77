"""Producers of an integer GEMV's input write its codes beside it on the GPU (bf16, the 27B
widths; 35B-A3B's 2048 for the norm inside its router): RMSNorm(+residual), alone and inside
the MoE router, the SwiGLU product, the attention output gate and the GDN gated norm attach
exactly what the split kernel makes of their output, and the GEMV's product with
them is the product without them (`kernels/x_split.py`)."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.x_split import SplitRequest, attached
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

BF16 = {"device": "cuda", "dtype": torch.bfloat16}


def rms_norm(request):
    from ninfer.kernels import rms_norm_triton

    x, residual = torch.randn(1, 5120, **BF16), torch.randn(1, 5120, **BF16)
    weight = torch.randn(5120, device="cuda") * 0.1
    return rms_norm_triton.rms_norm(x, weight, 1e-6, residual, request)[0]


def norm_in_router(request):
    from ninfer.kernels import moe_router_triton

    x, residual = torch.randn(1, 2048, **BF16), torch.randn(1, 2048, **BF16)
    router = torch.randn(257, 2048, **BF16) * 0.02
    weight = torch.randn(2048, device="cuda") * 0.1
    return moe_router_triton.moe_norm_router_route(
        x, residual, weight, 1e-6, router, 256, 8, 0, 256, True, request
    )[2]


def silu_mul(request):
    from ninfer.kernels import swiglu_triton

    gate, up = torch.randn(1, 2 * 17408, **BF16).chunk(2, dim=-1)
    return swiglu_triton.silu_mul(gate, up, request)


def sigmoid_gate(request):
    from ninfer.kernels import output_gate_triton

    query_gate = torch.randn(1, 24, 2 * 256, **BF16)
    attn = torch.randn(1, 24, 256, **BF16)
    return output_gate_triton.sigmoid_gate(attn, query_gate[..., 256:], request)


def gated_rms_norm(request):
    from ninfer.kernels import gated_rms_norm_triton

    x, z = torch.randn(1, 48, 128, **BF16), torch.randn(1, 48, 128, **BF16)
    weight = torch.randn(128, **BF16)
    return gated_rms_norm_triton.gated_rms_norm(x, z, weight, 1e-6, request).reshape(1, -1)


PRODUCERS = [rms_norm, norm_in_router, silu_mul, sigmoid_gate, gated_rms_norm]


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("produce", PRODUCERS, ids=str)
def test_producer_split_is_the_split_of_its_output(produce, fmt):
    from ninfer.kernels import groupwise_gemv_triton as gemv

    torch.manual_seed(0)
    request = SplitRequest.for_format(fmt)
    x = produce(request)
    k, group = x.shape[1], request.group
    split = attached(x, request.bits, group, k // group)
    assert split is not None
    codes, corr, steps = gemv.split_x(x.contiguous(), request.bits, group, k)
    assert torch.equal(split.codes, codes) and torch.equal(split.steps, steps)
    if request.bits == 4:
        assert torch.equal(split.corr, corr)
    weight = get_format(fmt).encode(torch.randn(512, k, device="cuda") * 0.02)
    assert torch.equal(gemv.groupwise_linear(x, weight), gemv.groupwise_linear(x.clone(), weight))


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("produce", PRODUCERS, ids=str)
def test_writing_the_codes_leaves_the_output_as_it_was(produce, fmt):
    """The codes come from the output's values in registers: the output itself is the same
    bit for bit with and without them."""
    torch.manual_seed(1)
    with_codes = produce(SplitRequest.for_format(fmt))
    torch.manual_seed(1)
    assert torch.equal(with_codes, produce(None))

"""The attention prelude kernel (q/k norms, rotary, K/V write in one launch) on the GPU at the
Qwen3.5-27B and -35B-A3B attention shapes: bit for bit the unfused Triton kernels it replaced
(`rms_norm_triton`, `rotary_triton`, `kv_write_triton`), within bf16 rounding of the torch
reference, and the kernel the layer gets from dispatch for CUDA tensors."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import check_attention_prelude, prelude_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

SHAPES = [
    pytest.param(24, 4, 256, 64, id="27b"),
    pytest.param(16, 2, 256, 64, id="35b-a3b"),
]


@pytest.fixture(autouse=True)
def fresh_seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.mark.parametrize("tokens", [1, 8, 37, 300])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "rot_dim"), SHAPES)
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [pytest.param(torch.bfloat16, 1e-2, id="bf16"), pytest.param(torch.float32, 1e-5, id="fp32")],
)
def test_prelude_equals_the_unfused_kernels(
    tokens, num_heads, num_kv_heads, head_dim, rot_dim, dtype, tol
):
    from ninfer.kernels import (
        attention_prelude_triton,
        kv_write_triton,
        rms_norm_triton,
        rotary_triton,
    )

    check_attention_prelude(
        attention_prelude_triton,
        rms_norm_triton,
        rotary_triton,
        kv_write_triton,
        tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        rot_dim,
        dtype,
        "cuda",
        tol,
    )


def test_dispatch_sends_cuda_tensors_to_the_fused_kernel(monkeypatch):
    from ninfer.kernels import attention_prelude_triton, dispatch

    calls = []
    real = attention_prelude_triton.attention_prelude
    monkeypatch.setattr(
        attention_prelude_triton, "attention_prelude", lambda *a: calls.append(1) or real(*a)
    )
    inputs = prelude_inputs(3, 24, 4, 256, 64, torch.bfloat16, "cuda")
    dispatch.attention_prelude(*inputs.values())
    on_cpu = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    dispatch.attention_prelude(*on_cpu.values())
    assert calls == [1]

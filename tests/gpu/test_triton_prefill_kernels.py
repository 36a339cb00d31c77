"""The prefill-path kernels on the GPU against their torch references, on fresh random inputs
in the real model shapes (Qwen3.5-27B: 24 query / 4 KV heads, GDN 16 key / 48 value heads;
-35B-A3B: 16 / 2, GDN 16 / 32; all head_dim 256 and GDN dims 128) and several batch
compositions: fresh prompts, chunks after cached prefixes, one-token rows among long ones."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import (
    check_gdn_chunked,
    check_kv_write,
    check_paged_prefill_attention,
    check_rotary,
    check_silu_mul,
    prelude_inputs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

BF16 = torch.bfloat16
HEADS = pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(24, 4), (16, 2), (8, 8)], ids=["27b", "35b", "mha"]
)


@pytest.fixture(autouse=True)
def fresh_seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


def random_lens(count: int, low: int, high: int, seed: int) -> list[int]:
    """Fixed per seed, so that every collection (e.g. each xdist worker) sees the same tests."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (count,), generator=generator).tolist()


def random_batch(count: int, longest: int) -> tuple[list[int], list[int]]:
    contexts = [0 if n < longest // 4 else n for n in random_lens(count, 0, longest, seed=1)]
    return contexts, random_lens(count, 1, longest, seed=2)


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        ([0], [1]),
        ([0], [64]),
        ([0], [4096]),
        ([4032], [64]),  # a chunk after 63 cached pages
        ([0, 100, 3000, 64, 5], [5, 1, 700, 64, 2000]),
        ([9000, 0], [1, 300]),
        random_batch(13, 1500),
    ],
    ids=["one", "page", "4096", "after-prefix", "mixed", "decode-row", "random13"],
)
@HEADS
def test_paged_prefill_attention(context_lens, query_lens, num_heads, num_kv_heads):
    from ninfer.kernels import paged_attention_prefill_triton

    check_paged_prefill_attention(
        paged_attention_prefill_triton,
        context_lens,
        query_lens,
        num_heads,
        num_kv_heads,
        256,
        BF16,
        "cuda",
        1e-2,
    )


def test_paged_prefill_attention_fp16_and_small_head_dim():
    from ninfer.kernels import paged_attention_prefill_triton

    check_paged_prefill_attention(
        paged_attention_prefill_triton, [70, 0], [130, 33], 6, 2, 64, torch.float16, "cuda", 5e-3
    )


@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4096])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(4, 256), (2, 256), (1, 20)])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_kv_write(num_tokens, num_kv_heads, head_dim, dtype):
    from ninfer.kernels import kv_write_triton

    check_kv_write(kv_write_triton, num_tokens, num_kv_heads, head_dim, dtype, "cuda")


@pytest.mark.parametrize(
    "query_lens",
    [
        [1],
        [64],
        [65, 3, 300],
        [2048],
        [1, 1, 1, 1, 1, 200],
        random_lens(9, 1, 400, seed=3),
    ],
    ids=["one", "chunk", "mixed", "2048", "short-rows", "random9"],
)
@pytest.mark.parametrize(
    ("num_key_heads", "num_value_heads"), [(16, 48), (16, 32)], ids=["27b", "35b"]
)
def test_gdn_prefill_through_fla(query_lens, num_key_heads, num_value_heads):
    pytest.importorskip("fla")
    from ninfer.kernels import gdn_chunked_fla

    # fla keeps q/k and the chunk products in bf16, so bf16 inputs land near 1e-2
    check_gdn_chunked(
        gdn_chunked_fla, query_lens, num_key_heads, num_value_heads, 128, 128, BF16, "cuda", 2e-2
    )


def test_dispatch_routes_prefill_kernels(monkeypatch):
    """bf16 CUDA tensors take the Triton attention and the fused prelude (norms, rotary, K/V
    write) and fla's GDN; fp32 keeps the exact reference for attention and GDN, the prelude
    runs in Triton in any dtype."""
    from ninfer.kernels import attention_prelude_triton, dispatch, paged_attention_prefill_triton

    calls = []
    for module, name in [
        (paged_attention_prefill_triton, "paged_attention_prefill"),
        (attention_prelude_triton, "attention_prelude"),
    ]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    for dtype in (BF16, torch.float32):
        inputs = prelude_inputs(3, 4, 2, 64, 16, dtype, "cuda")
        inputs["kv_write_slots"] = torch.tensor([64, 65, 66], device="cuda")
        query = dispatch.attention_prelude(*inputs.values())
        dispatch.paged_attention_prefill(
            query,
            inputs["k_cache"],
            inputs["v_cache"],
            torch.tensor([[1, -1]], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 3], dtype=torch.int32, device="cuda"),
            torch.tensor([0], dtype=torch.int32, device="cuda"),
            torch.tensor([3], dtype=torch.int32, device="cuda"),
            0.125,
        )
    assert calls == ["attention_prelude", "paged_attention_prefill", "attention_prelude"]


@pytest.mark.parametrize("rows", [1, 7, 4096])
@pytest.mark.parametrize("width", [17408, 512, 1000])
def test_silu_mul(rows, width):
    from ninfer.kernels import swiglu_triton

    check_silu_mul(swiglu_triton, rows, width, BF16, "cuda", 1e-2)
    check_silu_mul(swiglu_triton, rows, width, torch.float32, "cuda", 1e-5)


@pytest.mark.parametrize("tokens", [1, 33, 4096])
@pytest.mark.parametrize("num_heads", [24, 16, 4, 2])
def test_rotary(tokens, num_heads):
    from ninfer.kernels import rotary_triton

    check_rotary(rotary_triton, tokens, num_heads, 256, 64, BF16, "cuda", 1e-2)
    check_rotary(rotary_triton, tokens, num_heads, 256, 64, torch.float32, "cuda", 1e-5)


@pytest.mark.parametrize("query_lens", [[65, 3, 300], [1, 1, 200]], ids=["mixed", "short-rows"])
def test_gdn_prefill_through_fla_with_bf16_states(query_lens):
    """bf16 state slots: fla starts from them as fp32 and its final states are rounded back."""
    pytest.importorskip("fla")
    from ninfer.kernels import gdn_chunked_fla

    check_gdn_chunked(
        gdn_chunked_fla, query_lens, 16, 48, 128, 128, BF16, "cuda", 2e-2, state_dtype=BF16
    )

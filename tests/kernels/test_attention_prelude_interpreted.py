"""The attention prelude kernel (q/k norms, rotary, K/V write in one launch) under Triton's CPU
interpreter on tiny shapes: bit for bit the unfused Triton kernels it replaces, within rounding
of the torch reference. Half precision vs the reference is fp16 (tests/triton_interpreter.py
says why); bf16 is compared with the unfused kernels only, which the interpreter rounds alike."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_attention_prelude, prelude_inputs, run_prelude
from triton_interpreter import load_kernel_module, require_interpreter

require_interpreter()

SHAPES = [
    pytest.param(4, 2, 32, 8, id="rot<D"),
    pytest.param(3, 1, 20, 6, id="D-not-power-of-2"),
    pytest.param(2, 2, 16, 16, id="rot=D"),
]


@pytest.fixture
def kernels():
    torch.manual_seed(0)
    return [
        load_kernel_module(name)
        for name in (
            "attention_prelude_triton",
            "rms_norm_triton",
            "rotary_triton",
            "kv_write_triton",
        )
    ]


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "rot_dim"), SHAPES)
@pytest.mark.parametrize(
    ("dtype", "tol"),
    [
        pytest.param(torch.float32, 1e-6, id="fp32"),
        pytest.param(torch.float16, 2e-3, id="fp16"),
    ],
)
def test_prelude_equals_the_unfused_kernels_and_follows_the_reference(
    kernels, tokens, num_heads, num_kv_heads, head_dim, rot_dim, dtype, tol
):
    check_attention_prelude(
        *kernels, tokens, num_heads, num_kv_heads, head_dim, rot_dim, dtype, "cpu", tol
    )


@pytest.mark.parametrize("tokens", [1, 3])
def test_prelude_equals_the_unfused_kernels_in_bf16(kernels, tokens):
    """The reference bound is loose here only because the interpreter truncates to bf16."""
    check_attention_prelude(*kernels, tokens, 4, 2, 32, 8, torch.bfloat16, "cpu", 1e-2)


def test_a_negative_slot_skips_its_tokens_k_and_v_but_not_its_query(kernels):
    fused = kernels[0]
    inputs = prelude_inputs(3, 4, 2, 32, 8, torch.float32, "cpu", skipped=(1,))
    query, k_cache, v_cache = run_prelude(fused.attention_prelude, inputs)
    used = set(inputs["kv_write_slots"].tolist())
    slots = inputs["kv_write_slots"].clone()
    slots[1] = next(slot for slot in range(inputs["k_cache"].shape[0] * 64) if slot not in used)
    full_query, _, _ = run_prelude(fused.attention_prelude, dict(inputs, kv_write_slots=slots))
    assert torch.equal(query, full_query)
    written = inputs["kv_write_slots"][[0, 2]]
    for cache, before in ((k_cache, inputs["k_cache"]), (v_cache, inputs["v_cache"])):
        rows, rows_before = cache.flatten(0, 1), before.flatten(0, 1)
        kept = torch.ones(rows.shape[0], dtype=torch.bool)
        kept[written] = False
        assert torch.equal(rows[kept], rows_before[kept])
        assert not torch.equal(rows[written], rows_before[written])


def test_inputs_are_read_not_rotated_in_place(kernels):
    """Unlike the unfused rotary, which rotated the norms' outputs in place, the fused kernel
    leaves q, k and v (views of the projection's output) as they were."""
    inputs = prelude_inputs(3, 4, 2, 32, 8, torch.float16, "cpu")
    before = [inputs[name].clone() for name in ("query", "key", "value")]
    run_prelude(kernels[0].attention_prelude, inputs)
    after = [inputs[name] for name in ("query", "key", "value")]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))

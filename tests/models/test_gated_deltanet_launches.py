"""What a GDN layer launches per forward, on the CUDA path traced on the meta device (non-view
aten ops, each kernel entry point one launch; `LaunchCount` of test_moe_block.py): a one-token
decode step computes the stacked dense b|a product, the gates and the output norm inside the
recurrent kernel, other batches up to GATES_FROM_X_MAX_TOKENS tokens the product and the gates
inside the conv's kernel, larger ones keep the product and the gates kernel. cuBLAS runs the b|a product, 2H rows, as a split-K GEMM and a
reduce at batch 1 (one aten mm, two launches), so at decode product, gates and delta rule take
one launch where the unfused layer took four and the gates kernel with the product inside
two."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_moe_block import LaunchCount
from torch import nn

from ninfer.kernels import gdn_gates as gates_reference
from ninfer.models.layers import gated_deltanet, linear, norms
from ninfer.models.layers.gated_deltanet import (
    GATES_FROM_X_MAX_TOKENS,
    GATES_IN_RULE_MAX_TOKENS,
    GatedDeltaNet,
)

HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV = 64, 2, 4, 16, 4


def meta_context(tokens: int, is_decode: bool) -> SimpleNamespace:
    """The forward context a GDN layer reads, on the meta device (no data, no kernels)."""
    meta = {"device": "meta"}
    return SimpleNamespace(
        is_decode=is_decode,
        cache=SimpleNamespace(conv_window=[torch.empty(0, **meta)], gdn_state=[None]),
        state_slots=torch.empty(tokens, dtype=torch.int32, **meta),
        query_start=torch.empty(tokens + 1, dtype=torch.int32, **meta),
    )


def traced_launches(monkeypatch, tokens: int, is_decode: bool) -> dict[str, int]:
    layer = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, CONV, 1e-6, 0)
    for param in layer.parameters():
        nn.init.normal_(param)
    assert layer.fuse_projections() == ["in_proj_qkvz", "in_proj_ba"]
    layer = layer.to(device="meta", dtype=torch.bfloat16)
    count = LaunchCount()

    def gates_from_x(x, w_ba, A_log, dt_bias):
        assert w_ba.shape == (2 * VALUE_HEADS, HIDDEN)
        return gates_reference.gdn_gates_from_x(x, w_ba, A_log, dt_bias)

    def rule_from_x(q, k, v, x, w_ba, *args):
        assert x.shape == (tokens, HIDDEN) and w_ba.shape == (2 * VALUE_HEADS, HIDDEN)
        return torch.empty_like(v)

    def like_first(shaped, *args):
        return torch.empty_like(shaped)

    def conv_and_gates(mixed, taps, windows, slots, query_start, x, w_ba, A_log, dt_bias):
        return (torch.empty_like(mixed), *gates_from_x(x, w_ba, A_log, dt_bias))

    def rule_output(q, k, v, *args):
        return torch.empty_like(v)

    kernels = {
        "gdn_gates_from_x": gates_from_x,
        "causal_conv1d_and_gates": conv_and_gates,
        "gdn_gates": gates_reference.gdn_gates,
        "causal_conv1d": like_first,
        "recurrent_gated_delta_rule": rule_output,
        "recurrent_gated_delta_rule_from_x": rule_from_x,
        "recurrent_gated_delta_rule_from_x_normed": rule_from_x,
        "chunk_gated_delta_rule": rule_output,
    }
    for name, compute in kernels.items():
        monkeypatch.setattr(gated_deltanet, name, count.kernel(name, compute))
    monkeypatch.setattr(norms, "gated_rms_norm", count.kernel("gated_rms_norm", like_first))
    ctx = meta_context(tokens, is_decode)
    x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="meta")
    with count:
        out = layer(x, ctx)
    assert out.shape == x.shape
    return dict(count.launches)


def test_one_token_decode_step_computes_b_a_and_the_gates_inside_the_recurrent_kernel(
    monkeypatch,
):
    """Two products (q|k|v|z in, out), conv, delta rule with b|a, gates and the output norm:
    four (the kernel leaves the norm to its own where a head has too many column blocks, in
    the dispatch); with NORM_IN_RULE off, the norm's own launch: five."""
    assert GATES_IN_RULE_MAX_TOKENS == 1
    assert traced_launches(monkeypatch, 1, is_decode=True) == {
        "mm": 2, "causal_conv1d": 1, "recurrent_gated_delta_rule_from_x_normed": 1,
    }  # fmt: skip
    monkeypatch.setattr(gated_deltanet, "NORM_IN_RULE", False)
    assert traced_launches(monkeypatch, 1, is_decode=True) == {
        "mm": 2, "causal_conv1d": 1, "recurrent_gated_delta_rule_from_x": 1, "gated_rms_norm": 1,
    }  # fmt: skip


@pytest.mark.parametrize("tokens", [2, 8, GATES_FROM_X_MAX_TOKENS])
def test_decode_step_of_several_sequences_computes_the_gates_in_the_conv_kernel(
    monkeypatch, tokens
):
    """Above GATES_IN_RULE_MAX_TOKENS the conv's kernel computes the gates (b|a product
    inside) in programs of their own, once per token and head, and the recurrent kernel takes
    g and beta: five launches, where the gates kernel apart made six."""
    assert traced_launches(monkeypatch, tokens, is_decode=True) == {
        "mm": 2, "causal_conv1d_and_gates": 1, "recurrent_gated_delta_rule": 1,
        "gated_rms_norm": 1,
    }  # fmt: skip
    monkeypatch.setattr(gated_deltanet, "GATES_IN_RULE_MAX_TOKENS", GATES_FROM_X_MAX_TOKENS)
    assert "recurrent_gated_delta_rule_from_x_normed" in traced_launches(monkeypatch, tokens, True)


def test_small_prefill_computes_b_and_a_inside_the_conv_kernel(monkeypatch):
    """A few prompt tokens (or a verification step) take the chunked rule, so the gates come
    from the conv's kernel with the b|a product inside."""
    assert traced_launches(monkeypatch, GATES_FROM_X_MAX_TOKENS, is_decode=False) == {
        "mm": 2, "causal_conv1d_and_gates": 1, "chunk_gated_delta_rule": 1,
        "gated_rms_norm": 1,
    }  # fmt: skip


def test_prefill_keeps_the_b_and_a_product_and_the_gates_kernel(monkeypatch):
    assert traced_launches(monkeypatch, GATES_FROM_X_MAX_TOKENS + 1, is_decode=False) == {
        "mm": 3, "gdn_gates": 1, "causal_conv1d": 1, "chunk_gated_delta_rule": 1,
        "gated_rms_norm": 1,
    }  # fmt: skip


def test_decode_step_without_the_fused_gates_took_the_product_the_gates_and_the_rule(
    monkeypatch,
):
    """The layer as it was before: one mm more (two cuBLAS launches at batch 1), the gates
    kernel and the rule, for the one rule-with-gates kernel."""
    monkeypatch.setattr(gated_deltanet, "GATES_FROM_X_MAX_TOKENS", 0)
    launches = traced_launches(monkeypatch, 1, is_decode=True)
    assert launches["mm"] == 3 and launches["gdn_gates"] == 1
    assert launches["recurrent_gated_delta_rule"] == 1
    assert "recurrent_gated_delta_rule_from_x" not in launches


def test_encoded_decode_step_runs_the_conv_inside_the_in_projection(monkeypatch):
    """Stacked q|k|v|z weights kept encoded: a one-token decode step launches one kernel for
    the in projection and the conv (`groupwise_linear_conv`), no conv kernel of its own; a
    step of two tokens keeps the product and the conv apart, the gates in the conv's kernel,
    unless the in projection's kernel takes the conv and the gates too
    (`groupwise_linear_conv_and_gates`, two to eight rows on Hopper)."""
    from ninfer.models.layers.linear import GroupwiseLinear
    from ninfer.quant import get_format

    q8 = get_format("q8_g32_fp16")

    def encoded(tokens, one_kernel=False):
        layer = GatedDeltaNet(HIDDEN, KEY_HEADS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, CONV, 1e-6, 0)
        for param in layer.parameters():
            nn.init.normal_(param)
        for name in ("in_proj_qkv", "in_proj_z"):
            weight = getattr(layer, name).weight.detach()
            setattr(layer, name, GroupwiseLinear(q8.encode(weight)))
        layer.fuse_projections()
        layer = layer.to(device="meta", dtype=torch.bfloat16)
        count = LaunchCount()

        def linear_conv(x, weight, taps, windows, slots, query_start):
            assert weight.shape == (layer.conv_dim + layer.value_dim, HIDDEN)
            return x.new_empty(1, layer.conv_dim), x.new_empty(1, layer.value_dim)

        def like_first(shaped, *args):
            return torch.empty_like(shaped)

        def rule_from_x(q, k, v, *args):
            return torch.empty_like(v)

        def gemv(x, weight):
            return x.new_empty(x.shape[0], weight.shape[0])

        def linear_conv_gates(x, weight, taps, windows, slots, w_ba, *args):
            assert weight.shape == (layer.conv_dim + layer.value_dim, HIDDEN)
            assert w_ba.shape == (2 * VALUE_HEADS, HIDDEN)
            mixed = x.new_empty(x.shape[0], layer.conv_dim)
            return mixed, x.new_empty(x.shape[0], layer.value_dim), *gates(x)

        if one_kernel:
            monkeypatch.setattr(
                gated_deltanet,
                "groupwise_linear_conv_and_gates",
                count.kernel("linear_conv_gates", linear_conv_gates),
            )
        else:  # what it answers off Hopper (and here, on the meta device)
            monkeypatch.setattr(
                gated_deltanet, "groupwise_linear_conv_and_gates", lambda *args: None
            )

        monkeypatch.setattr(
            gated_deltanet, "groupwise_linear_conv", count.kernel("linear_conv", linear_conv)
        )
        monkeypatch.setattr(gated_deltanet, "causal_conv1d", count.kernel("conv", like_first))
        monkeypatch.setattr(
            gated_deltanet,
            "recurrent_gated_delta_rule_from_x",
            count.kernel("rule", rule_from_x),
        )
        monkeypatch.setattr(
            gated_deltanet,
            "recurrent_gated_delta_rule_from_x_normed",
            count.kernel("rule_norm", rule_from_x),
        )
        monkeypatch.setattr(
            gated_deltanet, "recurrent_gated_delta_rule", count.kernel("rule", rule_from_x)
        )
        monkeypatch.setattr(gated_deltanet, "gdn_gates_from_x", count.kernel("gates", gates))
        monkeypatch.setattr(
            gated_deltanet, "causal_conv1d_and_gates", count.kernel("conv_gates", conv_gates)
        )
        monkeypatch.setattr(linear, "groupwise_linear", count.kernel("gemv", gemv))
        monkeypatch.setattr(norms, "gated_rms_norm", count.kernel("norm", like_first))
        with count:
            x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="meta")
            layer(x, meta_context(tokens, is_decode=True))
        return dict(count.launches)

    def gates(x, *args):
        return x.new_empty(x.shape[0], VALUE_HEADS), x.new_empty(x.shape[0], VALUE_HEADS)

    def conv_gates(mixed, taps, windows, slots, query_start, x, *args):
        return (torch.empty_like(mixed), *gates(x))

    assert encoded(1) == {"linear_conv": 1, "mm": 1, "rule_norm": 1}
    assert encoded(2) == {"conv_gates": 1, "gemv": 1, "mm": 1, "rule": 1, "norm": 1}
    assert encoded(2, one_kernel=True) == {"linear_conv_gates": 1, "mm": 1, "rule": 1, "norm": 1}
    assert encoded(1, one_kernel=True) == {"linear_conv": 1, "mm": 1, "rule_norm": 1}

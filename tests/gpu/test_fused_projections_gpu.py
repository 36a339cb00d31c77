"""The fused decode projections on the GPU: the GDN gates kernel at the Qwen3.5-27B shape
(48 value heads: the fused b|a product is [T, 96]), the gates kernel with the b|a product
inside at the 27B and 35B-A3B shapes, the GEMV over encoded weights stacked by
rows at the 27B projection shapes, `FusedLinear` (one product at decode, parts at prefill)
against the unfused linears, and a quantized model fused and unfused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import (
    check_fused_groupwise_linear,
    check_gdn_gates,
    check_gdn_gates_from_x,
    one_sequence_setting,
    relative_error,
)
from torch import nn

import ninfer
from ninfer.artifact.artifact import Artifact
from ninfer.engine.request import SamplingParams
from ninfer.models import qwen3_5
from ninfer.models.layers import gated_deltanet
from ninfer.models.layers.gated_deltanet import GatedDeltaNet
from ninfer.models.layers.linear import GEMV_MAX_ROWS, GroupwiseLinear, fuse_linears
from ninfer.models.registry import load_model
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")

BF16 = torch.bfloat16


@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_gdn_gates_at_the_27b_shape(tokens):
    """g within the GPU's exp (ex2.approx after scaling by log2 e, error growing with |x|),
    beta within one bf16 rounding step, and in fp32 within 4 units in the last place: the
    approximate exp and division each add up to two (3 seen over 4096 x 48 draws)."""
    from ninfer.kernels import gdn_gates_triton

    torch.manual_seed(tokens)
    check_gdn_gates(gdn_gates_triton, tokens, 48, BF16, "cuda", 2e-5, 1)
    check_gdn_gates(gdn_gates_triton, tokens, 48, torch.float32, "cuda", 2e-5, 4)


@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize(("heads", "hidden"), [(48, 5120), (32, 2048)], ids=["27b", "35b-a3b"])
@pytest.mark.parametrize(
    ("dtype", "beta_ulps"),
    [pytest.param(BF16, 1, id="bf16"), pytest.param(torch.float32, 4, id="fp32")],
)
def test_gdn_gates_from_x_at_the_model_shapes(heads, hidden, tokens, dtype, beta_ulps):
    """Within one rounding step of b and a of the exact product (`check_gdn_gates_from_x` says
    why not of cuBLAS's), with the gates kernel's own tolerances on the GPU
    (`test_gdn_gates_at_the_27b_shape`)."""
    from ninfer.kernels import gdn_gates_triton

    torch.manual_seed(tokens + hidden)
    check_gdn_gates_from_x(gdn_gates_triton, tokens, heads, hidden, dtype, "cuda", 2e-5, beta_ulps)


@pytest.mark.parametrize("tokens", [1, 8])
def test_gdn_decode_step_with_the_gates_in_the_rule_keeps_its_outputs(monkeypatch, tokens):
    """A GDN layer's decode step (stacked dense b|a, bf16) with product, gates and rule in one
    kernel (the output norm after it) against the same step through the b|a product, the
    gates kernel and the rule: outputs and states within bf16 rounding (cuBLAS's b|a product
    may round differently).
    Several sequences take the product and the gates in the conv's kernel by default
    (`GATES_IN_RULE_MAX_TOKENS`): bit for bit the one kernel's outputs and states."""
    torch.manual_seed(tokens)
    hidden, key_heads, value_heads, head_dim = 512, 2, 6, 128
    layer = GatedDeltaNet(hidden, key_heads, value_heads, head_dim, head_dim, 4, 1e-6, 0)
    for param in layer.parameters():
        nn.init.normal_(param, std=hidden**-0.5)
    assert layer.fuse_projections() == ["in_proj_qkvz", "in_proj_ba"]
    layer = layer.to(device="cuda", dtype=BF16)
    num_slots = tokens + 2
    states = torch.randn(num_slots, value_heads, head_dim, head_dim, device="cuda") * 0.5
    windows = torch.randn(num_slots, layer.conv_dim, 3, device="cuda").to(BF16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=BF16)
    slots = torch.arange(num_slots - 1, 1, -1, dtype=torch.int32, device="cuda")

    def step():
        ctx = SimpleNamespace(
            is_decode=True,
            cache=SimpleNamespace(conv_window=[windows.clone()], gdn_state=[states.clone()]),
            state_slots=slots,
            query_start=torch.arange(tokens + 1, dtype=torch.int32, device="cuda"),
        )
        return layer(x, ctx), ctx.cache.gdn_state[0]

    taken = []
    # the output norm apart, as the path compared runs it (the fold has its own tests)
    monkeypatch.setattr(gated_deltanet, "NORM_IN_RULE", False)
    rule_from_x = gated_deltanet.recurrent_gated_delta_rule_from_x
    monkeypatch.setattr(
        gated_deltanet,
        "recurrent_gated_delta_rule_from_x",
        lambda *args: taken.append(1) or rule_from_x(*args),
    )
    in_rule = gated_deltanet.GATES_IN_RULE_MAX_TOKENS
    monkeypatch.setattr(
        gated_deltanet, "GATES_IN_RULE_MAX_TOKENS", gated_deltanet.GATES_FROM_X_MAX_TOKENS
    )
    out, new_states = step()
    assert taken == [1]
    monkeypatch.setattr(gated_deltanet, "GATES_IN_RULE_MAX_TOKENS", in_rule)
    if tokens > in_rule:
        from ninfer.kernels import gdn_recurrent_triton

        with one_sequence_setting(gdn_recurrent_triton):  # one summation order
            apart, apart_states = step()
        assert taken == [1]
        assert torch.equal(apart, out) and torch.equal(apart_states, new_states)
    monkeypatch.setattr(gated_deltanet, "GATES_FROM_X_MAX_TOKENS", 0)
    ref, ref_states = step()
    assert taken == [1]
    assert relative_error(out, ref) < 1e-2
    assert relative_error(new_states, ref_states) < 1e-2


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(
    "sizes", [[10240, 6144], [12288, 1024, 1024], [17408, 17408]], ids=["qkvz", "qkv", "gate_up"]
)
@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
def test_gemv_over_stacked_27b_projections(format_name, sizes, m):
    from ninfer.kernels import groupwise_gemv_triton

    torch.manual_seed(m)
    check_fused_groupwise_linear(
        groupwise_gemv_triton, format_name, m, sizes, 5120, BF16, "cuda", 1e-2
    )


def _linears(kind: str, sizes: list[int], k: int) -> list[nn.Module]:
    weights = [torch.randn(n, k) * k**-0.5 for n in sizes]
    if kind == "bf16":
        linears = [nn.Linear(k, n, bias=False, dtype=BF16, device="cuda") for n in sizes]
        for linear, weight in zip(linears, weights):
            linear.weight.data.copy_(weight)
        return linears
    fmt = get_format(kind)
    layers = []
    for weight in weights:
        encoded = fmt.encode(weight)
        encoded.planes = {name: plane.cuda() for name, plane in encoded.planes.items()}
        layers.append(GroupwiseLinear(encoded))
    return layers


@pytest.mark.parametrize("rows", [1, 8, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 300])
@pytest.mark.parametrize("kind", ["bf16", "q4_g64_fp16", "q8_g32_fp16"])
def test_fused_linear_gives_the_unfused_outputs(kind, rows):
    """The one product (decode sizes), or the parts one at a time (encoded, prefill sizes):
    each output within bf16 rounding of its own linear's (accumulation order may differ)."""
    torch.manual_seed(rows)
    linears = _linears(kind, [640, 96, 96], 1024)
    x = torch.randn(rows, 1024, device="cuda", dtype=BF16)
    expected = [linear(x) for linear in linears]
    fused = fuse_linears(linears)
    assert fused is not None
    outputs = fused(x)
    assert len(outputs) == 3
    for out, ref in zip(outputs, expected):
        assert out.shape == ref.shape and out.dtype == BF16
        assert relative_error(out, ref) < 1e-2


def test_quantized_model_fuses_its_projections_and_keeps_its_logits(tiny_artifact, monkeypatch):
    """A q4 artifact on the GPU: the q4 projections stack encoded, the bf16 b/a pair dense;
    the first token's top log-probability matches the unfused model's for prompts taking the
    one-row GEMV (1 token), the tensor-core GEMV (5) and the dequantized parts (40)."""
    _, path = tiny_artifact(weights="groupwise-int", layers=4, hidden=128)
    model = load_model(Artifact.open(path), device="cuda", dtype=BF16)
    gdn, attn = model.layers[0].linear_attn, model.layers[1].self_attn
    for fused in (gdn.in_proj_qkvz, attn.qkv_proj, model.layers[0].mlp.gate_up_proj):
        assert isinstance(fused.linear, GroupwiseLinear)
    assert type(gdn.in_proj_ba.linear) is nn.Linear
    params = SamplingParams.greedy(max_tokens=1, ignore_eos=True, logprobs=5)

    def top(prompt):
        with ninfer.Engine(path, device="cuda", dtype="bfloat16", max_context=256) as engine:
            return dict(engine.generate(prompt, params).logprobs[0].top)

    prompts = [[77], list(range(20, 25)), list(range(20, 60))]
    fused_tops = [top(prompt) for prompt in prompts]
    monkeypatch.setattr(qwen3_5, "fuse_projections", lambda model: [])
    for prompt, fused_top in zip(prompts, fused_tops):
        unfused_top = top(prompt)
        best = max(unfused_top, key=unfused_top.get)
        assert best in fused_top
        assert abs(fused_top[best] - unfused_top[best]) < 0.05

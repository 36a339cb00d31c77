"""`SparseMoE` as one block: the router stacked with the shared expert's gate computes the
unstacked block bit for bit on the CPU, and a decode step with encoded experts launches the
kernels counted here (the CUDA path traced on the meta device: non-view aten ops, with each
Triton entry point one launch)."""

from __future__ import annotations

import collections

import pytest
import torch
from kernel_cases import moe_block as shared_moe_block
from torch.utils._python_dispatch import TorchDispatchMode

from ninfer.bench.shapes import SHAPES
from ninfer.errors import ModelConfigError
from ninfer.models.layers import linear, mlp, moe
from ninfer.models.layers.linear import GroupwiseLinear
from ninfer.models.layers.moe import SparseMoE
from ninfer.models.layers.norms import RMSNorm
from ninfer.models.qwen3_5 import Qwen3_5Config
from ninfer.quant import get_format

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 128, 64, 16, 4
# aten ops that launch no kernel: views and allocations
NO_LAUNCH = {
    "view", "_unsafe_view", "split", "split_with_sizes", "chunk", "slice", "select", "expand",
    "t", "transpose", "unsqueeze", "squeeze", "reshape", "as_strided", "alias", "permute",
    "detach", "unbind", "empty", "empty_like", "new_empty", "empty_strided",
}  # fmt: skip


def moe_block(encoded: bool) -> SparseMoE:
    return shared_moe_block(HIDDEN, NUM_EXPERTS, TOP_K, WIDTH, encoded)


@pytest.mark.parametrize("encoded", [False, True], ids=["dense", "encoded"])
@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_stacked_router_computes_the_unstacked_block_bit_for_bit(encoded, tokens):
    block = moe_block(encoded)
    x = torch.randn(tokens, HIDDEN)
    unstacked = block(x)
    assert block.fuse_projections() == ["router"]
    assert not hasattr(block, "gate") and not hasattr(block, "shared_expert_gate")
    assert torch.equal(block(x), unstacked)


class LaunchCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[str] = collections.Counter()
        self.inside_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_kernel and name not in NO_LAUNCH:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, name: str, compute):
        """A Triton entry point: one launch, whatever its reference runs to shape the output."""

        def launch(*args, **kwargs):
            self.launches[name] += 1
            self.inside_kernel = True
            try:
                return compute(*args, **kwargs)
            finally:
                self.inside_kernel = False

        return launch


def silu_mul_shape(gate, up, split=None):
    return gate * up


def decode_launches(
    block: SparseMoE, tokens: int, monkeypatch, norm_inside: bool = False
) -> dict[str, int]:
    """The launches of one decode step of `block` in bf16, traced on the meta device; with
    `norm_inside`, of the norm before it and the block (`SparseMoE.norm_and_forward`)."""
    block = block.to(device="meta", dtype=torch.bfloat16)
    count = LaunchCount()

    def grouped(x, weight, x_rows, experts):
        return x.new_empty(experts.shape[0], weight.shape[1])

    def gemv(x, weight):
        return x.new_empty(x.shape[0], weight.shape[0])

    def grouped_swiglu(gate_up, weight, x_rows, experts, split=None):
        return gate_up.new_empty(experts.shape[0], weight.shape[1])

    def swiglu_combine(gate_up, weight, routes, first, count, shared_gate, split=None):
        return gate_up.new_empty(1, weight.shape[1])

    monkeypatch.setattr(moe, "grouped_groupwise_linear", count.kernel("grouped_gemv", grouped))
    # the experts' down projection with their activation inside, as on the GPU (rows of 64
    # values: `groupwise_gemv_triton.swiglu_fits`)
    monkeypatch.setattr(moe, "grouped_swiglu_linear", count.kernel("grouped_gemv", grouped_swiglu))
    # ... and, for one token with the shared expert in the pairs, with the combine inside too
    monkeypatch.setattr(
        moe, "grouped_swiglu_combine", count.kernel("grouped_gemv_combine", swiglu_combine)
    )
    monkeypatch.setattr(linear, "groupwise_linear", count.kernel("gemv", gemv))
    for module in (moe, mlp):
        monkeypatch.setattr(module, "silu_mul", count.kernel("silu_mul", silu_mul_shape))
    monkeypatch.setattr(moe, "moe_route", count.kernel("route", moe.moe_route))
    monkeypatch.setattr(moe, "moe_router_route", count.kernel("router_route", moe.moe_router_route))
    monkeypatch.setattr(moe, "moe_combine", count.kernel("combine", moe.moe_combine))
    monkeypatch.setattr(
        moe, "moe_norm_router_route", count.kernel("norm_router_route", moe.moe_norm_router_route)
    )
    x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="meta")
    norm = RMSNorm(HIDDEN, 1e-6).to(device="meta", dtype=torch.bfloat16)
    with count:
        if norm_inside:
            out, total = block.norm_and_forward(x, torch.empty_like(x), norm)
            assert total.shape == x.shape
        else:
            out = block(x)
    assert out.shape == x.shape
    return dict(count.launches)


@pytest.mark.parametrize("tokens", [1, 8])
def test_encoded_decode_step_launches_seven_kernels(monkeypatch, tokens):
    """The stacked router's product with the routing, two grouped GEMVs (the activation inside
    the second), the shared expert's two GEMVs and activation, the output: seven, for any
    decode batch."""
    block = moe_block(encoded=True)
    block.fuse_projections()
    assert decode_launches(block, tokens, monkeypatch) == {
        "router_route": 1, "grouped_gemv": 2, "silu_mul": 1, "gemv": 2, "combine": 1,
    }  # fmt: skip


def test_unstacked_router_decode_step_launches_the_product_and_the_routing(monkeypatch):
    """Without the router stacked with the shared gate (no `fuse_projections`), its two
    products and the routing run apart, as before."""
    block = moe_block(encoded=True)
    assert decode_launches(block, 1, monkeypatch) == {
        "mm": 2, "route": 1, "grouped_gemv": 2, "silu_mul": 1, "gemv": 2, "combine": 1,
    }  # fmt: skip


@pytest.mark.parametrize("tokens", [1, 8, 100])
def test_shared_expert_stacked_with_the_routed_ones_computes_the_block(tokens):
    """Stacked after the routed experts, the shared expert runs as one more pair per token (or,
    over more tokens, through the stack): the block's output is unchanged but for summation
    order, and its own module is gone."""
    block = moe_block(encoded=True)
    block.fuse_projections()
    x = torch.randn(tokens, HIDDEN)
    unstacked = block(x)
    assert block.stack_shared_expert()
    assert not hasattr(block, "shared_expert") and block.experts.shared_local == NUM_EXPERTS
    assert block.experts.gate_up_proj.shape[0] == NUM_EXPERTS + 1
    assert not block.stack_shared_expert()  # once
    torch.testing.assert_close(block(x), unstacked, rtol=1e-5, atol=1e-6)


def test_shared_expert_stays_apart_where_stored_otherwise():
    """A dense shared expert, or one in another format, is not stacked."""
    dense = moe_block(encoded=False)
    dense.fuse_projections()
    assert not dense.stack_shared_expert()
    block = moe_block(encoded=True)
    q8 = get_format("q8_g32_fp16")
    weight = block.shared_expert.down_proj.encoded.decode(torch.float32)
    block.shared_expert.down_proj = GroupwiseLinear(q8.encode(weight))
    block.fuse_projections()
    assert not block.stack_shared_expert()
    assert hasattr(block, "shared_expert") and block.experts.shared_local is None
    assert block.experts.gate_up_proj.shape[0] == NUM_EXPERTS


def test_stacked_shared_expert_one_token_decode_step_launches_three_kernels(monkeypatch):
    """Router product with the routing, two grouped GEMVs over the routed and shared pairs (the
    activation and the block's output inside the second)."""
    block = moe_block(encoded=True)
    block.fuse_projections()
    assert block.stack_shared_expert()
    assert moe.SHARED_PAIRS_MAX_TOKENS == 1
    assert decode_launches(block, 1, monkeypatch) == {
        "router_route": 1, "grouped_gemv": 1, "grouped_gemv_combine": 1,
    }  # fmt: skip
    # over more tokens its rows take the GEMV of the stacked weights, as unstacked
    assert decode_launches(block, 8, monkeypatch) == {
        "router_route": 1, "grouped_gemv": 2, "silu_mul": 1, "gemv": 2, "combine": 1,
    }  # fmt: skip


def test_norm_inside_the_router_takes_one_launch_fewer(monkeypatch):
    """With the norm before the block inside the router's kernel, the block's decode step is
    that kernel and the two grouped GEMVs (the output inside the second): the norm's launch is
    gone. Off where the fused router does not run (the CPU), or switched off, the caller runs
    the norm."""
    block = moe_block(encoded=True)
    block.fuse_projections()
    assert block.stack_shared_expert()
    assert decode_launches(block, 1, monkeypatch, norm_inside=True) == {
        "norm_router_route": 1, "grouped_gemv": 1, "grouped_gemv_combine": 1,
    }  # fmt: skip
    cpu = moe_block(encoded=True).to(torch.bfloat16)
    cpu.fuse_projections()
    x = torch.randn(1, HIDDEN, dtype=torch.bfloat16)
    assert cpu.norm_and_forward(x, x, RMSNorm(HIDDEN, 1e-6)) is None
    monkeypatch.setattr(moe, "NORM_IN_ROUTER", False)
    meta = block.to(device="meta")
    assert meta.norm_and_forward(x.to("meta"), x.to("meta"), RMSNorm(HIDDEN, 1e-6)) is None


@pytest.mark.parametrize("per_token", [0, 257])
def test_a_config_choosing_no_experts_or_more_than_it_has_is_refused(per_token):
    config = {**SHAPES["qwen3_5-35b-a3b"], "num_experts_per_tok": per_token}
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        Qwen3_5Config.from_hf(config, is_moe=True)

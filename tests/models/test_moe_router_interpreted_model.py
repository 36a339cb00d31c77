"""An encoded MoE block's decode path on the CPU, every kernel dispatched to its Triton form
under Triton's interpreter (fp16: tests/triton_interpreter.py says why): with the router
product and the routing in one kernel, as on the GPU, the block computes what it does with
the two apart (the same experts here, no near-tie at these inputs), its shared expert gated
by the stacked gate's logit."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import decided_tokens, moe_block, relative_error
from triton_interpreter import require_interpreter

require_interpreter()

from ninfer.kernels import dispatch  # noqa: E402 (after the interpreter is switched on)
from ninfer.models.layers.moe import SparseMoE  # noqa: E402

HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 128, 64, 16, 4


@pytest.mark.parametrize("stack_shared", [False, True], ids=["shared-apart", "shared-stacked"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_fused_router_gives_the_block_of_the_unfused_kernels(monkeypatch, tokens, stack_shared):
    block = moe_block(HIDDEN, NUM_EXPERTS, TOP_K, WIDTH, encoded=True)
    assert block.fuse_projections() == ["router"]
    if stack_shared:
        assert block.stack_shared_expert()
    block = block.half()
    x = torch.randn(tokens, HIDDEN).half()
    weight = block.router.linear.weight
    assert decided_tokens(torch.nn.functional.linear(x, weight)[:, :NUM_EXPERTS], TOP_K).all()
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    with torch.inference_mode():
        assert block.fused_router_weight(x) is None  # the CPU keeps its path
        unfused = block(x)
        monkeypatch.setattr(SparseMoE, "fused_router_weight", lambda self, x: weight)
        fused = block(x)
    assert fused.dtype == torch.float16 and fused.shape == x.shape
    assert relative_error(fused, unfused) < 2e-3, relative_error(fused, unfused)

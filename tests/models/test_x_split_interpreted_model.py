"""Producer-written x splits (`kernels/x_split.py`) end to end under Triton's CPU interpreter,
every kernel dispatched to its Triton form, in fp16 under inference mode as the engine runs:
a tiny dense model with q4 linears gives the same logits, bit for bit, with the splits written
by their producers as with the GEMV splitting x itself, and never launches the split kernel;
so does a q4 MoE block with its shared expert stacked (the grouped GEMVs' inputs)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import moe_block
from tiny_qwen import Runner, convert_to_artifact, keep_linears_in_q4, load_ours, make_hf_model
from triton_interpreter import require_interpreter

require_interpreter()

from ninfer.kernels import dispatch  # noqa: E402 (after the interpreter is switched on)
from ninfer.kernels import groupwise_gemv_triton as gemv  # noqa: E402
from ninfer.models.qwen3_5 import request_x_splits  # noqa: E402


@pytest.fixture
def triton_everywhere(monkeypatch):
    """Every dispatched kernel takes its Triton form on the CPU (fla's prefill stays the
    reference: it does not run here); returns a counter of the split kernel's calls."""
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(dispatch, "HAS_FLA", False)
    calls = {"split_x": 0}
    real = gemv.split_x

    def counted(*args):
        calls["split_x"] += 1
        return real(*args)

    monkeypatch.setattr(gemv, "split_x", counted)
    return calls


def test_dense_model_logits_are_the_same_bits_with_producer_splits(triton_everywhere, tmp_path):
    """Every width a whole number of groups: no decode step splits x itself any more."""
    artifact = convert_to_artifact(make_hf_model("dense_whole_groups", hidden_size=128), tmp_path)
    model = load_ours(artifact, torch.float16)
    keep_linears_in_q4(model)

    def run() -> list[torch.Tensor]:
        runner = Runner(model)
        runner.add("a")
        with torch.inference_mode():
            return [runner.step({"a": ids})["a"] for ids in ([3, 17, 40, 5], [9], [21])]

    base, splits_before = run(), triton_everywhere["split_x"]
    assert request_x_splits(model) > 0
    triton_everywhere["split_x"] = 0
    written = run()
    assert all(torch.equal(a, b) for a, b in zip(base, written))
    assert splits_before > 0 and triton_everywhere["split_x"] == 0


def test_moe_block_output_is_the_same_bits_with_producer_splits(triton_everywhere, monkeypatch):
    """With the experts' activation in its own kernel, which writes the down projection's
    codes when asked; and with the activation inside the down projection, which splits it
    there: the same bits."""
    block = moe_block(128, 8, 2, 128, encoded=True)
    block.fuse_projections()
    assert block.stack_shared_expert()
    block = block.to(torch.float16)
    assert gemv.swiglu_fits(block.experts.down_proj)
    x = torch.randn(1, 128).to(torch.float16)
    monkeypatch.setattr(gemv, "INT_SWIGLU_INSIDE", False)
    with torch.inference_mode():
        base = block(x)
        splits_before = triton_everywhere["split_x"]
        assert request_x_splits(block) == 1  # the experts' activation (the norm is outside)
        triton_everywhere["split_x"] = 0
        written = block(x)
        assert triton_everywhere["split_x"] == splits_before - 1
        monkeypatch.setattr(gemv, "INT_SWIGLU_INSIDE", True)
        triton_everywhere["split_x"] = 0
        inside = block(x)
        assert triton_everywhere["split_x"] == splits_before - 1
    assert torch.equal(base, written) and torch.equal(base, inside)

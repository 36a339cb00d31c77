"""The bench's random models keep what an artifact would keep encoded: with a weight profile
and where linears run quantized, the stacked MoE experts are encoded too (as their E * N rows,
the planes an artifact stores) and load as `GroupwiseExperts`, and a head stored q6 loads
widened to q8, as from an artifact."""

from __future__ import annotations

import pytest
import torch

from ninfer.bench.shapes import SHAPES
from ninfer.bench.targets import executed_formats, random_model
from ninfer.bench.traffic import profile_formats
from ninfer.models import qwen3_5
from ninfer.models.layers.linear import GroupwiseLinear
from ninfer.models.layers.moe import Experts, GroupwiseExperts


@pytest.mark.parametrize(("weights", "expected"), [("q4", "q4_g64_fp16"), ("q8", "q8_g32_fp16")])
def test_random_moe_model_keeps_its_experts_encoded(monkeypatch, weights, expected):
    monkeypatch.setattr(qwen3_5, "runs_quantized", lambda *args: True)  # as on CUDA in bf16
    config = SHAPES["tiny-moe"]
    format_of = profile_formats(config, weights)
    model = random_model(config, torch.device("cpu"), torch.float32, format_of=format_of)
    experts = [m for m in model.modules() if isinstance(m, GroupwiseExperts)]
    assert len(experts) == config["num_hidden_layers"]
    assert {m.format for m in experts} == {expected}
    # [E, 2I, H] and [E, H, groups]: the 8 routed experts and the shared one stacked after them
    assert experts[0].gate_up_proj.shape == (9, 64, 64)
    assert experts[0].down_proj_scales.shape[:2] == (9, 64)
    assert all(m.shared_local == 8 for m in experts)
    assert any(isinstance(m, GroupwiseLinear) for m in model.modules())
    assert not any(isinstance(m, Experts) for m in model.modules())
    # the q4 profile stores the head q6, which loads widened to q8 and kept encoded, and also
    # as stored for one-row products
    head = model.lm_head
    assert isinstance(head, GroupwiseLinear) and head.format == "q8_g32_fp16"
    one_row = "q6_g64_fp16" if weights == "q4" else None
    assert head.one_row_format == one_row
    formats = {"float32", expected, "q8_g32_fp16"} | ({one_row} if one_row else set())
    assert executed_formats(model) == "+".join(sorted(formats))


def test_executed_formats_names_encoded_experts_without_encoded_linears(monkeypatch):
    monkeypatch.setattr(qwen3_5, "runs_quantized", lambda *args: True)
    config = SHAPES["tiny-moe"]
    q4 = profile_formats(config, "q4")

    def experts_only(name, shape):
        return q4(name, shape) if "experts" in name else "bf16"

    model = random_model(config, torch.device("cpu"), torch.float32, format_of=experts_only)
    assert executed_formats(model) == "float32+q4_g64_fp16"


def test_random_model_without_a_profile_keeps_experts_dense():
    model = random_model(SHAPES["tiny-moe"], torch.device("cpu"), torch.float32)
    assert any(isinstance(m, Experts) for m in model.modules())
    assert not any(isinstance(m, GroupwiseExperts) for m in model.modules())

"""`GroupwiseLinear` and `quantize_linears` on the CPU: the layer computes x @ W.T of the
dequantized weight on both of its paths, and only linears stored in a GEMV format are kept
encoded. The GEMV kernel itself runs under Triton's interpreter in
tests/kernels/test_triton_interpreted.py and compiled in tests/gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.layers.linear import GEMV_MAX_ROWS, GroupwiseLinear, quantize_linears
from ninfer.models.qwen3_5 import runs_quantized
from ninfer.models.weights import StateDictSource
from ninfer.quant import get_format


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 40])
def test_groupwise_linear_is_the_product_with_the_dequantized_weight(format_name, rows):
    encoded = get_format(format_name).encode(torch.randn(24, 96) * 0.1)
    layer = GroupwiseLinear(encoded)
    x = torch.randn(rows, 96)
    assert torch.equal(layer(x), F.linear(x, encoded.decode(torch.float32)))
    assert (layer.in_features, layer.out_features) == (96, 24)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 32, bias=False)
        self.down = nn.Linear(32, 64, bias=False)
        self.gate = nn.Linear(64, 4, bias=False)


def test_only_linears_stored_in_a_gemv_format_are_kept_encoded():
    with torch.device("meta"):
        model = nn.Module()
        model.block = Block()
    source = StateDictSource(
        {"x/block.gate.weight": torch.randn(4, 64)},
        {
            "x/block.up.weight": get_format("q4_g64_fp16").encode(torch.randn(32, 64)),
            "x/block.down.weight": get_format("q6_g64_fp16").encode(torch.randn(64, 32)),
        },
    )
    replaced = quantize_linears(model, source, torch.device("cpu"), lambda name: "x/" + name)
    assert replaced == ["block.up"]
    assert isinstance(model.block.up, GroupwiseLinear)
    assert model.block.up.codes.device.type == "cpu"
    assert isinstance(model.block.down, nn.Linear) and isinstance(model.block.gate, nn.Linear)


def test_a_source_without_encoded_tensors_changes_nothing():
    model = Block()
    assert quantize_linears(model, object(), torch.device("cpu"), str) == []


def test_encoded_tensors_of_a_state_dict_source_decode_on_request():
    encoded = get_format("q8_g32_fp16").encode(torch.randn(8, 32))
    source = StateDictSource({}, {"text/w": encoded})
    assert source.has("text/w") and source.names() == ["text/w"]
    assert torch.equal(source.tensor("text/w"), encoded.decode())
    with pytest.raises(KeyError):
        StateDictSource({"text/v": torch.zeros(1)}).encoded("text/v")


def test_linears_stay_encoded_only_on_cuda_in_half_precision():
    assert not runs_quantized(torch.device("cpu"), torch.bfloat16)
    assert not runs_quantized(torch.device("cuda"), torch.float32)
    assert runs_quantized(torch.device("cuda"), torch.bfloat16)

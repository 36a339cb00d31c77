"""`GroupwiseLinear` and `quantize_linears` on the CPU: the layer computes x @ W.T of the
dequantized weight on both of its paths, and only linears stored in a GEMV format are kept
encoded. The GEMV kernel itself runs under Triton's interpreter in
tests/kernels/test_triton_interpreted.py and compiled in tests/gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.layers import linear
from ninfer.models.layers.linear import GEMV_MAX_ROWS, GroupwiseLinear, quantize_linears
from ninfer.models.qwen3_5 import runs_quantized
from ninfer.models.weights import StateDictSource
from ninfer.quant import get_format
from ninfer.quant.groupwise import widen_to_q8


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


def test_only_linears_stored_in_a_gemv_format_or_a_widened_one_are_kept_encoded():
    """q4 stays q4; q6 (the groupwise-int profile's head) is kept as q8 with the same values;
    a bf16 linear stays dense."""
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
    assert replaced == ["block.up", "block.down"]
    assert isinstance(model.block.up, GroupwiseLinear) and model.block.up.format == "q4_g64_fp16"
    assert model.block.up.codes.device.type == "cpu"
    down = model.block.down
    assert isinstance(down, GroupwiseLinear) and down.format == "q8_g32_fp16"
    stored = source.encoded("x/block.down.weight").decode(torch.float32)
    assert torch.equal(down.encoded.decode(torch.float32), stored)
    # ... and kept as stored too, for the integer GEMV's one-row products
    assert down.one_row.format == "q6_g64_fp16" and down.split_format == "q6_g64_fp16"
    assert torch.equal(down.one_row.decode(torch.float32), stored)
    assert model.block.up.one_row is None and model.block.up.split_format == "q4_g64_fp16"
    assert isinstance(model.block.gate, nn.Linear)


@pytest.mark.parametrize("rows", [1, 2, GEMV_MAX_ROWS + 1])
def test_a_one_row_weight_serves_one_row_and_the_widened_one_the_rest(monkeypatch, rows):
    """A q6 head: one x row reads the q6 planes (the integer GEMV), more read the q8_g32 they
    widen to; both are the product with the same dequantized weight. Such linears are not
    stacked with others (the one-row weight would be lost)."""
    q6 = get_format("q6_g64_fp16").encode(torch.randn(24, 128) * 0.1)
    layer = GroupwiseLinear(widen_to_q8(q6), q6)
    read = []

    def integer_linear(x, weight):
        assert x.is_contiguous()  # the kernel takes rows of unit stride
        read.append(weight.format)
        return weight

    monkeypatch.setattr(linear, "integer_linear", integer_linear)
    x = torch.randn(rows, 256)[:, ::2]  # a strided view of x
    out = layer(x)
    if rows == 1:
        assert read == ["q6_g64_fp16"]
    else:
        assert read == [] and torch.equal(out, F.linear(x, q6.decode(torch.float32)))
    assert linear.fuse_linears([layer, GroupwiseLinear(widen_to_q8(q6))]) is None


def test_the_one_row_formats_are_formats_the_integer_gemv_reads():
    """A one-row weight the Triton integer GEMV could not read would be decoded whole at every
    call (`dispatch.integer_linear`'s reference path): the layer's set stays within the
    kernel's."""
    pytest.importorskip("triton")
    from ninfer.kernels import groupwise_gemv_triton

    assert linear.ONE_ROW_FORMATS <= set(groupwise_gemv_triton.ONE_ROW_FORMATS)


def test_above_the_gemv_rows_the_weight_is_dequantized_a_block_of_rows_at_a_time(monkeypatch):
    """A large head need not be dense all at once: with blocks of 16 rows, a 40-row weight
    is dequantized as 16 + 16 + 8 rows and the product is the whole one's."""
    encoded = get_format("q8_g32_fp16").encode(torch.randn(40, 64) * 0.1)
    x = torch.randn(GEMV_MAX_ROWS + 3, 64)
    parts = []

    def dequant(weight, dtype):
        parts.append(weight.shape[0])
        return weight.decode(dtype)

    monkeypatch.setattr(linear, "groupwise_dequant", dequant)
    monkeypatch.setattr(linear, "DEQUANT_BLOCK_BYTES", 16 * 64 * x.element_size())
    out = GroupwiseLinear(encoded)(x)
    assert parts == [16, 16, 8]
    torch.testing.assert_close(out, F.linear(x, encoded.decode(torch.float32)))


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

"""Plain formats (bf16, fp32, int32), fp8_e4m3fn_row_bf16, and the format registry."""

import pytest
import torch

from ninfer.quant import format_names, get_format, register_format


def test_registry_lists_every_builtin_format_and_names_unknown_ones():
    assert set(format_names()) >= {
        "bf16",
        "fp32",
        "int32",
        "q4_g64_fp16",
        "q5_g64_fp16",
        "q6_g64_fp16",
        "q8_g32_fp16",
        "fp8_e4m3fn_row_bf16",
    }
    with pytest.raises(KeyError, match="unknown weight format 'nvfp4'"):
        get_format("nvfp4")
    with pytest.raises(ValueError, match="already registered"):
        register_format(get_format("bf16"))


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_float_formats_store_the_cast_values(name, dtype):
    fmt = get_format(name)
    x = torch.randn(3, 5)
    encoded = fmt.encode(x)
    assert encoded.planes["data"].dtype == dtype
    assert torch.equal(encoded.decode(), x.to(dtype))
    assert torch.equal(fmt.from_bytes(fmt.to_bytes(encoded), (3, 5)).decode(), x.to(dtype))
    assert fmt.encoded_nbytes((3, 5)) == 15 * dtype.itemsize


def test_int32_is_exact_and_refuses_floats_and_out_of_range_values():
    fmt = get_format("int32")
    x = torch.tensor([[-(2**31), 0, 2**31 - 1]], dtype=torch.int64)
    assert fmt.encode(x).decode().tolist() == x.tolist()
    with pytest.raises(ValueError):
        fmt.encode(torch.zeros(2))
    with pytest.raises(ValueError, match="out of range"):
        fmt.encode(torch.tensor([2**31]))


def test_fp8_row_codes_and_scale_are_exact():
    fmt = get_format("fp8_e4m3fn_row_bf16")
    planes = fmt.encode_rows(torch.tensor([[448.0, -224.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert planes["scales"].dtype == torch.bfloat16
    assert planes["scales"].tolist() == [1.0, 0.0]
    assert planes["codes"].dtype == torch.float8_e4m3fn
    assert planes["codes"].float().tolist() == [[448.0, -224.0, 1.0, 0.0], [0.0] * 4]


@pytest.mark.parametrize("shape", [(1, 16), (6, 40), (2, 3, 7)])
def test_fp8_row_random_round_trip_within_three_mantissa_bits(shape):
    fmt = get_format("fp8_e4m3fn_row_bf16")
    torch.manual_seed(len(shape))
    x = torch.randn(shape) * 3
    encoded = fmt.encode(x)
    decoded = encoded.decode()
    rows = x.reshape(-1, shape[-1])
    scale = encoded.planes["scales"].float().unsqueeze(-1)
    amax = rows.abs().amax(-1, keepdim=True)
    bound = torch.maximum(rows.abs() * 2**-4, scale * 2**-9) + amax * 2**-8
    assert ((decoded.reshape_as(rows) - rows).abs() <= bound).all()
    stored = fmt.to_bytes(encoded)
    assert torch.equal(fmt.from_bytes(stored, shape).decode(), decoded)

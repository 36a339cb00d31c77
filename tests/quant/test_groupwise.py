"""Group-wise int formats: exact codes and scales of MAXABS_F16_RECIP_RNE_V1 on hand-made
groups, bit packing of every plane, random round trips within the format's error bound, and
q5/q6 widened to q8 without a change of value."""

import pytest
import torch

from ninfer.quant import get_format
from ninfer.quant.groupwise import widen_to_q8

GROUPWISE = ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"]


def group(values, size):
    row = torch.zeros(size)
    row[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return row.unsqueeze(0)


def test_q4_codes_scale_and_nibble_packing_are_exact():
    fmt = get_format("q4_g64_fp16")
    planes = fmt.encode_rows(group([7.0, -7.0, 2.5, 3.5, -2.5, 1.0], 64))
    assert planes["scales"].tolist() == [[1.0]]
    codes = fmt.unpack_codes(planes)[0, :6].tolist()
    assert codes == [7, -7, 2, 4, -2, 1]  # round half to even: 2.5 -> 2, 3.5 -> 4
    # value 2j in the low nibble, 2j+1 in the high nibble, 4-bit two's complement
    assert planes["codes"][0, :3].tolist() == [0x97, 0x42, 0x1E]


def test_q5_low_nibbles_and_high_bit_plane_are_exact():
    fmt = get_format("q5_g64_fp16")
    planes = fmt.encode_rows(group([15.0, -15.0, -1.0, 5.0], 64))
    assert planes["scales"].tolist() == [[1.0]]
    assert fmt.unpack_codes(planes)[0, :4].tolist() == [15, -15, -1, 5]
    assert planes["codes"][0, :2].tolist() == [0x1F, 0x5F]
    # bit 4 of values 0..7 -> bits 0..7 of the first high byte: 15 -> 0, -15 -> 1, -1 -> 1, 5 -> 0
    assert planes["high"].shape == (1, 8)
    assert planes["high"][0, 0].item() == 0b0110


def test_q6_low_nibbles_and_two_bit_high_plane_are_exact():
    fmt = get_format("q6_g64_fp16")
    planes = fmt.encode_rows(group([31.0, -31.0, -1.0, 17.0], 64))
    assert fmt.unpack_codes(planes)[0, :4].tolist() == [31, -31, -1, 17]
    assert planes["codes"][0, :2].tolist() == [0x1F, 0x1F]
    # bits 4..5: 31 -> 1, -31 (100001) -> 2, -1 -> 3, 17 -> 1, packed at bits 0,2,4,6
    assert planes["high"].shape == (1, 16)
    assert planes["high"][0, 0].item() == 1 | (2 << 2) | (3 << 4) | (1 << 6)


def test_q8_codes_are_plain_int8_and_never_minus_128():
    fmt = get_format("q8_g32_fp16")
    planes = fmt.encode_rows(group([127.0, -127.0, 0.5, 1.5, -64.0], 32))
    assert planes["codes"].dtype == torch.int8
    assert planes["codes"][0, :5].tolist() == [127, -127, 0, 2, -64]
    extreme = fmt.encode_rows(-torch.rand(4, 32) * 1000)
    assert extreme["codes"].min().item() >= -127


def test_scale_is_amax_over_qmax_rounded_to_fp16():
    fmt = get_format("q4_g64_fp16")
    planes = fmt.encode_rows(group([1.0, -0.5], 64))
    expected = torch.tensor(1.0 / 7.0, dtype=torch.float16)
    assert planes["scales"][0, 0] == expected
    # 1.0 * fp32(1/s) = 7.0017..., still code 7; -0.5 -> -3.5009 -> -4
    assert fmt.unpack_codes(planes)[0, :2].tolist() == [7, -4]


def test_scale_that_underflows_fp16_becomes_two_to_minus_24():
    fmt = get_format("q8_g32_fp16")
    planes = fmt.encode_rows(group([1e-12, -1e-12], 32))
    assert planes["scales"][0, 0].item() == 2.0**-24
    assert fmt.unpack_codes(planes)[0, :2].tolist() == [0, 0]


def test_all_zero_group_has_positive_zero_scale_and_zero_codes():
    fmt = get_format("q5_g64_fp16")
    planes = fmt.encode_rows(torch.zeros(2, 64))
    assert planes["scales"].eq(0).all() and not torch.signbit(planes["scales"]).any()
    assert fmt.unpack_codes(planes).eq(0).all()


@pytest.mark.parametrize("name", GROUPWISE)
def test_k_is_padded_to_the_group_and_decoded_shape_is_logical(name):
    fmt = get_format(name)
    x = torch.randn(3, 70)
    encoded = fmt.encode(x)
    assert encoded.planes["scales"].shape == (3, fmt.padded_k(70) // fmt.group)
    assert encoded.decode().shape == (3, 70)


@pytest.mark.parametrize("name", GROUPWISE)
def test_non_finite_or_fp16_overflowing_values_are_rejected(name):
    fmt = get_format(name)
    with pytest.raises(ValueError, match="inf or nan"):
        fmt.encode(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="overflows fp16"):
        fmt.encode(torch.tensor([[1e7, 1.0]]))


@pytest.mark.parametrize("name", GROUPWISE)
@pytest.mark.parametrize("shape", [(1, 64), (5, 128), (2, 3, 96), (7, 33), (4, 1)])
def test_random_round_trip_error_is_within_half_a_step(name, shape):
    fmt = get_format(name)
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])
    encoded = fmt.encode(x)
    decoded = encoded.decode()
    kp = fmt.padded_k(shape[-1])
    scales = encoded.planes["scales"].float().repeat_interleave(fmt.group, dim=1)[:, : shape[-1]]
    scales = scales.reshape(shape)
    # half a step, plus what clamping the largest value costs when fp16 rounded s down
    # (half an fp16 ulp of s, which is 2^-25 absolute for subnormal s)
    fp16_rounding = torch.maximum(scales * 2**-11, torch.full_like(scales, 2**-25))
    bound = 0.5 * scales * (1 + 1e-6) + fmt.qmax * fp16_rounding
    assert ((decoded - x).abs() <= bound).all()
    # bytes round trip through the stored layout is lossless
    stored = fmt.to_bytes(encoded)
    assert stored.numel() == fmt.encoded_nbytes(shape)
    again = fmt.from_bytes(stored, shape)
    assert torch.equal(again.decode(), decoded)
    assert kp % fmt.group == 0


@pytest.mark.parametrize(
    ("name", "bits_per_weight"),
    [("q4_g64_fp16", 4.25), ("q5_g64_fp16", 5.25), ("q6_g64_fp16", 6.25), ("q8_g32_fp16", 8.5)],
)
def test_bits_per_weight_match_the_format(name, bits_per_weight):
    fmt = get_format(name)
    rows, k = 256, 512
    planes_bytes = sum(spec.nbytes for spec in fmt.plane_specs((rows, k)))
    assert planes_bytes * 8 / (rows * k) == bits_per_weight


def test_slab_encoding_equals_whole_tensor_encoding():
    fmt = get_format("q6_g64_fp16")
    x = torch.randn(10, 128)
    whole, slabs = fmt.encode(x), fmt.encode(x, rows_per_slab=3)
    for key in whole.planes:
        assert torch.equal(whole.planes[key], slabs.planes[key])


@pytest.mark.parametrize("name", ["q5_g64_fp16", "q6_g64_fp16"])
@pytest.mark.parametrize("k", [64, 96, 100])
def test_widening_to_q8_keeps_every_value(name, k):
    """q5/q6 codes fit in int8 and a 64-group's scale serves both of its 32-groups: the q8
    tensor decodes to the same bits, K padding included; rows go a block at a time."""
    torch.manual_seed(k)
    encoded = get_format(name).encode(torch.randn(21, k) * 0.3)
    wide = widen_to_q8(encoded, rows_per_block=8)
    assert wide.format == "q8_g32_fp16" and wide.shape == encoded.shape
    assert torch.equal(wide.decode(torch.float32), encoded.decode(torch.float32))
    assert wide.planes["codes"].dtype == torch.int8
    native = get_format("q8_g32_fp16").encode(torch.randn(21, k))  # stacks with it
    assert {n: p.shape[1:] for n, p in wide.planes.items()} == {
        n: p.shape[1:] for n, p in native.planes.items()
    }


@pytest.mark.parametrize("name", ["q4_g64_fp16", "q8_g32_fp16"])
def test_only_q5_and_q6_widen(name):
    with pytest.raises(ValueError, match="does not widen"):
        widen_to_q8(get_format(name).encode(torch.randn(4, 64)))

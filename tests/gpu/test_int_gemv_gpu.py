"""The integer GEMV (dp4a over x split into coarse and fine int8 codes) on the GPU at the
Qwen3.5-27B projection widths (K), one to eight x rows: within the bf16 rounding of its output of the fp32 product of
the dequantized weight (x's split adds under 1/64516 of a group's largest value)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kernel_cases import check_groupwise_linear, check_integer_gemv_at_extreme_q4_codes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
pytest.importorskip("triton")


@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize(("n", "k"), [(2048, 5120), (512, 17408), (96, 5120)], ids=str)
@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
def test_integer_gemv_at_the_27b_shapes(format_name, n, k, m):
    from ninfer.kernels import groupwise_gemv_triton

    assert not groupwise_gemv_triton.INTERPRETED  # the dp4a instruction itself runs here
    torch.manual_seed(m)
    integer = SimpleNamespace(groupwise_linear=groupwise_gemv_triton.integer_linear)
    check_groupwise_linear(integer, format_name, m, n, k, torch.bfloat16, "cuda", 4e-3)
    if m <= groupwise_gemv_triton.INT_MAX_ROWS:  # and the dispatch sends these rows to it
        check_groupwise_linear(
            groupwise_gemv_triton, format_name, m, n, k, torch.bfloat16, "cuda", 4e-3
        )


@pytest.mark.parametrize("codes", ["low", "high", "mixed"])
def test_integer_gemv_is_exact_at_the_extreme_q4_codes(codes):
    """The dp4a itself on codes -8 and 7 (signed bytes 0x80 and 0x70), int32 group sums near
    their bound (`check_integer_gemv_at_extreme_q4_codes`)."""
    from ninfer.kernels import groupwise_gemv_triton

    check_integer_gemv_at_extreme_q4_codes(groupwise_gemv_triton, codes, "cuda")


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    ("n", "k"),
    [(16384, 5120), (12288, 2048), (96, 5000), (248320, 5120), (248320, 2048)],
    ids=str,
)
def test_integer_gemv_reads_q6_planes_as_stored(n, k, m):
    """q6_g64 (the heads' stored format) read as its low and high planes: within the same bound
    of the fp32 product of the dequantized weight, at the 27B and 35B-A3B head widths (also
    with the vocabulary's rows, which `INT_TUNED` may list) and a K that pads its last group;
    and a head layer's one row (`GroupwiseLinear.one_row`) gives what the q8_g32 it widens to
    gives, up to the two splits of x."""
    from ninfer.kernels import groupwise_gemv_triton
    from ninfer.models.layers.linear import GroupwiseLinear
    from ninfer.quant import get_format
    from ninfer.quant.groupwise import widen_to_q8

    torch.manual_seed(n + m)
    integer = SimpleNamespace(groupwise_linear=groupwise_gemv_triton.integer_linear)
    check_groupwise_linear(integer, "q6_g64_fp16", m, n, k, torch.bfloat16, "cuda", 4e-3)
    q6 = get_format("q6_g64_fp16").encode(torch.randn(n, k, device="cuda") * 0.05)
    layer = GroupwiseLinear(widen_to_q8(q6), q6)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    widened = groupwise_gemv_triton.groupwise_linear(x, layer.encoded).float()
    one_row = layer(x)
    assert (one_row.float() - widened).norm() <= 4e-3 * widened.norm()
    assert torch.equal(one_row, groupwise_gemv_triton.integer_linear(x, q6))  # the q6 planes read


@pytest.mark.parametrize(
    ("n", "k"),
    [
        (16384, 5120),
        (14336, 5120),
        (5120, 6144),
        (34816, 5120),
        (5120, 17408),
        (12288, 2048),
        (9216, 2048),
        (2048, 4096),
    ],
    ids=str,
)
def test_integer_gemv_at_the_settings_tuned_for_this_device(n, k):
    """The one-row q4 products that `INT_TUNED` may list for this GPU (the H200's: two or four
    warps, 8 to 32 rows by 64 to 256 words), at their shapes: within the same bound as every
    setting."""
    from ninfer.kernels import groupwise_gemv_triton

    torch.manual_seed(n + k)
    check_groupwise_linear(
        groupwise_gemv_triton, "q4_g64_fp16", 1, n, k, torch.bfloat16, "cuda", 4e-3
    )


@pytest.mark.parametrize(
    "format_name", ["q4_g64_fp16", "q5_g64_fp16", "q6_g64_fp16", "q8_g32_fp16"]
)
def test_encoding_on_the_gpu_gives_the_cpu_planes(format_name):
    """The bench encodes its random weights on the device (every plane allocated there): the
    planes equal those encoded on the CPU, bit for bit."""
    from ninfer.quant import get_format

    torch.manual_seed(0)
    weight = torch.randn(96, 320) * 0.02
    fmt = get_format(format_name)
    on_cpu = fmt.encode(weight)
    on_gpu = fmt.encode(weight.cuda())
    assert on_gpu.planes.keys() == on_cpu.planes.keys()
    for name, plane in on_gpu.planes.items():
        assert plane.device.type == "cuda", name
        assert torch.equal(plane.cpu(), on_cpu.planes[name]), name


def triton_kernel_only(monkeypatch) -> None:
    """`groupwise_linear` at two to eight rows through the Triton tensor-core kernel: the Gluon
    product takes q4 with bf16 x there on Hopper (`groupwise_gemv_gluon.fits`), and its own
    tests are in test_gluon_gemv_gpu.py."""
    from ninfer.kernels import groupwise_gemv_gluon

    monkeypatch.setattr(groupwise_gemv_gluon, "fits", lambda x, weight: False)


@pytest.mark.parametrize("m", [2, 5, 8, 16])
@pytest.mark.parametrize(
    ("n", "k"), [(34816, 5120), (5120, 17408), (5120, 6144), (96, 5120)], ids=str
)
def test_packed_dequantization_gives_the_fp32_form_bit_for_bit(monkeypatch, n, k, m):
    """The q4 tensor-core GEMV with its tiles dequantized two values per instruction (inline
    PTX) gives exactly what it gives with the fp32 form: the same bf16 tiles, so the same
    products. Scales spread over several binades, zero codes and negative scales included."""
    from ninfer.kernels import groupwise_gemv_triton
    from ninfer.quant import get_format

    triton_kernel_only(monkeypatch)

    torch.manual_seed(n + m)
    weight = torch.randn(n, k, device="cuda") * torch.logspace(-4, 1, n, device="cuda")[:, None]
    weight[:, :64] = 0.0
    encoded = get_format("q4_g64_fp16").encode(weight)
    encoded.planes["scales"][1::7] *= -1  # decode is code * scale whatever the sign
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert groupwise_gemv_triton.TC_PACKED_DEQUANT
    # the form that rounds the weight (the scaled-after one is nearer the exact product than
    # this test's bf16 reference allows at its 10-fold scales)
    monkeypatch.setattr(groupwise_gemv_triton, "TC_SCALE_AFTER", False)
    packed = groupwise_gemv_triton.groupwise_linear(x, encoded)
    monkeypatch.setattr(groupwise_gemv_triton, "TC_PACKED_DEQUANT", False)
    assert torch.equal(packed, groupwise_gemv_triton.groupwise_linear(x, encoded))
    dense = encoded.decode(torch.bfloat16)
    torch.testing.assert_close(packed.float(), x.float() @ dense.float().T, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize(
    ("n", "k"), [(34816, 5120), (5120, 17408), (5120, 6144), (96, 5000)], ids=str
)
def test_scaled_after_the_product_is_the_exact_product(monkeypatch, format_name, n, k, m, dtype):
    """The 27B shapes and a masked one (96 rows of a 128-row tile, K not a whole tile): with
    each group's scale after its product (`TC_SCALE_AFTER`), the result is the exact product of
    x and the decoded weight (fp64) to within the output's rounding and fp32 sums, and nearer it
    on average than the form that rounds the weight to x's dtype. q4 with bf16 x makes its
    exact integers through inline PTX: bit for bit what the arithmetic form gives."""
    from ninfer.kernels import groupwise_gemv_triton
    from ninfer.quant import get_format

    triton_kernel_only(monkeypatch)

    torch.manual_seed(n + m)
    weight = torch.randn(n, k, device="cuda") * torch.logspace(-4, 1, n, device="cuda")[:, None]
    encoded = get_format(format_name).encode(weight)
    encoded.planes["scales"][1::7] *= -1
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    assert groupwise_gemv_triton.TC_SCALE_AFTER and groupwise_gemv_triton.TC_PACKED_DEQUANT
    out = groupwise_gemv_triton.groupwise_linear(x, encoded)
    decoded = encoded.decode(torch.float32).double()  # code * scale is exact in fp32
    exact = x.double() @ decoded.T
    magnitude = x.double().abs() @ decoded.abs().T
    error = (out.double() - exact).abs()
    assert (error <= 2**-8 * exact.abs() + 1e-5 * magnitude).all()
    monkeypatch.setattr(groupwise_gemv_triton, "TC_PACKED_DEQUANT", False)
    assert torch.equal(out, groupwise_gemv_triton.groupwise_linear(x, encoded))
    monkeypatch.setattr(groupwise_gemv_triton, "TC_SCALE_AFTER", False)
    rounded = groupwise_gemv_triton.groupwise_linear(x, encoded).double()
    assert error.mean() < (rounded - exact).abs().mean()


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize(
    ("channels", "z_width", "k"), [(10240, 6144, 5120), (8192, 4096, 2048)], ids=["27b", "35b-a3b"]
)
def test_conv_inside_the_in_projection_at_the_model_shapes(format_name, channels, z_width, k):
    """One token, bf16: the q|k|v|z product with the conv of its q|k|v channels in the kernel
    is bit for bit the integer GEMV followed by the conv kernel, the window shifted alike."""
    from ninfer.kernels import causal_conv1d_triton, groupwise_gemv_triton
    from ninfer.quant import get_format

    torch.manual_seed(channels)
    device, bf16 = "cuda", torch.bfloat16
    weight = get_format(format_name).encode(
        torch.randn(channels + z_width, k, device=device) * 0.02
    )
    x = torch.randn(1, k, device=device, dtype=bf16)
    taps = torch.randn(channels, 4, device=device, dtype=bf16) * 0.5
    windows = torch.randn(4, channels, 3, device=device, dtype=bf16)
    slot = torch.tensor([2], dtype=torch.int32, device=device)
    query_start = torch.tensor([0, 1], dtype=torch.int32, device=device)
    unfused_windows = windows.clone()
    out = groupwise_gemv_triton.integer_linear_conv(x, weight, taps, windows, slot)
    product = groupwise_gemv_triton.integer_linear(x, weight)
    mixed = causal_conv1d_triton.causal_conv1d(
        product[:, :channels], taps, unfused_windows, slot, query_start
    )
    assert torch.equal(out[:, :channels], mixed)
    assert torch.equal(out[:, channels:], product[:, channels:])
    assert torch.equal(windows, unfused_windows)


@pytest.mark.parametrize("format_name", ["q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize(("n", "k"), [(34816, 5120), (5120, 17408), (5120, 6144)], ids=str)
def test_whole_tiles_without_masks_give_the_masked_loop_bit_for_bit(
    monkeypatch, format_name, n, k, m
):
    """At the 27B shapes the tensor-core GEMV's loop loads without masks; forcing the masked
    loop gives the same products."""
    from ninfer.kernels import groupwise_gemv_triton
    from ninfer.quant import get_format

    torch.manual_seed(n + m)
    encoded = get_format(format_name).encode(torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    block_n, block_k = groupwise_gemv_triton.TC_CONFIG[format_name][:2]
    assert groupwise_gemv_triton.whole_tiles(n, k, k, block_n, block_k)
    whole = groupwise_gemv_triton.groupwise_linear(x, encoded)
    monkeypatch.setattr(groupwise_gemv_triton, "whole_tiles", lambda *shape: False)
    assert torch.equal(whole, groupwise_gemv_triton.groupwise_linear(x, encoded))

"""When the integer GEMV trusts codes attached to its input (`kernels/x_split.py`): only for
the tensor they were written from, or a reshape of all of it, in the GEMV's own format and
row count, and only while that tensor is unchanged."""

from __future__ import annotations

import torch

from ninfer.kernels.x_split import SplitRequest, attach, attached, split_buffers

Q4 = SplitRequest.for_format("q4_g64_fp16")


def with_split(rows: int = 1, width: int = 256) -> torch.Tensor:
    x = torch.randn(rows, width)
    attach(x, Q4, split_buffers(rows, width, 64, x.device))
    return x


def test_the_producers_output_and_a_reshape_of_all_of_it_carry_the_split():
    x = with_split()
    assert attached(x, 4, 64, 4) is not None
    heads = torch.randn(1, 2, 128)
    attach(heads, Q4, split_buffers(1, 256, 64, heads.device))
    assert attached(heads.reshape(1, 256), 4, 64, 4) is not None


def test_another_format_row_count_or_part_of_x_does_not():
    x = with_split(rows=2)
    assert attached(x, 8, 32, 8) is None
    assert attached(x, 4, 64, 2) is None  # a consumer over fewer groups
    assert attached(x[:1], 4, 64, 4) is None  # a view of part of x
    assert attached(torch.randn(2, 256), 4, 64, 4) is None


def test_a_write_into_x_or_its_view_drops_the_split():
    x = with_split()
    x.add_(1.0)
    assert attached(x, 4, 64, 4) is None
    y = with_split()
    y.view(1, 2, 128)[0, 0, 0] = 3.0
    assert attached(y, 4, 64, 4) is None


def test_requests_name_the_integer_formats_and_the_rows_they_take():
    assert SplitRequest.for_format("bf16") is None
    assert (Q4.bits, Q4.group, Q4.max_rows) == (4, 64, 1)
    q8 = SplitRequest.for_format("q8_g32_fp16", max_rows=64)
    assert q8.wanted(64, 96) and not q8.wanted(65, 96) and not q8.wanted(1, 100)


def test_inference_tensors_carry_the_split_unversioned():
    """The engine's forward runs under inference mode, where tensors keep no version and views
    no base: a reshape of a producer's output is found by its address."""
    with torch.inference_mode():
        x = with_split()
        y = with_split(rows=2)
        heads = torch.randn(1, 2, 128)
        attach(heads, Q4, split_buffers(1, 256, 64, heads.device))
        reshaped = heads.reshape(1, 256)  # records no base under inference mode
    assert attached(x, 4, 64, 4) is not None and attached(reshaped, 4, 64, 4) is not None
    assert attached(y[:1], 4, 64, 4) is None and attached(x, 8, 32, 8) is None

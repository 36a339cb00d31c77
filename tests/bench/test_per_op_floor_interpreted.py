"""The kernels of bench/per_op_floor.py under Triton's CPU interpreter: the read kernel and the
loads-only form of the one-row product against the xor of what they must read, and the
plain loop of the product against the shipped integer GEMV, bit for bit; the same for the
blocked-layout and TMA forms."""

from __future__ import annotations

import functools
import importlib.util
import operator
import sys
from pathlib import Path

import pytest
import torch
from triton_interpreter import require_interpreter

require_interpreter()

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def floor():
    """bench/per_op_floor.py, loaded as `python bench/per_op_floor.py` runs it (with bench/ on
    the path for its sibling import)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("per_op_floor", BENCH / "per_op_floor.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def xor_all(t: torch.Tensor) -> int:
    """The xor of t's values as int32 (sign-extended, so that the xor stays in range)."""
    return functools.reduce(operator.xor, t.to(torch.int64).flatten().tolist(), 0)


def q4_product(n: int, k: int):
    from ninfer.kernels import groupwise_gemv_triton
    from ninfer.quant import get_format

    weight = get_format("q4_g64_fp16").encode(torch.randn(n, k) * 0.02)
    x = torch.randn(1, k, dtype=torch.float16)
    codes, _, steps = groupwise_gemv_triton.split_x(x, 4, 64, k)
    return weight, x, codes, steps


def test_read_kernel_reads_each_program_share_whole(floor):
    setting = floor.ReadSetting(warps=1, block=64, steps=3, programs=4)
    words = torch.randint(-(2**31), 2**31 - 1, (setting.words(),), dtype=torch.int32)
    out = torch.empty(setting.programs, dtype=torch.int32)
    floor.launch_read(words, out, setting, {"PDL": False})
    shares = words.view(setting.programs, -1)
    assert out.tolist() == [xor_all(share) for share in shares]


@pytest.mark.parametrize("with_x", [False, True])
def test_pattern_kernel_reads_every_code_scale_and_x_word_of_its_rows(floor, with_x):
    n, k, rows, words = 16, 1024, 8, 32
    weight, _, codes, steps = q4_product(n, k)
    out = torch.empty(n, dtype=torch.int32)
    planes = weight.planes
    floor._pattern_kernel[(n // rows,)](
        planes["codes"].view(torch.int32), planes["scales"], codes, steps, out, k // 8, k // 64,
        WITH_X=with_x, BLOCK_N=rows, BLOCK_WORDS=words, STAGES=3, PDL=False,
    )  # fmt: skip
    scales = planes["scales"].view(torch.int16).to(torch.int32)
    x_part = xor_all(codes) ^ xor_all(steps.view(torch.int32)) if with_x else 0
    for row in range(n):
        expected = xor_all(planes["codes"][row].view(torch.int32)) ^ xor_all(scales[row])
        expected ^= x_part
        assert out[row].item() == expected, row


def test_plain_loop_with_two_levels_is_the_shipped_product(floor):
    from ninfer.kernels import groupwise_gemv_triton

    n, k = 32, 1024
    weight, x, codes, steps = q4_product(n, k)
    out = torch.empty(n, dtype=torch.float16)
    planes = weight.planes
    floor._levels_kernel[(n // 8,)](
        planes["codes"].view(torch.int32), planes["scales"], codes, steps, out, k // 8, k // 64,
        LEVELS=2, BLOCK_N=8, BLOCK_WORDS=32, STAGES=3, PDL=False, ASM=False,
    )  # fmt: skip
    assert torch.equal(out, groupwise_gemv_triton.integer_linear(x, weight)[0])


def blocked(plane: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """plane [n, k] stored as `_tile_rows` reads it with BLOCKED: each rows x cols tile whole,
    the tiles of a row block in order along k, the row blocks one after another."""
    n, k = plane.shape
    tiles = plane.reshape(n // rows, rows, k // cols, cols).permute(0, 2, 1, 3)
    return tiles.contiguous().reshape(n, k)


def test_blocked_forms_read_the_tiles_of_a_blocked_layout(floor):
    from ninfer.kernels import groupwise_gemv_triton

    n, k, rows, words = 32, 1024, 8, 32
    weight, x, codes, steps = q4_product(n, k)
    planes = weight.planes
    flat_codes = planes["codes"].view(torch.int32)
    args = (blocked(flat_codes, rows, words), blocked(planes["scales"], rows, words // 8))
    common = {"BLOCK_N": rows, "BLOCK_WORDS": words, "STAGES": 3, "PDL": False}
    loads = torch.empty(n, dtype=torch.int32)
    as_stored = torch.empty(n, dtype=torch.int32)
    floor._pattern_kernel[(n // rows,)](
        *args, codes, steps, loads, k // 8, k // 64, WITH_X=True, BLOCKED=True, **common
    )
    floor._pattern_kernel[(n // rows,)](
        flat_codes, planes["scales"], codes, steps, as_stored, k // 8, k // 64, WITH_X=True,
        **common,
    )  # fmt: skip
    assert torch.equal(loads, as_stored)
    out = torch.empty(n, dtype=torch.float16)
    floor._levels_kernel[(n // rows,)](
        *args, codes, steps, out, k // 8, k // 64, LEVELS=2, ASM=False, BLOCKED=True, **common
    )
    assert torch.equal(out, groupwise_gemv_triton.integer_linear(x, weight)[0])


def test_tma_forms_read_what_the_plain_forms_read(floor):
    """`_tma_kernel` through host tensor descriptors: its loop bit for bit the shipped product,
    its loads-only form the xor of its rows' codes and scales."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ninfer.kernels import groupwise_gemv_triton

    n, k, rows, words = 32, 1024, 8, 64
    weight, x, codes, steps = q4_product(n, k)
    planes = weight.planes
    flat_codes = planes["codes"].view(torch.int32)
    descs = (
        TensorDescriptor.from_tensor(flat_codes, [rows, words]),
        TensorDescriptor.from_tensor(planes["scales"], [rows, words // 8]),
    )
    common = {"BLOCK_N": rows, "BLOCK_WORDS": words, "STAGES": 3, "PDL": False}
    out = torch.empty(n, dtype=torch.float16)
    floor._tma_kernel[(n // rows,)](
        *descs, codes, steps, out, k // 8, LOADS_ONLY=False, ASM=False, **common
    )
    assert torch.equal(out, groupwise_gemv_triton.integer_linear(x, weight)[0])
    loads = torch.empty(n, dtype=torch.int32)
    floor._tma_kernel[(n // rows,)](*descs, codes, steps, loads, k // 8, LOADS_ONLY=True, **common)
    scales = planes["scales"].view(torch.int16).to(torch.int32)
    for row in range(n):
        assert loads[row].item() == xor_all(flat_codes[row]) ^ xor_all(scales[row]), row

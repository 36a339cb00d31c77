"""Every Triton kernel compiles for sm_90 (`tools/gpu/compile_check.py`): the interpreted tests
never compile one, so without this a kernel Triton cannot lower fails first on a GPU. Run in a
process of its own, because this one interprets the kernels (TRITON_INTERPRET, conftest.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.kernels.triton_support import programs_per_sm

pytest.importorskip("triton")

TOOL = Path(__file__).resolve().parents[2] / "tools" / "gpu" / "compile_check.py"


def test_every_kernel_compiles_for_sm90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(TOOL)], env=env, capture_output=True, text=True, timeout=900
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    cases = [line for line in lines[1:] if line.strip()]
    assert len(cases) >= 20 and all(line.startswith("ok ") for line in cases), result.stdout


def test_sass_lines_name_registers_and_the_longest_loop():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(TOOL), "-k", "integer gemv q4", "--sass"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    gemv = [line for line in result.stdout.splitlines() if "_groupwise_gemv_int_kernel:" in line]
    assert len(gemv) == 1, result.stdout
    assert "registers " in gemv[0] and "local 0 B" in gemv[0]
    assert "longest loop" in gemv[0] and " IDP " in gemv[0]  # the dp4a products of its loop
    assert re.search(
        r"shared memory \d+ B, \d+ programs an SM \((shared memory|registers|warps)", gemv[0]
    )


def test_programs_an_sm_holds_follow_the_driver_s_rule():
    """The Gluon product's 76,824 bytes fit two programs an SM, not three: the hardware keeps
    1 KB per program besides (the driver's occupancy query on the GPU said two). 3 KB less fits
    three, while the registers allow: 168 a thread do, 170 (a warp's 5,632) do not."""
    assert programs_per_sm(76824, 65, 4) == (2, "shared memory")
    assert programs_per_sm(73752, 168, 4) == (3, "shared memory")
    assert programs_per_sm(73752, 170, 4) == (2, "registers")
    assert programs_per_sm(0, 32, 4) == (16, "registers")
    assert programs_per_sm(0, 0, 1) == (32, "programs")

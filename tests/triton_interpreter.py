"""Switches Triton's CPU interpreter on for a test module, or skips the module where it cannot
run. TRITON_INTERPRET=1 must be set before Triton is first imported (its own library functions
are kernels too), so a module calls `require_interpreter()` before it imports Triton or a
Triton kernel module. A GPU present means tests/gpu covers the compiled kernels instead.
The interpreter's tl.dot is wrong for bf16 operands and it rounds to bf16 by truncation (seen
with triton 3.9), so interpreted tests run half precision in fp16; the GPU tests cover bf16."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest
import torch


def require_interpreter() -> None:
    if torch.cuda.is_available():
        pytest.skip(
            "a GPU is present: tests/gpu runs the compiled kernels", allow_module_level=True
        )
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "Triton was imported before interpretation could be switched on",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    broken = _interpreter_fails()
    if broken:
        pytest.skip(f"Triton's interpreter does not run here ({broken})", allow_module_level=True)


def _interpreter_fails() -> str | None:
    """Some Triton/numpy pairs break the interpreter itself (e.g. triton 3.6 with numpy 2.4)."""
    import triton
    import triton.language as tl

    @triton.jit
    def canary(x_ptr, out_ptr, n):
        total = tl.zeros([16], tl.float32)
        for i in range(0, n):
            total += tl.load(x_ptr + i * 16 + tl.arange(0, 16))
        tl.store(out_ptr, tl.sum(total, axis=0))

    x, out = torch.ones(3 * 16), torch.zeros(1)
    try:
        canary[(1,)](x, out, 3)
    except Exception as error:  # noqa: BLE001 - any failure means no interpreter here
        return f"{type(error).__name__}: {error}"
    return None if out.item() == 48.0 else f"canary kernel returned {out.item()}"


def load_kernel_module(name: str) -> ModuleType:
    """A fresh copy of ninfer.kernels.<name>, so its kernels are built under the interpreter."""
    spec = importlib.util.find_spec(f"ninfer.kernels.{name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""The programmatic-dependent-launch contract (`kernels/pdl_triton.py`), checked on the source:
every Triton kernel of ours waits for the kernel before it before any memory access (only
index arithmetic and L2 prefetches of weights may come first) and takes the PDL constant,
and every launch passes `pdl_options`; where PDL is off, nothing asks for it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

import ninfer.kernels

KERNEL_DIR = Path(ninfer.kernels.__file__).parent
SOURCES = sorted(p for p in KERNEL_DIR.glob("*_triton.py") if p.name != "pdl_triton.py")


def _jit_kernels(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
            if any(getattr(d, "attr", None) == "jit" for d in node.decorator_list):
                yield node


# What may run before the wait: index arithmetic, and asking the L2 for weights.
BEFORE_WAIT_CALLS = {"program_id", "arange", "to", "prefetch_l2"}


def _before_wait(fn: ast.FunctionDef) -> tuple[list[ast.stmt], ast.stmt | None]:
    """The statements before the kernel's top-level `await_inputs(PDL)` (docstring left
    out), and that statement (None if there is none)."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    for index, statement in enumerate(body):
        if ast.unparse(statement) == "await_inputs(PDL)":
            return body[:index], statement
    return body, None


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "?")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_kernel_waits_first_and_every_launch_passes_the_options(path):
    tree = ast.parse(path.read_text())
    kernels = list(_jit_kernels(tree))
    assert kernels, f"{path.name} defines no kernel"
    for fn in kernels:
        before, wait = _before_wait(fn)
        assert wait is not None, f"{fn.name} never calls await_inputs(PDL) at its top level"
        for statement in before:
            for node in ast.walk(statement):
                assert not isinstance(node, ast.Return), f"{fn.name} returns before its wait"
                if isinstance(node, ast.Call):
                    assert _call_name(node) in BEFORE_WAIT_CALLS, (
                        f"{fn.name} calls {ast.unparse(node)} before its wait"
                    )
        assert "PDL" in [a.arg for a in fn.args.args], fn.name
    names = {fn.name for fn in kernels}
    launches = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and getattr(node.func.value, "id", None) in names
    ]
    assert {launch.func.value.id for launch in launches} == names, "a kernel is never launched"
    for launch in launches:
        spread = [k.value for k in launch.keywords if k.arg is None]
        assert any(
            isinstance(v, ast.Call) and getattr(v.func, "id", None) == "pdl_options" for v in spread
        ), f"a launch of {launch.func.value.id} does not pass pdl_options"


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_options_off_on_the_cpu_and_when_disabled(monkeypatch):
    from ninfer.kernels.pdl_triton import pdl_options

    assert pdl_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("NINFER_PDL", "0")
    assert pdl_options(torch.device("cuda", 0)) == {"PDL": False}

"""The programmatic-dependent-launch contract (`kernels/pdl_triton.py`), checked on the source:
every Triton kernel of ours waits for the kernel before it as its first statement and takes
the PDL constant, and every launch passes `pdl_options`; where PDL is off, nothing asks for it."""

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


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return body[1] if docstring else body[0]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_kernel_waits_first_and_every_launch_passes_the_options(path):
    tree = ast.parse(path.read_text())
    kernels = list(_jit_kernels(tree))
    assert kernels, f"{path.name} defines no kernel"
    for fn in kernels:
        first = _first_statement(fn)
        assert ast.unparse(first) == "await_inputs(PDL)", (
            f"{fn.name} starts with {ast.unparse(first)}"
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

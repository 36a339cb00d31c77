"""The programmatic-dependent-launch contract (`kernels/pdl_triton.py`), checked on the source:
every Triton kernel of ours waits for the kernel before it as its first statement (those in
`READ_BEFORE_WAIT`: at its top level or in a top-level `if`, after loads only) and takes the
PDL constant, and every launch passes `pdl_options`; where PDL is off, nothing asks for it."""

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


def _writes(nodes) -> list[str]:
    """The calls among `nodes` that write memory or wait on a barrier, and early returns."""
    found = []
    for node in nodes:
        if isinstance(node, ast.Return):
            found.append("return")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.startswith("tl.atomic") or name in ("tl.store", "tl.debug_barrier"):
                found.append(name)
    return found


def _called(nodes, helpers: dict[str, ast.FunctionDef], seen: set[str]) -> list[ast.AST]:
    """The nodes of the module's functions that `nodes` call, and of those they call."""
    found = []
    for node in nodes:
        name = getattr(node.func, "id", None) if isinstance(node, ast.Call) else None
        if name in helpers and name not in seen:
            seen.add(name)
            body = [n for statement in helpers[name].body for n in ast.walk(statement)]
            found += body + _called(body, helpers, seen)
    return found


def _waits_in_time(fn: ast.FunctionDef, helpers: dict[str, ast.FunctionDef] | None = None) -> None:
    """fn's wait is its first statement, or (READ_BEFORE_WAIT) its waits are top-level
    statements, or statements of top-level `if`s on constants, with no write or return
    before the last of them in the source, nor in the module's functions (`helpers`) called
    there."""
    from ninfer.kernels.pdl_triton import READ_BEFORE_WAIT

    first = _first_statement(fn)
    if fn.name not in READ_BEFORE_WAIT:
        assert ast.unparse(first) == "await_inputs(PDL)", (
            f"{fn.name} starts with {ast.unparse(first)}"
        )
        return
    placed = []
    for statement in fn.body:
        branches = [statement.body, statement.orelse] if isinstance(statement, ast.If) else []
        for inner in [statement, *(s for branch in branches for s in branch)]:
            if ast.unparse(inner) == "await_inputs(PDL)":
                placed.append(inner.lineno)
    every = [
        n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n) == "await_inputs(PDL)"
    ]
    assert placed and len(placed) == len(every), f"{fn.name} waits inside a loop or deeper"
    before = [n for n in ast.walk(fn) if getattr(n, "lineno", 0) < max(placed)]
    assert not _writes(before), f"{fn.name} writes before its wait"
    called = _called(before, helpers or {}, set())
    assert not _writes(n for n in called if not isinstance(n, ast.Return)), (
        f"{fn.name} writes before its wait, in a function it calls"
    )


def test_a_kernel_that_stores_before_its_wait_breaks_the_contract(monkeypatch):
    from ninfer.kernels import pdl_triton

    source = (
        "@triton.jit\ndef _early_kernel(p, PDL):\n"
        "    x = tl.load(p)\n    tl.store(p, x)\n    await_inputs(PDL)\n"
    )
    fn = next(_jit_kernels(ast.parse(source)))
    with pytest.raises(AssertionError, match="starts with"):
        _waits_in_time(fn)
    monkeypatch.setitem(pdl_triton.READ_BEFORE_WAIT, "_early_kernel", "a test")
    with pytest.raises(AssertionError, match="writes before its wait"):
        _waits_in_time(fn)
    _waits_in_time(next(_jit_kernels(ast.parse(source.replace("    tl.store(p, x)\n", "")))))
    helper = "@triton.jit\ndef _put(p, x):\n    tl.store(p, x)\n    return x\n\n"
    tree = ast.parse(helper + source.replace("    tl.store(p, x)\n", "    _put(p, x)\n"))
    helpers = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    with pytest.raises(AssertionError, match="in a function it calls"):
        _waits_in_time(next(_jit_kernels(tree)), helpers)


def test_every_kernel_read_before_its_wait_exists():
    from ninfer.kernels.pdl_triton import READ_BEFORE_WAIT

    names = {fn.name for path in SOURCES for fn in _jit_kernels(ast.parse(path.read_text()))}
    assert set(READ_BEFORE_WAIT) <= names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_kernel_waits_first_and_every_launch_passes_the_options(path):
    tree = ast.parse(path.read_text())
    kernels = list(_jit_kernels(tree))
    assert kernels, f"{path.name} defines no kernel"
    helpers = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for fn in kernels:
        _waits_in_time(fn, helpers)
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


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}


def _calls(statements) -> list[str]:
    return [
        ast.unparse(node.func)
        for statement in statements
        for node in ast.walk(statement)
        if isinstance(node, ast.Call)
    ]


def test_the_gluon_gemv_asks_only_for_weights_before_its_wait():
    """`groupwise_gemv_gluon._q4_tc_kernel` keeps the contract its own way. Its product's
    programs (the `else` of its one branch on GATES) ask TMA before the PDL wait only for
    codes and scales (an `_issue_tile` whose x flag, its parameter `X`, is False, there or in
    `_ask_for_weights`), which no kernel writes; x's tiles, the loop and every store come after the wait. In one partition
    (the `else` of `if WS`) the wait is a top-level `_await_inputs(PDL)`. Warp-specialized,
    the program asks for the codes and scales and starts the partitions: the producer
    (`_produce_tiles`) waits first, and the consumers (`_consume_tiles`) read memory of their
    own (a folded norm's squares before the product, or the residual and weight of one after
    it) only after a wait. The gates programs (`_gates_program`) load only their b|a weight
    row (`ba_ptr`, which no kernel writes) before theirs. Its launch passes `pdl_options`."""
    source = (KERNEL_DIR / "groupwise_gemv_gluon.py").read_text()
    tree = ast.parse(source)
    functions = _functions(tree)
    (kernel,) = [fn for fn in _jit_kernels(tree) if fn.name == "_q4_tc_kernel"]
    assert "PDL" in [a.arg for a in kernel.args.args]
    (branch,) = [s for s in kernel.body if isinstance(s, ast.If)]
    assert ast.unparse(branch.test).startswith("GATES and ")
    assert "_gates_program" in _calls(branch.body)
    (forms,) = [s for s in branch.orelse if isinstance(s, ast.If) and ast.unparse(s.test) == "WS"]
    common = branch.orelse[: branch.orelse.index(forms)]
    specialize = [i for i, s in enumerate(forms.body) if "gl.warp_specialize" in _calls([s])]
    assert len(specialize) == 1 and "_await_inputs" not in _calls(forms.body)
    bodies = (
        ("product", common + forms.orelse, None),
        ("warp-specialized product", common + forms.body, specialize[0] + len(common)),
        ("_produce_tiles", functions["_produce_tiles"].body, None),
        ("_gates_program", functions["_gates_program"].body, None),
    )
    x_flag = [a.arg for a in functions["_issue_tile"].args.args].index("X")
    for name, body, wait in bodies:
        if wait is None:
            waits = [i for i, s in enumerate(body) if ast.unparse(s) == "_await_inputs(PDL)"]
            assert len(waits) == 1, f"one top-level wait in the {name} programs"
            wait = waits[0]
        before = body[:wait]
        called = _calls(before)
        assert not [c for c in called if c.startswith(("gl.atomic", "gl.store"))], name
        loads = [
            ast.unparse(node.args[0])
            for statement in before
            for node in ast.walk(statement)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "gl.load"
        ]
        allowed = "ba_ptr" if name == "_gates_program" else None
        assert all(allowed and load.startswith(allowed) for load in loads), (name, loads)
        assert "range(count)" not in "".join(map(ast.unparse, before)), "the loop after the wait"
        asked = before + (
            functions["_ask_for_weights"].body if "_ask_for_weights" in called else []
        )
        issues = [
            node
            for statement in asked
            for node in ast.walk(statement)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_issue_tile"
        ]
        if name.endswith("product"):
            assert issues, "the weights are asked for before the wait"
        for call in issues:
            assert ast.unparse(call.args[x_flag]) == "False", ast.unparse(call)
    # the consumers read memory a kernel writes (ROW_SCALE: the squares; FOLD: the residual
    # and the norm's weight) only after their own wait, taken whenever they read
    consume = functions["_consume_tiles"].body
    (waited,) = [
        i
        for i, s in enumerate(consume)
        if isinstance(s, ast.If) and ast.unparse(s.body) == "_await_inputs(PDL)"
    ]
    assert ast.unparse(consume[waited].test) == "ROW_SCALE or FOLD"
    reads = [
        (i, s) for i, s in enumerate(consume) if {"gl.load", "_load_squares"} & set(_calls([s]))
    ]
    assert len(reads) == 2 and _calls(consume).count("_load_squares") == 1
    for i, statement in reads:
        assert i > waited and isinstance(statement, ast.If), ast.unparse(statement)
        assert ast.unparse(statement.test) in ("ROW_SCALE", "FOLD"), ast.unparse(statement)
    consumer = _calls(consume) + _calls(functions["_tile_product"].body)
    assert not [c for c in consumer if c == "gl.store" or c.startswith("gl.atomic")]
    assert "gl.load" not in _calls(functions["_tile_product"].body)
    outside = [s for s in kernel.body if s is not branch]
    assert not [c for c in _calls(outside) if c.startswith(("gl.load", "gl.store", "gl.atomic"))]
    assert "**pdl_options(x.device)" in source

"""Chat-formatted training samples made from the corpus, rendered through the demo chat template.

Each documented function becomes one conversation: docstring -> function, function -> summary, or
a turn that calls a tool (`search_code` / `read_file`) in Qwen's XML form, reads the
`<tool_response>` and answers. Replies carry an empty think block, or now and then a short
templated reasoning, so both thinking modes of the template are exercised. Every choice is drawn
from a generator seeded by the function's text, so the samples are as deterministic as the corpus."""

from __future__ import annotations

import ast
import hashlib
import json
import random
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the installed Python packages for a function or class by name.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "the name to look for"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a source file, or one function or class in it.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "path of the file"},
                    "symbol": {"type": "string", "description": "name of a function or class"},
                },
                "required": ["path"],
            },
        },
    },
]

SYSTEM_PROMPTS = [
    "You are a coding assistant. Answer with Python code.",
    "You are the ninfer demo model, a small model trained on Python source code.",
    "You write short, correct Python.",
]

WRITE_PHRASES = [
    "Write a Python function `{signature}`.\n\n{doc}",
    "Implement `{signature}`:\n\n{doc}",
    "{doc}\n\nWrite this as a Python function named `{name}`.",
    "Can you write `{name}` for me? {doc}",
]
EXPLAIN_PHRASES = [
    "What does this function do?\n\n```python\n{code}\n```",
    "Explain this code briefly.\n\n```python\n{code}\n```",
]
SEARCH_PHRASES = [
    "Find the function `{name}` and tell me what it does.",
    "Where is `{name}` defined?",
    "What does `{name}` do? Look it up.",
]
READ_PHRASES = [
    "Show me `{name}` from `{path}`.",
    "Open `{path}` and show me the function `{name}`.",
]


def template_source() -> str:
    return TEMPLATE_PATH.read_text()


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _raise(message: str) -> None:
    raise ValueError(message)


class Renderer:
    """The chat template under transformers' `apply_chat_template` environment settings."""

    def __init__(self, source: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source or template_source())

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
        )


@dataclass(slots=True, frozen=True)
class Function:
    name: str
    signature: str
    doc: str
    code: str  # the whole definition, dedented
    code_without_doc: str
    lineno: int


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0].strip()


def functions_in(source: str, max_code: int = 1600) -> list[Function]:
    """Documented functions of a module, small enough to be a chat reply."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = source.split("\n")
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or not 24 <= len(doc) <= 1000 or node.name.startswith("__"):
            continue
        start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body = lines[start - 1 : node.end_lineno]
        code = textwrap.dedent("\n".join(body)).strip("\n")
        if not 80 <= len(code) <= max_code or code.count("\n") < 3:
            continue
        doc_node = node.body[0]
        keep = [
            line
            for number, line in enumerate(body, start)
            if not doc_node.lineno <= number <= doc_node.end_lineno
        ]
        code_without_doc = textwrap.dedent("\n".join(keep)).strip("\n")
        if code_without_doc.count("\n") < 2:
            continue
        try:
            signature = f"{node.name}({ast.unparse(node.args)})"
        except (ValueError, RecursionError):
            continue
        found.append(Function(node.name, signature, doc, code, code_without_doc, node.lineno))
    return found


def _assistant(content: str, reasoning: str = "", **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, **extra}


def conversation(fn: Function, path: str, rng: random.Random) -> tuple[list, list | None]:
    """(messages, tools) of one sample built around `fn`."""
    messages: list[dict[str, Any]] = []
    tools = None
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    think = rng.random() < 0.2
    summary = _first_paragraph(fn.doc)
    roll = rng.random()
    if roll < 0.55:
        if rng.random() < 0.15:
            tools = TOOLS
        doc = fn.doc.strip()
        user = rng.choice(WRITE_PHRASES).format(signature=fn.signature, name=fn.name, doc=doc)
        reasoning = (
            f"The function is `{fn.signature}`. {summary.split('.')[0].strip()}. "
            "I will write it as plain Python."
            if think
            else ""
        )
        messages += [
            {"role": "user", "content": user},
            _assistant(f"```python\n{fn.code}\n```", reasoning),
        ]
    elif roll < 0.75:
        user = rng.choice(EXPLAIN_PHRASES).format(code=fn.code_without_doc)
        reasoning = f"This defines `{fn.name}`. I will say what it does." if think else ""
        messages += [{"role": "user", "content": user}, _assistant(summary, reasoning)]
    else:
        tools = TOOLS
        if rng.random() < 0.6:
            user = rng.choice(SEARCH_PHRASES).format(name=fn.name)
            call = {"name": "search_code", "arguments": {"query": fn.name}}
            result = f"{path}:{fn.lineno}\n{fn.code}"
            answer = f"`{fn.name}` is defined in `{path}`. {summary}"
            reasoning = f"I need to find `{fn.name}` first, so I will search for it."
        else:
            user = rng.choice(READ_PHRASES).format(name=fn.name, path=path)
            call = {"name": "read_file", "arguments": {"path": path, "symbol": fn.name}}
            result = fn.code
            answer = f"Here is `{fn.name}` from `{path}`:\n\n```python\n{fn.code}\n```"
            reasoning = f"I will read `{fn.name}` from `{path}`."
        messages += [
            {"role": "user", "content": user},
            _assistant(
                "",
                reasoning if think else "",
                tool_calls=[{"type": "function", "function": call}],
            ),
            {"role": "tool", "content": result},
            _assistant(answer),
        ]
    return messages, tools


def samples_for_file(
    args: tuple[str, str, str], per_file: int = 3, renderer: Renderer | None = None
) -> list[str]:
    """Rendered conversations (each ending with a newline after `<|im_end|>`) for one module:
    (label, sha256, source) -> up to `per_file` samples."""
    label, digest, source = args
    functions = functions_in(source)
    if not functions:
        return []
    rng = random.Random(int(digest[:16], 16))
    rng.shuffle(functions)
    renderer = renderer or _renderer()
    path = label.split("/", 1)[1]
    out = []
    for fn in functions[:per_file]:
        fn_rng = random.Random(hashlib.sha256(fn.code.encode()).digest())
        messages, tools = conversation(fn, path, fn_rng)
        out.append(renderer.render(messages, tools))
    return out


_RENDERER: Renderer | None = None


def _renderer() -> Renderer:
    global _RENDERER
    if _RENDERER is None:
        _RENDERER = Renderer()
    return _RENDERER

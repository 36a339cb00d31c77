"""The artifact's Jinja chat template, rendered with transformers' `apply_chat_template` semantics
(same sandboxed environment, globals, filters and variables), and the reasoning controls it
exposes, read from the template source rather than guessed from the model name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ninfer.errors import NinferError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ChatTemplateError(NinferError):
    """The template refused the conversation (its `raise_exception`) or failed to render."""


class ChatTemplateOptionError(NinferError):
    """A reasoning / template option the template cannot honour. `code` is the API error code:
    `reasoning_effort_not_supported`, `conflicting_template_option` or
    `chat_template_option_not_supported`."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body; transformers uses the tag only to
    build assistant masks, which inference never needs."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not Jinja's built-in tojson: that one HTML-escapes, which transformers deliberately avoids.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(slots=True, frozen=True)
class TemplateCapabilities:
    """What the template source reads. `effort_levels` are the string values it compares
    `reasoning_effort` against; `default_effort` is the value it falls back to, if it says."""

    thinking: bool
    effort_levels: tuple[str, ...]
    default_effort: str | None
    preserve_thinking: bool

    @property
    def reasoning_effort(self) -> bool:
        return bool(self.effort_levels)


@dataclass(slots=True, frozen=True)
class ReasoningOptions:
    """Resolved prompt options as passed to the template; None = not passed, so the template's
    own default applies."""

    enable_thinking: bool | None
    reasoning_effort: str | None


def _mentions(node: nodes.Node, names: set[str]) -> bool:
    return any(n.name in names for n in node.find_all(nodes.Name)) or (
        isinstance(node, nodes.Name) and node.name in names
    )


def _string_consts(node: nodes.Node) -> list[str]:
    if isinstance(node, nodes.Const) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, nodes.List | nodes.Tuple):
        return [v for item in node.items for v in _string_consts(item)]
    if isinstance(node, nodes.Dict):
        return [v for pair in node.items for v in _string_consts(pair.key)]
    return []


def _detect_capabilities(ast: nodes.Template, variables: frozenset[str]) -> TemplateCapabilities:
    effort_names = {"reasoning_effort"}
    levels: list[str] = []
    default: str | None = None
    dict_literals: dict[str, nodes.Dict] = {}
    if "reasoning_effort" in variables:
        # Names the template derives from reasoning_effort count as the effort too.
        for assign in ast.find_all(nodes.Assign):
            if not isinstance(assign.target, nodes.Name):
                continue
            if isinstance(assign.node, nodes.Dict):
                dict_literals[assign.target.name] = assign.node
            if _mentions(assign.node, effort_names):
                effort_names.add(assign.target.name)
        for assign in ast.find_all(nodes.Assign):
            if (
                isinstance(assign.target, nodes.Name)
                and assign.target.name in effort_names
                and isinstance(assign.node, nodes.Const)
                and isinstance(assign.node.value, str)
            ):
                default = assign.node.value
        for compare in ast.find_all(nodes.Compare):
            operands = [compare.expr, *(op.expr for op in compare.ops)]
            if any(isinstance(o, nodes.Name) and o.name in effort_names for o in operands):
                for o in operands:
                    levels.extend(_string_consts(o))
        for getitem in ast.find_all(nodes.Getitem):
            if _mentions(getitem.arg, effort_names):
                table = getitem.node
                if isinstance(table, nodes.Name):
                    table = dict_literals.get(table.name)
                if table is not None:
                    levels.extend(_string_consts(table))
        for flt in ast.find_all(nodes.Filter):
            if (
                flt.name in ("default", "d")
                and isinstance(flt.node, nodes.Name)
                and flt.node.name in effort_names
                and flt.args
                and isinstance(flt.args[0], nodes.Const)
            ):
                default = flt.args[0].value
        for cond in ast.find_all(nodes.CondExpr):
            if (
                _mentions(cond.test, effort_names)
                and isinstance(cond.expr1, nodes.Name)
                and cond.expr1.name in effort_names
                and isinstance(cond.expr2, nodes.Const)
            ):
                default = cond.expr2.value
    if default is not None:
        levels.append(default)
    return TemplateCapabilities(
        thinking="enable_thinking" in variables,
        effort_levels=tuple(dict.fromkeys(levels)),
        default_effort=default,
        preserve_thinking="preserve_thinking" in variables,
    )


class ChatTemplate:
    """A compiled chat template. `render` takes the same inputs as transformers'
    `apply_chat_template(..., tokenize=False)`; options left as None are not passed, so the
    template's own `is defined` defaults apply."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        env = _environment()
        try:
            ast = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        # find_undeclared_variables runs the code generator, which rewrites parts of the tree it
        # walks, so it gets its own parse.
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        self.capabilities = _detect_capabilities(ast, self.variables)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
        preserve_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> str:
        kwargs: dict[str, Any] = {**self.special_tokens, **template_kwargs}
        for name, value in (
            ("enable_thinking", enable_thinking),
            ("reasoning_effort", reasoning_effort),
            ("preserve_thinking", preserve_thinking),
        ):
            if value is not None:
                kwargs[name] = value
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # The template is data, and so is the conversation it is given: a Python error
            # inside the template means this conversation does not fit it (e.g. a tool schema
            # of an unexpected shape), not that ninfer is broken.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc

    def resolve_reasoning(
        self, enable_thinking: bool | None = None, reasoning_effort: str | None = None
    ) -> ReasoningOptions:
        """Checks a request's thinking switch and effort against the template.

        Effort `none` means thinking off. An effort the template does not compare against is
        `reasoning_effort_not_supported`; thinking off together with a real effort is
        `conflicting_template_option`; turning thinking off on a template without the switch is
        `chat_template_option_not_supported`.
        """
        caps = self.capabilities
        if reasoning_effort == "none":
            if enable_thinking is True:
                raise ChatTemplateOptionError(
                    "conflicting_template_option",
                    "enable_thinking=true conflicts with reasoning_effort='none'",
                    "reasoning_effort",
                )
            enable_thinking, reasoning_effort = False, None
        if reasoning_effort is not None:
            if reasoning_effort not in caps.effort_levels:
                supported = ", ".join(caps.effort_levels) or "none"
                raise ChatTemplateOptionError(
                    "reasoning_effort_not_supported",
                    f"reasoning_effort '{reasoning_effort}' is not supported by this model's "
                    f"chat template (supported: {supported})",
                    "reasoning_effort",
                )
            if enable_thinking is False:
                raise ChatTemplateOptionError(
                    "conflicting_template_option",
                    f"thinking is disabled but reasoning_effort is '{reasoning_effort}'",
                    "reasoning_effort",
                )
        if enable_thinking is False and not caps.thinking:
            raise ChatTemplateOptionError(
                "chat_template_option_not_supported",
                "this model's chat template has no switch to disable thinking",
                "enable_thinking",
            )
        return ReasoningOptions(enable_thinking=enable_thinking, reasoning_effort=reasoning_effort)


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves a `<think>` block open, so generation starts in the
    reasoning channel."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def tool_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` where assistant tool-call arguments given as a JSON-object string
    (the OpenAI wire form) become dicts, the form Qwen templates iterate with `|items`."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        new_calls = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            args = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    call = {**call, "function": {**function, "arguments": parsed}}
            new_calls.append(call)
        out.append({**message, "tool_calls": new_calls})
    return out

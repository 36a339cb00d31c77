"""Qwen XML tool calls in generated content:

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

The parser is all-or-nothing: any malformed block, text after the calls or a bad name turns the
whole output back into plain text. The streaming filter publishes content as soon as it cannot
begin a call and agrees byte for byte with the parser at the end."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.decoder import partial_marker_length

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_CLOSE = "</function>"
PARAMETER_CLOSE = "</parameter>"

OPENAI_NAME_LIMIT = 64
ANTHROPIC_NAME_LIMIT = 128

_FUNCTION_OPEN = re.compile(r"<function=([^>]*)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>]*)>")
_WHITESPACE = re.compile(r"\s*")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(8)}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)

    @property
    def arguments_json(self) -> str:
        """The arguments as the JSON-object string OpenAI's `function.arguments` carries."""
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(slots=True)
class ParsedOutput:
    """`content` is the text before the first call (trailing whitespace trimmed) when there are
    calls, else the whole output unchanged."""

    content: str
    tool_calls: list[ToolCall]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parameter_value(text: str) -> Any:
    """A parameter's trimmed text as JSON when it parses as JSON, else as the string itself."""
    value = text.strip()
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError:
        return value


def _valid_name(name: str, limit: int) -> bool:
    return 0 < len(name) <= limit and not any(c.isspace() for c in name)


def _skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _parse_block(block: str, name_limit: int) -> ToolCall | None:
    """One `<tool_call>` body: exactly one function holding only parameters."""
    block = block.strip()
    function = _FUNCTION_OPEN.match(block)
    if function is None or not block.endswith(FUNCTION_CLOSE):
        return None
    name = function.group(1)
    if not _valid_name(name, name_limit):
        return None
    body = block[function.end() : len(block) - len(FUNCTION_CLOSE)]
    arguments: dict[str, Any] = {}
    pos = _skip_whitespace(body, 0)
    while pos < len(body):
        parameter = _PARAMETER_OPEN.match(body, pos)
        if parameter is None:
            return None
        key = parameter.group(1)
        close = body.find(PARAMETER_CLOSE, parameter.end())
        if not key or key in arguments or close < 0:
            return None
        arguments[key] = parameter_value(body[parameter.end() : close])
        pos = _skip_whitespace(body, close + len(PARAMETER_CLOSE))
    return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str, name_limit: int = OPENAI_NAME_LIMIT) -> ParsedOutput:
    """Splits a complete output into content and tool calls (all or nothing)."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedOutput(text, [])
    calls: list[ToolCall] = []
    pos = start
    while pos < len(text):
        if not text.startswith(TOOL_CALL_OPEN, pos):
            return ParsedOutput(text, [])
        close = text.find(TOOL_CALL_CLOSE, pos)
        call = (
            None if close < 0 else _parse_block(text[pos + len(TOOL_CALL_OPEN) : close], name_limit)
        )
        if call is None:
            return ParsedOutput(text, [])
        calls.append(call)
        pos = _skip_whitespace(text, close + len(TOOL_CALL_CLOSE))
    return ParsedOutput(text[:start].rstrip(), calls)


class ToolCallStreamFilter:
    """Streams content while holding back what may be a tool-call region.

    `push` returns the text that provably cannot start `<tool_call>`: a trailing partial marker
    and the whitespace before it (or trailing whitespace alone) wait for more text, and from a
    complete marker on everything waits for `finish`. `finish` parses the whole output: valid
    calls are returned and their region (with the whitespace before it) is never published; a
    malformed region, or held plain text, is returned unchanged so the concatenation of
    everything published is exactly the parser's `content`.
    """

    def __init__(self, name_limit: int = OPENAI_NAME_LIMIT) -> None:
        self._name_limit = name_limit
        self._text = ""
        self._published = 0
        self._in_region = False

    def push(self, text: str) -> str:
        self._text += text
        if self._in_region:
            return ""
        tail = self._text[self._published :]
        marker = tail.find(TOOL_CALL_OPEN)
        if marker >= 0:
            self._in_region = True
            cut = len(tail[:marker].rstrip())
        else:
            cut = len(tail) - partial_marker_length(tail, (TOOL_CALL_OPEN,))
            cut = len(tail[:cut].rstrip())
        self._published += cut
        return tail[:cut]

    def finish(self) -> tuple[str, ParsedOutput]:
        """(the rest of the content to publish, the parsed output)."""
        parsed = parse_tool_calls(self._text, self._name_limit)
        rest = "" if parsed.tool_calls else self._text[self._published :]
        self._published = len(self._text)
        return rest, parsed

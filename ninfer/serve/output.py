"""The protocol-neutral output stream: engine `TokenEvent`s in, `TextDelta`s and one final
`Completion` out, with Qwen XML tool calls parsed from the content channel.

While tools are offered, content passes through chat/tool_calls.py's streaming filter, which
holds back anything that could still start a `<tool_call>` block; at the end the whole content is
parsed once, and either the tool region is dropped (valid calls) or the held-back text is flushed
byte-exact (plain text).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ninfer.chat.tool_calls import ToolCall, ToolCallStreamFilter
from ninfer.engine.request import TokenEvent, Usage
from ninfer.serve.errors import generation_failed, no_result


@dataclass(slots=True)
class TextDelta:
    channel: str  # reasoning | content
    text: str


@dataclass(slots=True)
class Completion:
    """The whole output. `finish_reason`: stop | length | tool_calls | abort."""

    reasoning: str
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    stop_reason: str | int | None
    usage: Usage
    timings: dict[str, float] = field(default_factory=dict)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(8)}"


async def output_stream(
    events: AsyncIterator[TokenEvent], *, tools_active: bool, tool_name_max: int
) -> AsyncIterator[TextDelta | Completion]:
    reasoning: list[str] = []
    content: list[str] = []
    held = ToolCallStreamFilter(tool_name_max) if tools_active else None
    last: TokenEvent | None = None
    async for event in events:
        if event.reasoning:
            reasoning.append(event.reasoning)
            yield TextDelta("reasoning", event.reasoning)
        if event.content:
            content.append(event.content)
            text = held.push(event.content) if held is not None else event.content
            if text:
                yield TextDelta("content", text)
        if event.finish_reason is not None:
            last = event
            break
    if last is None:
        raise no_result()
    if last.finish_reason == "error":
        if isinstance(last.error, Exception):
            raise last.error
        raise generation_failed(last.error)
    text = "".join(content)
    calls: list[ToolCall] = []
    if held is not None:
        rest, parsed = held.finish()
        if rest:
            yield TextDelta("content", rest)
        text, calls = parsed.content, parsed.tool_calls
    finish = last.finish_reason
    if calls:
        finish = "tool_calls"
    timings = {}
    if last.timings is not None:
        t = last.timings
        timings = {
            "queue": t.queue,
            "prefill": t.prefill,
            "ttft": t.ttft,
            "decode": t.decode,
            "total": t.total,
        }
    yield Completion(
        reasoning="".join(reasoning),
        content=text,
        tool_calls=calls,
        finish_reason=finish,
        stop_reason=last.stop_reason,
        usage=last.usage or Usage(),
        timings=timings,
    )

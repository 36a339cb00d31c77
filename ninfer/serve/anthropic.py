"""Anthropic Messages: request validation into `ChatRequest`, and the output stream back into a
`message` body or the `message_start ... message_stop` SSE sequence. `model` is only a label:
it is echoed back and never checked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ninfer.chat.tool_calls import ToolCall
from ninfer.serve.errors import invalid, sse_error_event, to_api_error
from ninfer.serve.output import Completion, TextDelta, new_id
from ninfer.serve.request import (
    ANTHROPIC_TOOL_NAME_MAX,
    ChatRequest,
    Message,
    ModelInfo,
    Tool,
    check_tool_name,
    check_unique_tools,
    get_bool,
    get_int,
    get_str,
    parse_stop,
    require_object,
    sampling_from,
)

EFFORTS = ("low", "medium", "high", "xhigh", "max")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}


def parse_messages_request(body: Any, info: ModelInfo) -> ChatRequest:
    body = require_object(body)
    model = get_str(body, "model", required=True)
    max_tokens = get_int(body, "max_tokens", 1)
    tools = _parse_tools(body.get("tools"))
    tool_choice, tool_choice_name = _parse_tool_choice(body.get("tool_choice"), tools)
    messages = _system_prefix(body.get("system")) + _parse_messages(body.get("messages"))

    thinking = body.get("thinking")
    enable: bool | None = None
    if thinking is not None:
        if not isinstance(thinking, dict):
            raise invalid("'thinking' must be an object", param="thinking")
        # Any type other than "disabled" (including ones this server does not know) means on.
        enable = thinking.get("type") != "disabled"
    effort = None
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise invalid("'output_config' must be an object", param="output_config")
        for key in config:
            if key != "effort":
                raise invalid(
                    f"output_config.{key} is not supported",
                    "parameter_not_supported",
                    f"output_config.{key}",
                )
        effort = config.get("effort")
        if effort is not None and effort not in EFFORTS:
            raise invalid(
                f"output_config.effort must be one of {', '.join(EFFORTS)}",
                param="output_config.effort",
            )
    enabled, effort = info.resolve_thinking(enable, effort, effort_param="output_config.effort")
    preserve = get_bool(body, "preserve_thinking")
    return ChatRequest(
        protocol="anthropic",
        model=model,
        messages=messages,
        max_tokens=max_tokens if max_tokens is not None else info.default_max_tokens,
        max_tokens_defaulted=max_tokens is None,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_name=tool_choice_name,
        sampling=sampling_from(body, min_p=False),
        stop=parse_stop(body.get("stop_sequences"), "stop_sequences"),
        stream=bool(get_bool(body, "stream")),
        enable_thinking=enabled,
        reasoning_effort=effort,
        preserve_thinking=info.preserve_thinking_default if preserve is None else preserve,
        tool_name_max=ANTHROPIC_TOOL_NAME_MAX,
        continue_final=_is_prefill(messages),
    )


def _is_prefill(messages: list[Message]) -> bool:
    """Whether the conversation ends with assistant text the reply continues, as Anthropic's
    API does with such a last turn (a prefill)."""
    last = messages[-1] if messages else None
    return (
        last is not None
        and last.role == "assistant"
        and not last.tool_calls
        and bool(last.content.strip())
    )


def _text_blocks(value: Any, param: str) -> str:
    """A string or a list of text blocks, joined with newlines."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a string or a list of text blocks", param=param)
    texts = []
    for i, block in enumerate(value):
        if (
            isinstance(block, dict)
            and block.get("type") == "text"
            and isinstance(block.get("text"), str)
        ):
            texts.append(block["text"])
        elif isinstance(block, dict) and block.get("type") == "image":
            raise invalid(
                "image inputs need a vision-enabled model; this server has none",
                "vision_disabled",
                f"{param}[{i}]",
            )
        else:
            raise invalid(f"'{param}[{i}]' must be a text block", param=f"{param}[{i}]")
    return "\n".join(texts)


def _system_prefix(system: Any) -> list[Message]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [Message("system", text)]


def _parse_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", param="messages")
    out: list[Message] = []
    roles: list[str] = []  # per input message: user | assistant | system
    for i, raw in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        role = raw.get("role")
        content = raw.get("content")
        if role == "system":
            out.append(Message("system", _text_blocks(content, f"{param}.content")))
        elif role == "user":
            out.extend(_user_turn(content, f"{param}.content"))
        elif role == "assistant":
            out.append(_assistant_turn(content, f"{param}.content"))
        else:
            raise invalid(
                f"'{param}.role' {role!r} is not supported (user, assistant, system)",
                "unsupported_role",
                f"{param}.role",
            )
        roles.append(role)
    _check_system_placement(roles)
    return out


def _check_system_placement(roles: list[str]) -> None:
    """A run of mid-array system messages must follow a user turn (tool results are user turns)
    and be last or come right before an assistant turn."""
    i = 0
    while i < len(roles):
        if roles[i] != "system":
            i += 1
            continue
        j = i
        while j < len(roles) and roles[j] == "system":
            j += 1
        before = roles[i - 1] if i > 0 else None
        after = roles[j] if j < len(roles) else None
        if before != "user" or after not in (None, "assistant"):
            raise invalid(
                f"messages[{i}]: a system message must follow a user turn and come last or "
                "right before an assistant turn",
                "invalid_message_order",
                f"messages[{i}]",
            )
        i = j


def _user_turn(content: Any, param: str) -> list[Message]:
    """A user message; each tool_result block becomes a tool message in place."""
    if isinstance(content, str):
        return [Message("user", content)]
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or a list of blocks", param=param)
    out: list[Message] = []
    texts: list[str] = []
    for i, block in enumerate(content):
        p = f"{param}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string_field(block, "text", p))
        elif kind == "tool_result":
            if texts:
                out.append(Message("user", "\n".join(texts)))
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(
                    f"'{p}.tool_use_id' must be a non-empty string", param=f"{p}.tool_use_id"
                )
            result = block.get("content", "")
            text = _text_blocks(result, f"{p}.content") if result is not None else ""
            out.append(Message("tool", text, tool_call_id=call_id))
        elif kind == "image":
            raise invalid(
                "image inputs need a vision-enabled model; this server has none",
                "vision_disabled",
                p,
            )
        elif kind == "document":
            raise invalid("document inputs are not supported", "file_inputs_not_supported", p)
        else:
            raise invalid(f"'{p}' has an unsupported block type {kind!r}", param=p)
    if texts or not out:
        out.append(Message("user", "\n".join(texts)))
    return out


def _string_field(block: dict, key: str, param: str) -> str:
    """A block's string field `key` (a text block's text, a thinking block's thinking)."""
    value = block.get(key)
    if not isinstance(value, str):
        raise invalid(f"'{param}.{key}' must be a string", param=f"{param}.{key}")
    return value


def _assistant_turn(content: Any, param: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or a list of blocks", param=param)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(content):
        p = f"{param}[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string_field(block, "text", p))
        elif kind == "thinking":
            reasoning.append(_string_field(block, "thinking", p))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not call_id:
                raise invalid(f"'{p}.id' must be a non-empty string", param=f"{p}.id")
            if not isinstance(name, str) or not name:
                raise invalid(f"'{p}.name' must be a non-empty string", param=f"{p}.name")
            if not isinstance(args, dict):
                raise invalid(f"'{p}.input' must be an object", param=f"{p}.input")
            calls.append(ToolCall(name=name, arguments=args, id=call_id))
        else:
            raise invalid(f"'{p}' has an unsupported block type {kind!r}", param=p)
    return Message(
        "assistant", "\n".join(texts), reasoning="\n".join(reasoning) or None, tool_calls=calls
    )


def _parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", param="tools")
    tools = []
    for i, item in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        kind = item.get("type")
        schema = item.get("input_schema")
        if kind not in (None, "custom") or not isinstance(schema, dict):
            raise invalid(
                f"{param}: only client tools with an 'input_schema' are supported",
                "tool_type_not_supported",
                param,
            )
        name = check_tool_name(item.get("name"), ANTHROPIC_TOOL_NAME_MAX, f"{param}.name")
        tools.append(Tool(name, get_str(item, "description"), schema, strict=False))
    return check_unique_tools(tools)


def _parse_tool_choice(value: Any, tools: list[Tool]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if not isinstance(value, dict) or value.get("type") not in TOOL_CHOICES:
        raise invalid("'tool_choice.type' must be auto, any, none or tool", param="tool_choice")
    choice = TOOL_CHOICES[value["type"]]
    name = None
    if choice == "function":
        name = value.get("name")
        if not isinstance(name, str):
            raise invalid("tool_choice of type 'tool' needs a string 'name'", param="tool_choice")
        if not any(t.name == name for t in tools):
            raise invalid(
                f"tool_choice names {name!r}, which is not in 'tools'", param="tool_choice"
            )
    elif choice == "required" and not tools:
        raise invalid("tool_choice 'any' requires 'tools'", param="tool_choice")
    return choice, name


# ---- responses ----------------------------------------------------------------------------


def _stop_reason(completion: Completion) -> str:
    if completion.finish_reason == "tool_calls":
        return "tool_use"
    if completion.finish_reason == "length":
        return "max_tokens"
    if _stop_sequence(completion) is not None:
        return "stop_sequence"
    return "end_turn"


def _stop_sequence(completion: Completion) -> str | None:
    """The stop sequence that ended the reply (a stop token ends a turn instead)."""
    stop = completion.stop_reason
    return stop if completion.finish_reason == "stop" and isinstance(stop, str) else None


def _content_blocks(completion: Completion) -> list[dict]:
    blocks: list[dict] = []
    if completion.reasoning:
        blocks.append({"type": "thinking", "thinking": completion.reasoning, "signature": ""})
    if completion.content or not (completion.tool_calls or completion.reasoning):
        # an empty text block only where there would be no block at all: one beside thinking
        # (a limit hit while thinking) is one the Messages API refuses when sent back
        blocks.append({"type": "text", "text": completion.content})
    for call in completion.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        )
    return blocks


def message_body(completion: Completion, *, message_id: str, model: str) -> dict:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content_blocks(completion),
        "stop_reason": _stop_reason(completion),
        "stop_sequence": _stop_sequence(completion),
        "usage": {
            "input_tokens": completion.usage.prompt_tokens,
            "output_tokens": completion.usage.completion_tokens,
        },
    }


def new_message_id() -> str:
    return new_id("msg_")


def _event(kind: str, data: dict) -> bytes:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


async def messages_sse(
    outputs: AsyncIterator[TextDelta | Completion],
    *,
    message_id: str,
    model: str,
    input_tokens: int,
    on_complete: Any = None,
    on_error: Any = None,
) -> AsyncIterator[bytes]:
    """message_start, one block per channel run (thinking, text), one per tool_use,
    message_delta, message_stop. No ping events."""
    yield _event(
        "message_start",
        {
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            }
        },
    )
    index = 0
    open_kind: str | None = None  # thinking | text
    wrote_text = False
    try:
        async for item in outputs:
            if isinstance(item, TextDelta):
                kind = "thinking" if item.channel == "reasoning" else "text"
                if open_kind != kind:
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                        index += 1
                    start = (
                        {"type": "thinking", "thinking": "", "signature": ""}
                        if kind == "thinking"
                        else {"type": "text", "text": ""}
                    )
                    yield _event("content_block_start", {"index": index, "content_block": start})
                    open_kind = kind
                wrote_text = wrote_text or kind == "text"
                delta = (
                    {"type": "thinking_delta", "thinking": item.text}
                    if kind == "thinking"
                    else {"type": "text_delta", "text": item.text}
                )
                yield _event("content_block_delta", {"index": index, "delta": delta})
                continue
            if open_kind is not None:
                yield _event("content_block_stop", {"index": index})
                index += 1
                open_kind = None
            if not (wrote_text or item.tool_calls or item.reasoning):  # as `_content_blocks`
                yield _event(
                    "content_block_start",
                    {"index": index, "content_block": {"type": "text", "text": ""}},
                )
                yield _event("content_block_stop", {"index": index})
                index += 1
            for call in item.tool_calls:
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
                yield _event(
                    "content_block_delta",
                    {
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments_json},
                    },
                )
                yield _event("content_block_stop", {"index": index})
                index += 1
            yield _event(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": _stop_reason(item),
                        "stop_sequence": _stop_sequence(item),
                    },
                    "usage": {"output_tokens": item.usage.completion_tokens},
                },
            )
            yield _event("message_stop", {})
            if on_complete is not None:
                on_complete(item)
    except Exception as exc:  # reported in-band: the status line has already been sent
        err = to_api_error(exc)
        if on_error is not None:
            on_error(err)
        yield sse_error_event(err, anthropic=True)

"""OpenAI Chat Completions: request validation into `ChatRequest`, and the output stream back
into a `chat.completion` body or the `chat.completion.chunk` SSE sequence."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ninfer.chat.tool_calls import ToolCall
from ninfer.serve.errors import invalid, sse_error_event, to_api_error
from ninfer.serve.output import Completion, TextDelta, new_id
from ninfer.serve.request import (
    CHAT_EFFORTS,
    OPENAI_TOOL_NAME_MAX,
    ChatRequest,
    Message,
    ModelInfo,
    Tool,
    check_model,
    check_tool_name,
    check_unique_tools,
    get_bool,
    get_int,
    get_str,
    parse_json_object_text,
    parse_stop,
    require_object,
    sampling_from,
)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_CHOICES = ("none", "auto", "required")
TEMPLATE_KWARGS = ("preserve_thinking", "enable_thinking")


def parse_chat_request(body: Any, info: ModelInfo) -> ChatRequest:
    body = require_object(body)
    model = get_str(body, "model", required=True)
    check_model(info, model)
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise invalid(
            "'functions' and 'function_call' are not supported; use 'tools'",
            "tools_not_supported",
            "functions",
        )
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid(
            "structured output (response_format json_object / json_schema) is not supported; "
            "only {'type': 'text'} is accepted",
            "response_format_not_supported",
            "response_format",
        )
    n = get_int(body, "n")
    if n is not None and n != 1:
        raise invalid("only n = 1 is supported", "n_not_supported", "n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise invalid("logprobs are not supported", "logprobs_not_supported", "logprobs")

    tools = _parse_tools(body.get("tools"))
    tool_choice, tool_choice_name = _parse_tool_choice(body.get("tool_choice"), tools)
    messages = _parse_messages(body.get("messages"))

    max_tokens = get_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", 1)
    defaulted = max_tokens is None
    stream = bool(get_bool(body, "stream"))
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise invalid("'stream_options' must be an object", param="stream_options")
        include_usage = bool(get_bool(options, "include_usage"))

    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for key, value in kwargs.items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise invalid(
                f"chat_template_kwargs.{key} is not supported",
                "chat_template_option_not_supported",
                f"chat_template_kwargs.{key}",
            )
    preserve = _agreeing_bool(body, kwargs, "preserve_thinking")
    enable = _agreeing_bool(body, kwargs, "enable_thinking")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in CHAT_EFFORTS:
        raise invalid(
            f"'reasoning_effort' must be one of {', '.join(CHAT_EFFORTS)}",
            param="reasoning_effort",
        )
    thinking, effort = info.resolve_thinking(enable, effort, effort_param="reasoning_effort")

    logit_bias = None
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("'logit_bias' must be an object", param="logit_bias")
        try:
            logit_bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise invalid("'logit_bias' maps token ids to numbers", param="logit_bias") from None
        if any(k < 0 or not -100.0 <= v <= 100.0 for k, v in logit_bias.items()):
            raise invalid(
                "'logit_bias' maps non-negative token ids to values in [-100, 100]",
                param="logit_bias",
            )
    return ChatRequest(
        protocol="chat",
        model=model,
        messages=messages,
        max_tokens=max_tokens if max_tokens is not None else info.default_max_tokens,
        max_tokens_defaulted=defaulted,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_name=tool_choice_name,
        sampling=sampling_from(body),
        logit_bias=logit_bias,
        stop=parse_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
        enable_thinking=thinking,
        reasoning_effort=effort,
        preserve_thinking=info.preserve_thinking_default if preserve is None else preserve,
        tool_name_max=OPENAI_TOOL_NAME_MAX,
    )


def _agreeing_bool(body: dict, kwargs: dict, key: str) -> bool | None:
    """A template option given top-level, in chat_template_kwargs, or both (then equal)."""
    top = get_bool(body, key)
    nested = get_bool(kwargs, key)
    if top is not None and nested is not None and top != nested:
        raise invalid(
            f"'{key}' and 'chat_template_kwargs.{key}' disagree",
            "conflicting_template_option",
            key,
        )
    return top if top is not None else nested


def _parse_tools(value: Any) -> list[Tool]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", param="tools")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        if item.get("type") != "function":
            raise invalid(
                f"{param}: only tools of type 'function' are supported",
                "tool_type_not_supported",
                f"{param}.type",
            )
        function = item.get("function")
        if not isinstance(function, dict):
            raise invalid(f"'{param}.function' must be an object", param=f"{param}.function")
        name = check_tool_name(function.get("name"), OPENAI_TOOL_NAME_MAX, f"{param}.function.name")
        description = get_str(function, "description")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        elif not isinstance(parameters, dict):
            raise invalid(f"'{param}.function.parameters' must be an object", param=param)
        strict = bool(get_bool(function, "strict"))
        tools.append(Tool(name, description, parameters, strict))
    return check_unique_tools(tools)


def _parse_tool_choice(value: Any, tools: list[Tool]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise invalid(
                "'tool_choice' must be none, auto, required or a function", param="tool_choice"
            )
        choice, name = value, None
    elif (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        choice, name = "function", value["function"]["name"]
        if not any(t.name == name for t in tools):
            raise invalid(
                f"tool_choice names '{name}', which is not in 'tools'", param="tool_choice"
            )
    else:
        raise invalid("'tool_choice' has an invalid form", param="tool_choice")
    if choice != "none" and not tools and value != "auto":
        raise invalid(f"tool_choice '{choice}' requires 'tools'", param="tool_choice")
    return choice, name


def _content_text(content: Any, param: str) -> str:
    """A string or a list of parts; text parts are joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or a list of parts", param=param)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "video_url"):
            raise invalid(
                "image and video inputs need a vision-enabled model; this server has none",
                "vision_disabled",
                f"{param}[{i}]",
            )
        elif kind == "input_audio":
            raise invalid("audio input is not supported", "modality_not_supported", f"{param}[{i}]")
        elif kind == "file":
            raise invalid(
                "file inputs are not supported", "file_inputs_not_supported", f"{param}[{i}]"
            )
        else:
            raise invalid(f"'{param}[{i}]' is not a valid content part", param=f"{param}[{i}]")
    return "\n".join(texts)


def _parse_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", param="messages")
    messages: list[Message] = []
    for i, raw in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        role = raw.get("role")
        if role == "tool":
            call_id = raw.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid(
                    f"'{param}.tool_call_id' must be a non-empty string",
                    param=f"{param}.tool_call_id",
                )
            text = _content_text(raw.get("content"), f"{param}.content")
            messages.append(Message("tool", text, tool_call_id=call_id))
            continue
        if role not in ROLES:
            raise invalid(
                f"'{param}.role' {role!r} is not supported (system, developer, user, assistant, tool)",
                "unsupported_role",
                f"{param}.role",
            )
        if raw.get("tool_call_id") is not None:
            raise invalid(
                "'tool_call_id' is only valid on tool messages", param=f"{param}.tool_call_id"
            )
        if raw.get("tool_calls") is not None and role != "assistant":
            raise invalid(
                "'tool_calls' is only valid on assistant messages", param=f"{param}.tool_calls"
            )
        content = raw.get("content")
        if role != "assistant":
            if content is None:
                raise invalid(f"'{param}.content' is required", param=f"{param}.content")
            messages.append(Message(ROLES[role], _content_text(content, f"{param}.content")))
            continue
        calls = _parse_tool_calls(raw.get("tool_calls"), f"{param}.tool_calls")
        if content is None and not calls:
            raise invalid(f"'{param}' needs 'content' or 'tool_calls'", param=f"{param}.content")
        text = "" if content is None else _content_text(content, f"{param}.content")
        reasoning = get_str(raw, "reasoning_content")
        messages.append(Message("assistant", text, reasoning=reasoning, tool_calls=calls))
    return messages


def _parse_tool_calls(value: Any, param: str) -> list[ToolCall]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a list", param=param)
    calls = []
    for i, raw in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            raise invalid(f"'{p}.id' must be a non-empty string", param=f"{p}.id")
        if raw.get("type", "function") != "function":
            raise invalid(f"'{p}.type' must be 'function'", "tool_type_not_supported", f"{p}.type")
        function = raw.get("function")
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise invalid(
                f"'{p}.function.name' must be a non-empty string", param=f"{p}.function.name"
            )
        arguments = parse_json_object_text(function.get("arguments"), f"{p}.function.arguments")
        calls.append(ToolCall(name=function["name"], arguments=arguments, id=raw["id"]))
    return calls


# ---- responses ----------------------------------------------------------------------------


def _finish_reason(completion: Completion) -> str:
    if completion.finish_reason in ("tool_calls", "length"):
        return completion.finish_reason
    return "stop"


def _wire_tool_calls(calls: list[ToolCall], indexed: bool) -> list[dict]:
    out = []
    for i, call in enumerate(calls):
        item: dict[str, Any] = {"index": i} if indexed else {}
        item.update(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
        )
        out.append(item)
    return out


def _usage(completion: Completion) -> dict:
    u = completion.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def chat_completion_body(
    completion: Completion, *, completion_id: str, model: str, created: int
) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        message["content"] = completion.content or None
        message["tool_calls"] = _wire_tool_calls(completion.tool_calls, indexed=False)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(completion)}],
        "usage": _usage(completion),
    }


def new_completion_id() -> str:
    return new_id("chatcmpl-")


async def chat_sse(
    outputs: AsyncIterator[TextDelta | Completion],
    *,
    completion_id: str,
    model: str,
    include_usage: bool,
    on_complete: Any = None,
    on_error: Any = None,
) -> AsyncIterator[bytes]:
    """The `chat.completion.chunk` frames, ending with `data: [DONE]`.

    `on_complete(completion)` and `on_error(api_error)` let the caller log and count."""
    created = int(time.time())

    def chunk(delta: dict | None, finish: str | None = None, usage: dict | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        if include_usage:
            obj["usage"] = usage
        return (
            b"data: "
            + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
            + b"\n\n"
        )

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for item in outputs:
            if isinstance(item, TextDelta):
                key = "reasoning_content" if item.channel == "reasoning" else "content"
                yield chunk({key: item.text})
                continue
            if item.tool_calls:
                yield chunk({"tool_calls": _wire_tool_calls(item.tool_calls, indexed=True)})
            yield chunk({}, _finish_reason(item))
            if include_usage:
                yield chunk(None, usage=_usage(item))
            if on_complete is not None:
                on_complete(item)
    except Exception as exc:  # reported in-band: the status line has already been sent
        err = to_api_error(exc)
        if on_error is not None:
            on_error(err)
        yield sse_error_event(err, anthropic=False)
        return
    yield b"data: [DONE]\n\n"


def model_list(info: ModelInfo) -> dict:
    return {"object": "list", "data": [model_card(info)]}


def model_card(info: ModelInfo) -> dict:
    return {"id": info.model_id, "object": "model", "created": info.created, "owned_by": "ninfer"}

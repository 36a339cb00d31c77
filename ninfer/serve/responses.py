"""OpenAI Responses (core): request validation into `ChatRequest` plus the conversation Items,
the `response` envelope, and the SSE sequence with contiguous `sequence_number`s.

Fields that this server cannot honour are rejected with a specific code rather than ignored;
fields that accept only their trivial value (e.g. `background: false`) are checked for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.presets import SamplingFields
from ninfer.chat.tool_calls import ToolCall
from ninfer.serve.errors import (
    PROMPT_PARAMS,
    ApiError,
    invalid,
    response_not_found,
    to_api_error,
)
from ninfer.serve.output import Completion, TextDelta, new_id
from ninfer.serve.request import (
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
    get_number,
    get_str,
    parse_json_object_text,
    require_object,
)
from ninfer.serve.response_store import ResponseStore, StoredResponse

MIN_OUTPUT_TOKENS = 16
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
KNOWN_KEYS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "max_output_tokens",
        "stream",
        "store",
        "temperature",
        "top_p",
        "metadata",
        "reasoning",
        "preserve_thinking",
        "chat_template_kwargs",
        "text",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "truncation",
        "top_logprobs",
        "service_tier",
        "background",
        "include",
        "stream_options",
    }
)
MESSAGE_ROLES = {
    "user": "user",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


@dataclass(slots=True)
class ResponsesCall:
    """A validated create request: the internal request plus what the envelope echoes and what
    the store keeps."""

    chat: ChatRequest
    response_id: str
    input_items: list[dict]  # previous context + this input, with ids
    instructions: str | None
    previous_response_id: str | None
    store: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    effort: str | None
    wire_tools: list[dict] = field(default_factory=list)
    tool_choice: str = "auto"
    created_at: int = field(default_factory=lambda: int(time.time()))


def _trivial(body: dict, key: str, ok: Callable[[Any], bool], code: str, what: str) -> None:
    if key in body and body[key] is not None and not ok(body[key]):
        raise invalid(f"'{key}' {what}", code, key)


def parse_responses_request(body: Any, info: ModelInfo, store: ResponseStore) -> ResponsesCall:
    body = require_object(body)
    for key in body:
        if key not in KNOWN_KEYS:
            raise invalid(f"unknown parameter '{key}'", "unknown_parameter", key)
    model = get_str(body, "model", required=True)
    check_model(info, model)
    _check_trivial_fields(body)

    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("'text' must be an object", param="text")
        for key, value in text.items():
            if key == "format":
                if value is not None and value != {"type": "text"}:
                    raise invalid(
                        "structured outputs (text.format json_schema / json_object) are not "
                        "supported; only {'type': 'text'} is accepted",
                        "structured_outputs_not_supported",
                        "text.format",
                    )
            elif value is not None:
                raise invalid(
                    f"text.{key} is not supported", "text_option_not_supported", f"text.{key}"
                )

    tools, wire_tools = _parse_tools(body.get("tools"))
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice not in ("auto", "none"):
        raise invalid(
            "only tool_choice 'auto' and 'none' are supported",
            "tool_choice_not_supported",
            "tool_choice",
        )

    max_output = get_int(body, "max_output_tokens")
    if max_output is not None and max_output < MIN_OUTPUT_TOKENS:
        raise invalid(
            f"'max_output_tokens' must be at least {MIN_OUTPUT_TOKENS}, got {max_output}",
            param="max_output_tokens",
        )
    metadata = _parse_metadata(body.get("metadata"))
    stored = get_bool(body, "store")

    effort = None
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise invalid("'reasoning' must be an object", param="reasoning")
        for key, value in reasoning.items():
            if key == "summary" or key == "generate_summary":
                if value is not None:
                    raise invalid(
                        "reasoning summaries are not supported",
                        "reasoning_summary_not_supported",
                        f"reasoning.{key}",
                    )
            elif key != "effort":
                raise invalid(
                    f"reasoning.{key} is not supported", "unknown_parameter", f"reasoning.{key}"
                )
        effort = reasoning.get("effort")
        if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
            raise invalid(
                f"'reasoning.effort' must be one of {', '.join(EFFORTS)}",
                param="reasoning.effort",
            )
    enabled, template_effort = info.resolve_thinking(None, effort, effort_param="reasoning.effort")

    preserve = _parse_preserve(body)
    previous_id = get_str(body, "previous_response_id")
    context: list[dict] = []
    if previous_id is not None:
        parent = store.get(previous_id)
        if parent is None:
            raise response_not_found(
                f"previous response '{previous_id}' was not found (never stored, deleted or evicted)",
                param="previous_response_id",
            )
        context = parent.context_items()
        if preserve is None:
            preserve = parent.preserve_thinking
    items = context + _parse_input(body.get("input"), known_ids={i.get("id") for i in context})

    temperature = get_number(body, "temperature", 0.0, 2.0)
    top_p = get_number(body, "top_p", 0.0, 1.0)
    instructions = get_str(body, "instructions")
    messages = items_to_messages(items)
    if instructions:
        messages.insert(0, Message("system", instructions))
    chat = ChatRequest(
        protocol="responses",
        model=model,
        messages=messages,
        max_tokens=max_output if max_output is not None else info.default_max_tokens,
        max_tokens_defaulted=max_output is None,
        tools=tools,
        tool_choice=tool_choice,
        sampling=SamplingFields(temperature=temperature, top_p=top_p),
        stream=bool(get_bool(body, "stream")),
        enable_thinking=enabled,
        reasoning_effort=template_effort,
        preserve_thinking=info.preserve_thinking_default if preserve is None else preserve,
        tool_name_max=OPENAI_TOOL_NAME_MAX,
    )
    return ResponsesCall(
        chat=chat,
        response_id=new_id("resp_"),
        input_items=items,
        instructions=instructions,
        previous_response_id=previous_id,
        store=stored is not False,
        max_output_tokens=max_output,
        temperature=temperature,
        top_p=top_p,
        metadata=metadata,
        effort=effort,
        wire_tools=wire_tools,
        tool_choice=tool_choice,
    )


def _check_trivial_fields(body: dict) -> None:
    _trivial(
        body,
        "parallel_tool_calls",
        lambda v: v is True,
        "parallel_tool_calls_not_supported",
        "must be true",
    )
    _trivial(
        body,
        "truncation",
        lambda v: v == "disabled",
        "truncation_not_supported",
        "must be 'disabled'",
    )
    _trivial(body, "top_logprobs", lambda v: v == 0, "logprobs_not_supported", "must be 0")
    _trivial(
        body,
        "service_tier",
        lambda v: v in ("auto", "default"),
        "service_tier_not_supported",
        "must be 'auto' or 'default'",
    )
    _trivial(body, "background", lambda v: v is False, "background_not_supported", "must be false")
    _trivial(body, "include", lambda v: v == [], "include_not_supported", "must be empty")
    _trivial(
        body,
        "stream_options",
        lambda v: (
            isinstance(v, dict)
            and all(k == "include_obfuscation" and x is False for k, x in v.items())
        ),
        "stream_option_not_supported",
        "may only set include_obfuscation to false",
    )


def _parse_preserve(body: dict) -> bool | None:
    top = get_bool(body, "preserve_thinking")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise invalid("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for key, value in kwargs.items():
        if key != "preserve_thinking" and value is not None:
            raise invalid(
                f"chat_template_kwargs.{key} is not supported",
                "chat_template_option_not_supported",
                f"chat_template_kwargs.{key}",
            )
    nested = get_bool(kwargs, "preserve_thinking")
    if top is not None and nested is not None and top != nested:
        raise invalid(
            "'preserve_thinking' and 'chat_template_kwargs.preserve_thinking' disagree",
            "conflicting_template_option",
            "preserve_thinking",
        )
    return top if top is not None else nested


def _parse_metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16:
        raise invalid("'metadata' must be an object of at most 16 pairs", param="metadata")
    for key, item in value.items():
        if len(key) > 64 or not isinstance(item, str) or len(item) > 512:
            raise invalid(
                "metadata keys are at most 64 characters and values strings of at most 512",
                param="metadata",
            )
    return dict(value)


def _parse_tools(value: Any) -> tuple[list[Tool], list[dict]]:
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise invalid("'tools' must be a list", param="tools")
    tools, wire = [], []
    for i, item in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise invalid(
                f"{param}: only function tools are supported", "tool_type_not_supported", param
            )
        if item.get("strict") is True:
            raise invalid(
                f"{param}: strict tools are not supported",
                "strict_tools_not_supported",
                f"{param}.strict",
            )
        name = check_tool_name(item.get("name"), OPENAI_TOOL_NAME_MAX, f"{param}.name")
        parameters = item.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        elif not isinstance(parameters, dict):
            raise invalid(f"'{param}.parameters' must be an object", param=f"{param}.parameters")
        description = get_str(item, "description")
        tools.append(Tool(name, description, parameters))
        wire.append(
            {
                "type": "function",
                "name": name,
                "description": description,
                "parameters": parameters,
                "strict": False,
            }
        )
    return check_unique_tools(tools), wire


# ---- input Items -------------------------------------------------------------------------


def _parse_input(value: Any, known_ids: set) -> list[dict]:
    """Normalized Items with ids (supplied ids kept, missing ones generated, duplicates
    rejected)."""
    if isinstance(value, str):
        raw_items: list = [{"type": "message", "role": "user", "content": value}]
    elif isinstance(value, list) and value:
        raw_items = value
    else:
        raise invalid("'input' must be a string or a non-empty list of items", param="input")
    seen = {i for i in known_ids if i}
    items = []
    for i, raw in enumerate(raw_items):
        param = f"input[{i}]"
        if not isinstance(raw, dict):
            raise invalid(f"'{param}' must be an object", param=param)
        item = _parse_item(raw, param)
        if item["id"] in seen:
            raise invalid(f"'{param}.id' duplicates item id '{item['id']}'", param=f"{param}.id")
        seen.add(item["id"])
        items.append(item)
    return items


def _parse_item(raw: dict, param: str) -> dict:
    kind = raw.get("type", "message")
    item_id = raw.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not item_id):
        raise invalid(f"'{param}.id' must be a non-empty string", param=f"{param}.id")
    if raw.get("phase") is not None:
        raise invalid("item phases are not supported", "phase_not_supported", f"{param}.phase")
    if kind == "message":
        role = raw.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(
                f"'{param}.role' {role!r} is not supported (user, assistant, system, developer)",
                "unsupported_role",
                f"{param}.role",
            )
        parts = _parse_parts(raw.get("content"), role, f"{param}.content")
        item = {"id": item_id or new_id("msg_"), "type": "message", "role": role, "content": parts}
        if role == "assistant":
            item["status"] = "completed"
        return item
    if kind == "reasoning":
        if raw.get("encrypted_content") is not None:
            raise invalid(
                "encrypted reasoning is not supported",
                "encrypted_reasoning_not_supported",
                f"{param}.encrypted_content",
            )
        texts = []
        for part in raw.get("content") or []:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise invalid(f"'{param}.content' holds reasoning_text parts", param=param)
            texts.append(part["text"])
        return {
            "id": item_id or new_id("rs_"),
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": t} for t in texts],
        }
    if kind == "function_call":
        call_id, name = raw.get("call_id"), raw.get("name")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{param}.call_id' must be a non-empty string", param=f"{param}.call_id")
        if not isinstance(name, str) or not name:
            raise invalid(f"'{param}.name' must be a non-empty string", param=f"{param}.name")
        arguments = parse_json_object_text(raw.get("arguments"), f"{param}.arguments")
        return {
            "id": item_id or new_id("fc_"),
            "type": "function_call",
            "status": "completed",
            "call_id": call_id,
            "name": name,
            "arguments": json.dumps(arguments, ensure_ascii=False),
        }
    if kind == "function_call_output":
        call_id, output = raw.get("call_id"), raw.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{param}.call_id' must be a non-empty string", param=f"{param}.call_id")
        if not isinstance(output, str):  # or a list of parts, as message content is
            if not isinstance(output, list):
                raise invalid(
                    f"'{param}.output' must be a string or a list of parts", param=f"{param}.output"
                )
            output = _parse_parts(output, "tool", f"{param}.output")
        return {
            "id": item_id or new_id("fco_"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
        }
    raise invalid(
        f"item type {kind!r} is not supported", "item_type_not_supported", f"{param}.type"
    )


def _parse_parts(content: Any, role: str, param: str) -> list[dict]:
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": text_type, "text": content}]
    if not isinstance(content, list):
        raise invalid(f"'{param}' must be a string or a list of parts", param=param)
    parts = []
    for i, part in enumerate(content):
        p = f"{param}[{i}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": kind, "text": part["text"]})
        elif kind in ("input_image", "input_video"):
            raise invalid(
                "image and video inputs need a vision-enabled model; this server has none",
                "vision_disabled",
                p,
            )
        elif kind == "input_file":
            raise invalid("file inputs are not supported", "file_inputs_not_supported", p)
        else:
            raise invalid(f"'{p}' is not a supported content part", param=p)
    return parts


def items_to_messages(items: list[dict]) -> list[Message]:
    """Template messages: a reasoning Item attaches to the next assistant message or call
    (with none before the next other Item or the end, as in an output the limit cut while it
    reasoned, it is an assistant turn of its own); adjacent calls (and the assistant text
    before them) form one assistant turn; a call output becomes a tool turn."""
    messages: list[Message] = []
    reasoning: list[str] = []
    open_turn: Message | None = None  # assistant turn that may still take calls

    def reasoning_alone() -> None:
        nonlocal reasoning
        if reasoning:
            messages.append(Message("assistant", "", reasoning="\n".join(reasoning)))
            reasoning = []

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            reasoning.extend(part["text"] for part in item["content"])
            continue
        if kind == "message":
            text = "\n".join(part["text"] for part in item["content"])
            role = MESSAGE_ROLES[item["role"]]
            if role != "assistant":
                reasoning_alone()
            message = Message(role, text)
            if role == "assistant":
                message.reasoning = "\n".join(reasoning) or None
                reasoning = []
                open_turn = message
            else:
                open_turn = None
            messages.append(message)
            continue
        if kind == "function_call":
            call = ToolCall(
                name=item["name"], arguments=json.loads(item["arguments"]), id=item["call_id"]
            )
            if open_turn is None or reasoning:
                open_turn = Message("assistant", "", reasoning="\n".join(reasoning) or None)
                reasoning = []
                messages.append(open_turn)
            open_turn.tool_calls.append(call)
            continue
        reasoning_alone()
        open_turn = None
        output = item["output"]
        if not isinstance(output, str):
            output = "\n".join(part["text"] for part in output)
        messages.append(Message("tool", output, tool_call_id=item["call_id"]))
    reasoning_alone()
    return messages


# ---- output ------------------------------------------------------------------------------


@dataclass(slots=True)
class OutputIds:
    """Item ids fixed when the request starts, so stream and stored body agree."""

    reasoning: str = field(default_factory=lambda: new_id("rs_"))
    message: str = field(default_factory=lambda: new_id("msg_"))


def _status(completion: Completion | None) -> str:
    if completion is None:
        return "in_progress"
    if completion.finish_reason == "length":
        return "incomplete"
    if completion.finish_reason == "abort":
        return "cancelled"
    return "completed"


def reasoning_item(item_id: str, text: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call: ToolCall, item_id: str, status: str = "completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments_json,
    }


def output_items(completion: Completion, ids: OutputIds, call_ids: list[str]) -> list[dict]:
    status = "incomplete" if completion.finish_reason == "length" else "completed"
    items = []
    if completion.reasoning:
        items.append(reasoning_item(ids.reasoning, completion.reasoning))
    if completion.content or not (completion.tool_calls or completion.reasoning):
        # an empty message only where there would be no item at all (a limit hit while
        # reasoning leaves the reasoning alone, as OpenAI's incomplete responses do)
        items.append(message_item(ids.message, completion.content, status))
    for call, item_id in zip(completion.tool_calls, call_ids):
        items.append(call_item(call, item_id))
    return items


def response_body(
    call: ResponsesCall,
    *,
    status: str,
    output: list[dict],
    completion: Completion | None = None,
    error: ApiError | None = None,
) -> dict:
    usage = None
    if completion is not None:
        u = completion.usage
        usage = {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens,
        }
    return {
        "id": call.response_id,
        "object": "response",
        "created_at": call.created_at,
        "status": status,
        "error": None
        if error is None
        else {"code": error.code or "server_error", "message": error.message},
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": call.instructions,
        "max_output_tokens": call.max_output_tokens,
        "model": call.chat.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": call.previous_response_id,
        "reasoning": {"effort": call.effort, "summary": None},
        "service_tier": "default",
        "store": call.store,
        "temperature": call.temperature,
        "text": {"format": {"type": "text"}},
        "tool_choice": call.tool_choice,
        "tools": call.wire_tools,
        "top_p": call.top_p,
        "truncation": "disabled",
        "usage": usage,
        "metadata": call.metadata,
    }


def finished_body(call: ResponsesCall, completion: Completion) -> dict:
    """The non-streaming envelope."""
    call_ids = [new_id("fc_") for _ in completion.tool_calls]
    return response_body(
        call,
        status=_status(completion),
        output=output_items(completion, OutputIds(), call_ids),
        completion=completion,
    )


def store_response(store: ResponseStore, call: ResponsesCall, body: dict) -> None:
    if call.store:
        store.put(StoredResponse(body, call.input_items, call.chat.preserve_thinking))


async def responses_sse(
    outputs: AsyncIterator[TextDelta | Completion],
    call: ResponsesCall,
    store: ResponseStore,
    *,
    on_complete: Any = None,
    on_error: Any = None,
) -> AsyncIterator[bytes]:
    """response.created, response.in_progress, the Items as they are produced, then exactly one
    terminal event. No `[DONE]`."""
    seq = 0
    ids = OutputIds()

    def event(kind: str, data: dict) -> bytes:
        nonlocal seq
        payload = json.dumps(
            {"type": kind, "sequence_number": seq, **data},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        seq += 1
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    initial = response_body(call, status="in_progress", output=[])
    yield event("response.created", {"response": initial})
    yield event("response.in_progress", {"response": initial})

    done_items: list[dict] = []
    current: str | None = None  # reasoning | content
    text = ""

    def close_current(status: str = "completed") -> list[bytes]:
        nonlocal current, text
        frames = []
        index = len(done_items)
        if current == "reasoning":
            item = reasoning_item(ids.reasoning, text)
            frames.append(
                event(
                    "response.reasoning_text.done",
                    {
                        "item_id": ids.reasoning,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                    },
                )
            )
            part = item["content"][0]
            item_id = ids.reasoning
        else:
            item = message_item(ids.message, text, status)
            frames.append(
                event(
                    "response.output_text.done",
                    {
                        "item_id": ids.message,
                        "output_index": index,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    },
                )
            )
            part = item["content"][0]
            item_id = ids.message
        frames.append(
            event(
                "response.content_part.done",
                {"item_id": item_id, "output_index": index, "content_index": 0, "part": part},
            )
        )
        frames.append(event("response.output_item.done", {"output_index": index, "item": item}))
        done_items.append(item)
        current, text = None, ""
        return frames

    def open_item(channel: str) -> list[bytes]:
        nonlocal current
        current = channel
        index = len(done_items)
        if channel == "reasoning":
            item = {"id": ids.reasoning, "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": ids.message,
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": []}
        return [
            event("response.output_item.added", {"output_index": index, "item": item}),
            event(
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            ),
        ]

    try:
        async for out in outputs:
            if isinstance(out, TextDelta):
                if current != out.channel:
                    if current is not None:
                        for frame in close_current():
                            yield frame
                    for frame in open_item(out.channel):
                        yield frame
                text += out.text
                kind = (
                    "response.reasoning_text.delta"
                    if out.channel == "reasoning"
                    else "response.output_text.delta"
                )
                data = {
                    "item_id": ids.reasoning if out.channel == "reasoning" else ids.message,
                    "output_index": len(done_items),
                    "content_index": 0,
                    "delta": out.text,
                }
                if out.channel == "content":
                    data["logprobs"] = []
                yield event(kind, data)
                continue
            completion = out
            status = "incomplete" if completion.finish_reason == "length" else "completed"
            if current is not None:
                for frame in close_current(status):
                    yield frame
            has_message = any(item["type"] == "message" for item in done_items)
            if not (has_message or completion.tool_calls or completion.reasoning):
                for frame in open_item("content"):
                    yield frame
                for frame in close_current(status):
                    yield frame
            call_ids = [new_id("fc_") for _ in completion.tool_calls]
            for call_, item_id in zip(completion.tool_calls, call_ids):
                index = len(done_items)
                added = call_item(call_, item_id, "in_progress") | {"arguments": ""}
                yield event("response.output_item.added", {"output_index": index, "item": added})
                yield event(
                    "response.function_call_arguments.delta",
                    {"item_id": item_id, "output_index": index, "delta": call_.arguments_json},
                )
                yield event(
                    "response.function_call_arguments.done",
                    {"item_id": item_id, "output_index": index, "arguments": call_.arguments_json},
                )
                item = call_item(call_, item_id)
                yield event("response.output_item.done", {"output_index": index, "item": item})
                done_items.append(item)
            status = _status(completion)
            body = response_body(call, status=status, output=done_items, completion=completion)
            store_response(store, call, body)
            if on_complete is not None:
                on_complete(completion)
            yield event(f"response.{status}", {"response": body})
    except Exception as exc:  # reported in-band: the status line has already been sent
        err = to_api_error(exc, PROMPT_PARAMS["responses"])
        if on_error is not None:
            on_error(err)
        body = response_body(call, status="failed", output=done_items, error=err)
        yield event("response.failed", {"response": body})


def input_items_page(record: StoredResponse, query: dict[str, str]) -> dict:
    """`GET /v1/responses/{id}/input_items`: `after` (an item id), `limit` 1..100 (default 20),
    `order` asc | desc (default desc)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("'order' must be 'asc' or 'desc'", "invalid_pagination", "order")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise invalid("'limit' must be an integer", "invalid_pagination", "limit") from None
    if not 1 <= limit <= 100:
        raise invalid("'limit' must be in 1..100", "invalid_pagination", "limit")
    items = list(record.input_items)
    if order == "desc":
        items.reverse()
    after = query.get("after")
    if after is not None:
        positions = [i for i, item in enumerate(items) if item.get("id") == after]
        if not positions:
            raise invalid(
                f"'after' names no item of this response: {after}", "invalid_pagination", "after"
            )
        items = items[positions[0] + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


def parse_input_tokens_request(body: Any, info: ModelInfo) -> ChatRequest:
    """`POST /v1/responses/input_tokens`: exactly `model` and `input`, stateless."""
    body = require_object(body)
    for key in body:
        if key not in ("model", "input"):
            raise invalid(f"unknown parameter '{key}'", "unknown_parameter", key)
    model = get_str(body, "model", required=True)
    check_model(info, model)
    messages = items_to_messages(_parse_input(body.get("input"), set()))
    enabled, effort = info.resolve_thinking(None, None, effort_param="reasoning.effort")
    return ChatRequest(
        protocol="responses",
        model=model,
        messages=messages,
        max_tokens=info.default_max_tokens,
        enable_thinking=enabled,
        reasoning_effort=effort,
        preserve_thinking=info.preserve_thinking_default,
    )

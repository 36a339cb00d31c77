"""The one internal request every protocol adapter produces, and the field checks they share.

`ChatRequest` holds messages in the shape the chat template renders (HF `apply_chat_template`
semantics), tools, sampling values (None = the model's generation-config default), limits and the
resolved thinking options. Nothing here knows which wire protocol the request came from except
`protocol`, which is only used for logs and metrics.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ninfer.chat.presets import SamplingFields
from ninfer.chat.template import ChatTemplate, ChatTemplateOptionError
from ninfer.chat.tool_calls import ANTHROPIC_NAME_LIMIT, OPENAI_NAME_LIMIT, ToolCall
from ninfer.serve.errors import invalid, model_not_found

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
OPENAI_TOOL_NAME_MAX = OPENAI_NAME_LIMIT
ANTHROPIC_TOOL_NAME_MAX = ANTHROPIC_NAME_LIMIT
CHAT_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@dataclass(slots=True)
class Message:
    role: str  # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        """The dict the chat template renders."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict
    strict: bool = False

    def to_template(self) -> dict:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ChatRequest:
    protocol: str  # chat | responses | anthropic
    model: str
    messages: list[Message]
    max_tokens: int
    max_tokens_defaulted: bool = False
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required | function (see tool_choice_name)
    tool_choice_name: str | None = None
    sampling: SamplingFields = field(default_factory=SamplingFields)
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    enable_thinking: bool = True
    reasoning_effort: str | None = None
    preserve_thinking: bool = False
    tool_name_max: int = OPENAI_TOOL_NAME_MAX
    # the last message is an assistant turn the reply continues (Anthropic's prefill)
    continue_final: bool = False

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools rendered into the prompt: none, all, or only the named choice."""
        if not self.tools_active:
            return None
        if self.tool_choice == "function":
            return [t.to_template() for t in self.tools if t.name == self.tool_choice_name]
        return [t.to_template() for t in self.tools]

    def template_messages(self) -> list[dict]:
        """The messages the template renders. System turns that open the conversation are
        joined into one (blank lines between): Responses' `instructions` before a system or
        developer item, or two leading system messages, are then one system turn, which every
        template takes (the Qwen3.5 templates refuse a system turn that is not first)."""
        leading = 0
        while leading < len(self.messages) and self.messages[leading].role == "system":
            leading += 1
        if leading < 2:
            return [m.to_template() for m in self.messages]
        texts = [m.content for m in self.messages[:leading] if m.content]
        joined = Message("system", "\n\n".join(texts))
        return [joined.to_template(), *(m.to_template() for m in self.messages[leading:])]


@dataclass(slots=True)
class ModelInfo:
    """What adapters need to know about the served model and the server's defaults."""

    model_id: str
    template: ChatTemplate
    default_max_tokens: int = 8192
    thinking_default: bool = True
    preserve_thinking_default: bool = False
    created: int = 0

    def resolve_thinking(
        self, enable_thinking: bool | None, effort: str | None, *, effort_param: str
    ) -> tuple[bool, str | None]:
        """Combine a request's thinking switch and effort, checked against the template's
        capabilities (never the model name), into (thinking on, effort for the template)."""
        if (
            enable_thinking is None
            and effort is None
            and not self.thinking_default
            and self.template.capabilities.thinking
        ):
            enable_thinking = False
        try:
            resolved = self.template.resolve_reasoning(enable_thinking, effort)
        except ChatTemplateOptionError as exc:
            param = effort_param if exc.param == "reasoning_effort" else exc.param
            raise invalid(str(exc), exc.code, param) from None
        return resolved.enable_thinking, resolved.reasoning_effort


# ---- field checks shared by the adapters -------------------------------------------------


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def get_str(body: dict, key: str, *, required: bool = False, nonempty: bool = False) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise invalid(f"'{key}' is required", param=key)
        return None
    if not isinstance(value, str):
        raise invalid(f"'{key}' must be a string", param=key)
    if nonempty and not value:
        raise invalid(f"'{key}' must not be empty", param=key)
    return value


def get_bool(body: dict, key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean", param=key)
    return value


def get_number(
    body: dict, key: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid(f"'{key}' must be a number", param=key)
    value = float(value)
    if not math.isfinite(value):
        raise invalid(f"'{key}' must be finite", param=key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise invalid(f"'{key}' must be in [{lo}, {hi}], got {value:g}", param=key)
    return value


def get_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise invalid(f"'{key}' must be an integer", param=key)
    if lo is not None and value < lo:
        raise invalid(f"'{key}' must be at least {lo}, got {value}", param=key)
    if hi is not None and value > hi:
        raise invalid(f"'{key}' must be at most {hi}, got {value}", param=key)
    return value


def get_seed(body: dict) -> int | None:
    """Any 64-bit integer, signed as OpenAI's spec has it, or unsigned (its bits are the key)."""
    return get_int(body, "seed", -(2**63), 2**64 - 1)


def parse_stop(value: Any, param: str = "stop") -> list[str]:
    """A string or a list of strings; empty strings are ignored."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid(f"'{param}' must be a string or a list of strings", param=param)


def parse_json_object_text(text: Any, param: str) -> dict:
    """Tool-call arguments: a JSON object serialized as a string."""
    if not isinstance(text, str):
        raise invalid(f"'{param}' must be a string holding a JSON object", param=param)
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise invalid(f"'{param}' is not valid JSON: {exc.msg}", param=param) from None
    if not isinstance(obj, dict):
        raise invalid(f"'{param}' must be a JSON object", param=param)
    return obj


def check_tool_name(name: Any, limit: int, param: str) -> str:
    """A tool's name: letters, digits, '_' and '-', at most `limit` of them (both APIs' rule;
    a name with other characters could not be read back out of the model's calls)."""
    if not isinstance(name, str) or not name:
        raise invalid("tool name must be a non-empty string", param=param)
    if len(name) > limit:
        raise invalid(f"tool name is longer than {limit} characters", param=param)
    if not TOOL_NAME_RE.match(name):
        raise invalid(f"tool name '{name[:80]}' must match [A-Za-z0-9_-]{{1,{limit}}}", param=param)
    return name


def check_unique_tools(tools: list[Tool], param: str = "tools") -> list[Tool]:
    """The tools, each name once: a call names its tool, so two of one name are ambiguous."""
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise invalid(f"tool name '{tool.name}' is given twice", param=param)
        seen.add(tool.name)
    return tools


def sampling_from(body: dict, *, top_k: bool = True, min_p: bool = True) -> SamplingFields:
    """The sampling fields shared by Chat and Anthropic (ranges as upstream documents them);
    omitted fields stay None so they never override the model's defaults."""
    return SamplingFields(
        temperature=get_number(body, "temperature", 0.0, 2.0),
        top_p=get_number(body, "top_p", 0.0, 1.0),
        top_k=get_int(body, "top_k", 0) if top_k else None,
        min_p=get_number(body, "min_p", 0.0, 1.0) if min_p else None,
        presence_penalty=get_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=get_number(body, "frequency_penalty", -2.0, 2.0),
        seed=get_seed(body),
    )


def check_model(info: ModelInfo, model: str) -> None:
    if model != info.model_id:
        raise model_not_found(model, served=info.model_id)

"""Chat layer: the artifact's tokenizer and chat template, the output decoder (detokenizer,
`<think>` split, stop strings), the Qwen XML tool-call parser and sampling presets."""

from ninfer.chat.decoder import DecodeStep, IncrementalDetokenizer, OutputDecoder
from ninfer.chat.frontend import ChatFrontend, ChatPrompt
from ninfer.chat.presets import SamplingFields, resolve_sampling, sampling_preset
from ninfer.chat.template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateOptionError,
    ReasoningOptions,
    TemplateCapabilities,
)
from ninfer.chat.tokenizer import Tokenizer
from ninfer.chat.tool_calls import (
    ANTHROPIC_NAME_LIMIT,
    OPENAI_NAME_LIMIT,
    ParsedOutput,
    ToolCall,
    ToolCallStreamFilter,
    parse_tool_calls,
)

__all__ = [
    "ANTHROPIC_NAME_LIMIT",
    "OPENAI_NAME_LIMIT",
    "ChatFrontend",
    "ChatPrompt",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateOptionError",
    "DecodeStep",
    "IncrementalDetokenizer",
    "OutputDecoder",
    "ParsedOutput",
    "ReasoningOptions",
    "SamplingFields",
    "TemplateCapabilities",
    "Tokenizer",
    "ToolCall",
    "ToolCallStreamFilter",
    "parse_tool_calls",
    "resolve_sampling",
    "sampling_preset",
]

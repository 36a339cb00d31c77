"""A Qwen3.5-style chat template written for ninfer and a builder for small byte-level BPE
tokenizers with the Qwen special tokens: the text side of the shipped demo model and the
fixtures of the chat tests.

The template follows Qwen's conventions: ChatML turns, tools listed as JSON inside `<tools>` with
the XML tool-call format, assistant tool calls rendered back as `<tool_call>` blocks, tool results
grouped into one user turn of `<tool_response>` blocks, reasoning of earlier turns dropped unless
`preserve_thinking`, and a generation prompt that opens `<think>` (or writes an empty think block
when `enable_thinking` is false). `qwen_style_template(efforts=...)` adds a `reasoning_effort`
control with the given levels."""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# (text, special): special tokens never reach output text; the markup tokens do.
QWEN_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

_TOOLS_PREAMBLE = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_TOOLS_FORMAT = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\n"
    "value_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "Reminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is no "
    "function call available, answer the question like normal"
)

_TEMPLATE = r"""
{%- macro text_of(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}
{{- raise_exception('message content must be a string or a list of parts') -}}
{%- endif -%}
{%- endmacro -%}
{%- if not messages %}{{ raise_exception('no messages') }}{% endif %}
{%- set system_text = text_of(messages[0].content) if messages[0].role in ['system', 'developer'] else '' %}
@@EFFORT_SETUP@@
{%- if tools and tools is iterable and tools is not mapping %}
{{- '<|im_start|>system\n' }}
{%- if system_text %}{{ system_text + '\n\n' }}{% endif %}
{{- TOOLS_PREAMBLE }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- TOOLS_FORMAT }}
@@EFFORT_SYSTEM@@
{{- '<|im_end|>\n' }}
{%- elif system_text @@EFFORT_HAS_SYSTEM@@%}
{{- '<|im_start|>system\n' + system_text }}
@@EFFORT_SYSTEM@@
{{- '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1, multi_step=true) %}
{%- for message in messages[::-1] %}
{%- set index = messages | length - 1 - loop.index0 %}
{%- if ns.multi_step and message.role == 'user' %}
{%- set text = text_of(message.content) %}
{%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) %}
{%- set ns.multi_step = false %}
{%- set ns.last_query = index %}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = text_of(message.content) %}
{%- if message.role in ['system', 'developer'] %}
{%- if not loop.first %}
{{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- set reasoning = reasoning | trim %}
{%- if loop.index0 > ns.last_query or (preserve_thinking is defined and preserve_thinking) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{%- if not loop.first or content | trim %}{{ '\n\n' if loop.first else '\n' }}{% endif %}
{{- '<tool_call>\n<function=' + call.name + '>\n' }}
{%- if call.arguments is mapping %}
{%- for key, value in call.arguments | items %}
{{- '<parameter=' + key + '>\n' }}
{%- if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}
{{- '\n</parameter>\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unsupported role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- else %}
{{- '<think>\n' }}
{%- endif %}
{%- endif %}
"""

_EFFORT_SETUP = r"""
{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort is not none else '@@DEFAULT@@' %}
{%- if effort not in [@@LEVELS@@] %}{{ raise_exception('unsupported reasoning effort: ' + effort) }}{% endif %}
{%- set thinking = not (enable_thinking is defined and enable_thinking is false) %}
"""
_EFFORT_SYSTEM = r"""
{%- if thinking %}{{ '\n\nReasoning effort: ' + effort }}{% endif %}
"""


def qwen_style_template(efforts: Iterable[str] = (), default_effort: str | None = None) -> str:
    """The template source. With `efforts`, it reads `reasoning_effort` (falling back to
    `default_effort`, else the last level) and states it in the system turn while thinking."""
    efforts = tuple(efforts)
    source = _TEMPLATE.replace("TOOLS_PREAMBLE", json.dumps(_TOOLS_PREAMBLE))
    source = source.replace("TOOLS_FORMAT", json.dumps(_TOOLS_FORMAT))
    if efforts:
        default = default_effort or efforts[-1]
        setup = _EFFORT_SETUP.replace("@@DEFAULT@@", default)
        setup = setup.replace("@@LEVELS@@", ", ".join(f"'{e}'" for e in efforts))
        source = source.replace("@@EFFORT_SETUP@@", setup.strip("\n"))
        source = source.replace("@@EFFORT_SYSTEM@@", _EFFORT_SYSTEM.strip("\n"))
        source = source.replace("@@EFFORT_HAS_SYSTEM@@", "or thinking ")
    else:
        for marker in ("@@EFFORT_SETUP@@\n", "@@EFFORT_SYSTEM@@\n", "@@EFFORT_HAS_SYSTEM@@"):
            source = source.replace(marker, "")
    return source.strip("\n") + "\n"


def build_qwen_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `corpus` with the Qwen added tokens. Any text
    encodes (unseen characters fall back to bytes), so it can split UTF-8 characters."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens(
        [AddedToken(text, special=special, normalized=False) for text, special in QWEN_ADDED_TOKENS]
    )
    return tokenizer


def qwen_tokenizer_config(chat_template: str | None = None) -> dict:
    """tokenizer_config.json for a tokenizer from `build_qwen_tokenizer`."""
    config: dict = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


# Enough text for a few hundred merges across scripts, plus the markup the template writes.
TINY_CORPUS = (
    "Hello world! The weather in Paris is sunny today, and tomorrow it will rain.\n",
    "def add(a, b):\n    return a + b\n",
    "<think>\nThe user wants the weather, so I should call the tool.\n</think>\n\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>\n",
    "你好，世界！今天天气很好。Café, naïve, résumé, Ærøskøbing. Привет, мир!\n",
    'Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: {} [] () <> = + - * / "quotes".\n',
)


def tiny_frontend_resources(
    efforts: Iterable[str] = (), vocab_size: int = 400
) -> tuple[str, dict, str, dict]:
    """(tokenizer.json, tokenizer_config, chat_template, generation_config) of a tiny Qwen-style
    text side, trained on `TINY_CORPUS` in milliseconds: `ChatFrontend(*resources)`."""
    tokenizer = build_qwen_tokenizer(TINY_CORPUS * 4, vocab_size)
    template = qwen_style_template(efforts)
    generation_config = {
        "eos_token_id": [
            tokenizer.token_to_id("<|im_end|>"),
            tokenizer.token_to_id("<|endoftext|>"),
        ],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    return tokenizer.to_str(), qwen_tokenizer_config(), template, generation_config

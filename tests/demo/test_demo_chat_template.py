"""The demo model's chat template and tokenizer, as shipped in the artifact: tools, tool calls,
tool responses and thinking render the way ninfer's parsers read them, and exactly as
transformers' `apply_chat_template` renders the same template."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from ninfer.artifact.artifact import Artifact
from ninfer.chat.template import ChatTemplate, prompt_ends_in_reasoning
from ninfer.chat.tokenizer import Tokenizer
from ninfer.chat.tool_calls import parse_tool_calls

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "ninfer/assets/demo.ninfer"
TEMPLATE_SOURCE = REPO / "tools/train_demo/chat_template.jinja"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOL_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}},
            },
        ],
    },
    {"role": "tool", "content": "Paris: 18 C"},
    {"role": "tool", "content": "Rome: 24 C"},
]


@cache
def artifact() -> Artifact:
    return Artifact.open(ARTIFACT)


@cache
def template() -> ChatTemplate:
    return ChatTemplate(artifact().resource("chat_template").decode())


@cache
def tokenizer() -> Tokenizer:
    art = artifact()
    return Tokenizer(
        art.resource("tokenizer"),
        art.resource("tokenizer_config"),
        art.resource("generation_config"),
    )


def assistant_turn(rendered: str, index: int) -> str:
    """The body of the index-th assistant turn."""
    body = rendered.split("<|im_start|>assistant\n")[index + 1]
    return body.split("<|im_end|>")[0]


def test_artifact_carries_the_template_from_the_training_script():
    assert artifact().resource("chat_template").decode() == TEMPLATE_SOURCE.read_text()


def test_template_exposes_thinking_switch_and_preserve_thinking():
    caps = template().capabilities
    assert caps.thinking and caps.preserve_thinking and not caps.reasoning_effort


def test_generation_prompt_opens_think_block_by_default_and_closes_it_when_thinking_is_off():
    messages = [{"role": "user", "content": "hi"}]
    on = template().render(messages)
    off = template().render(messages, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and prompt_ends_in_reasoning(on)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning(off)


def test_tools_are_listed_as_json_in_the_system_turn_after_the_system_prompt():
    rendered = template().render([{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    system = rendered.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER_TOOL["function"]]
    with_prompt = template().render(TOOL_TURN[:2], tools=[WEATHER_TOOL])
    assert with_prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_assistant_tool_calls_render_as_blocks_the_parser_reads_back():
    rendered = template().render(TOOL_TURN, tools=[WEATHER_TOOL], add_generation_prompt=False)
    body = assistant_turn(rendered, 0)
    reasoning, content = body.split("</think>\n\n")
    assert reasoning == "<think>\nTwo cities, two calls.\n"
    assert content.startswith(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>"
    )
    parsed = parse_tool_calls(content)
    assert parsed.content == ""
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome", "days": 2}),
    ]


def test_consecutive_tool_results_share_one_user_turn_of_tool_response_blocks():
    rendered = template().render(TOOL_TURN, tools=[WEATHER_TOOL])
    assert (
        "<|im_start|>user\n<tool_response>\nParis: 18 C\n</tool_response>\n"
        "<tool_response>\nRome: 24 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in rendered


def test_reasoning_of_earlier_turns_is_dropped_unless_preserved():
    conversation = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "1", "reasoning_content": "first"},
        {"role": "user", "content": "two"},
    ]
    dropped = template().render(conversation)
    kept = template().render(conversation, preserve_thinking=True)
    assert assistant_turn(dropped, 0) == "1"
    assert assistant_turn(kept, 0) == "<think>\nfirst\n</think>\n\n1"


def test_reasoning_written_inline_in_content_is_moved_into_the_think_block():
    conversation = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
    ]
    rendered = template().render(conversation, add_generation_prompt=False)
    assert assistant_turn(rendered, 0) == "<think>\nhmm\n</think>\n\nanswer"


def test_unknown_role_is_refused():
    from ninfer.chat.template import ChatTemplateError

    with pytest.raises(ChatTemplateError):
        template().render([{"role": "narrator", "content": "x"}])


@pytest.mark.parametrize("thinking", [True, False])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, thinking):
    from transformers import AutoTokenizer

    art = artifact()
    for role, name in [
        ("tokenizer", "tokenizer.json"),
        ("tokenizer_config", "tokenizer_config.json"),
        ("chat_template", "chat_template.jinja"),
    ]:
        (tmp_path / name).write_bytes(art.resource(role))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    expected = hf.apply_chat_template(
        TOOL_TURN,
        tools=[WEATHER_TOOL],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    assert template().render(TOOL_TURN, tools=[WEATHER_TOOL], enable_thinking=thinking) == expected


def test_qwen_special_tokens_are_single_ids_at_the_end_of_the_vocabulary():
    tok = tokenizer()
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    names += ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    ids = [tok.token_to_id(n) for n in names]
    assert ids == list(range(tok.vocab_size - len(names), tok.vocab_size))
    for name, token_id in zip(names, ids):
        assert tok.encode(name) == [token_id]
        assert tok.encode(f"x{name}y").count(token_id) == 1
    assert set(tok.eos_token_ids) == {
        tok.token_to_id("<|im_end|>"),
        tok.token_to_id("<|endoftext|>"),
    }


def test_markup_tokens_decode_as_text_and_control_tokens_are_hidden():
    tok = tokenizer()
    ids = tok.encode("<think>\nx\n</think>\n\n<tool_call>\n</tool_call><|im_end|>")
    assert tok.decode(ids) == "<think>\nx\n</think>\n\n<tool_call>\n</tool_call>"


def test_code_round_trips_through_the_tokenizer():
    code = 'def f(x: int) -> str:\n    """Doc — ünïcode."""\n\treturn f"{x:>4}"  # ok\n'
    tok = tokenizer()
    assert tok.decode(tok.encode(code)) == code

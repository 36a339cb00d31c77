import pytest

from ninfer.chat import ChatFrontend, ChatTemplate, ChatTemplateError, ChatTemplateOptionError
from ninfer.chat.qwen_style import qwen_style_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

USER_ONLY = [{"role": "user", "content": "Hello there"}]
WITH_SYSTEM = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]},
]
TOOL_ROUND_TRIP = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "\nTwo cities, two calls.\n",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Tokyo"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
]
MULTI_TURN = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    {"role": "user", "content": "thanks"},
]

CASES = {
    "user": (USER_ONLY, None, {}),
    "system_parts_thinking_off": (WITH_SYSTEM, None, {"enable_thinking": False}),
    "tools_thinking_on": (TOOL_ROUND_TRIP, [WEATHER_TOOL], {"enable_thinking": True}),
    "tools_thinking_off": (TOOL_ROUND_TRIP, [WEATHER_TOOL], {"enable_thinking": False}),
    "history_dropped": (MULTI_TURN, None, {}),
    "history_preserved": (MULTI_TURN, None, {"preserve_thinking": True}),
}


def _hf_render(hf_tokenizer, template, messages, tools, options, **kwargs):
    return hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        **options,
        **kwargs,
    )


@pytest.mark.parametrize("case", CASES)
def test_rendered_prompt_equals_transformers(case, frontend, hf_tokenizer):
    messages, tools, options = CASES[case]
    template = frontend.template(tools)

    ours = template.render(messages, tools=tools, add_generation_prompt=True, **options)

    assert ours == _hf_render(
        hf_tokenizer, template.source, messages, tools, options, tokenize=False
    )


@pytest.mark.parametrize("case", CASES)
def test_prompt_ids_equal_transformers(case, frontend, hf_tokenizer):
    messages, tools, options = CASES[case]
    prompt = frontend.render(messages, tools=tools, **options)

    expected = _hf_render(
        hf_tokenizer, frontend.template().source, messages, tools, options, return_dict=False
    )
    assert prompt.token_ids == expected


PREFILLS = {
    "words": (USER_ONLY, "The answer is "),
    "table": (USER_ONLY, "|"),  # also a character of the end-of-turn token's text
    "quote": (USER_ONLY, ">"),
    "split by the template": ([{"role": "user", "content": "Echo x</think>Ok"}], "x</think>Ok"),
}


@pytest.mark.parametrize("options", [{}, {"enable_thinking": False}], ids=["thinking", "off"])
@pytest.mark.parametrize("prefill", PREFILLS)
def test_a_continued_final_assistant_turn_equals_transformers(
    prefill, options, frontend, hf_tokenizer
):
    """`continue_final`: the prompt ends after the final assistant message's text, as
    transformers' `continue_final_message` renders it, also where the text occurs earlier, is
    part of the end-of-turn token's text, or is split by the template; a conversation ending
    otherwise is refused."""
    turns, text = PREFILLS[prefill]
    messages = [*turns, {"role": "assistant", "content": text}]
    prompt = frontend.render(messages, continue_final=True, **options)
    expected = hf_tokenizer.apply_chat_template(
        messages,
        chat_template=frontend.template().source,
        continue_final_message=True,
        tokenize=False,
        **options,
    )
    assert prompt.text == expected and not prompt.starts_in_reasoning
    assert not prompt.enable_thinking  # the reply continues the answer: no thinking preset
    with pytest.raises(ChatTemplateError, match="final assistant message"):
        frontend.render(USER_ONLY, continue_final=True)


def test_a_continued_turn_whose_text_the_template_moves_ends_after_what_it_shows(frontend):
    """Text the template splits into reasoning and an answer (which transformers refuses to
    continue, the whole text being nowhere in its render) is continued after the answer part,
    the reasoning closed before it."""
    messages = [*USER_ONLY, {"role": "assistant", "content": "x</think>\n\nAnswer:"}]
    prompt = frontend.render(messages, continue_final=True)
    assert prompt.text.endswith("</think>\n\nAnswer:") and not prompt.starts_in_reasoning


@pytest.mark.parametrize(
    "options",
    [{}, {"reasoning_effort": "low"}, {"reasoning_effort": "medium"}, {"enable_thinking": False}],
)
def test_effort_prompt_equals_transformers(options, effort_frontend, hf_tokenizer):
    template = effort_frontend.template()

    ours = template.render(TOOL_ROUND_TRIP, tools=[WEATHER_TOOL], **options)

    reference = _hf_render(
        hf_tokenizer, template.source, TOOL_ROUND_TRIP, [WEATHER_TOOL], options, tokenize=False
    )
    assert ours == reference
    expected_effort = options.get("reasoning_effort", "xhigh")
    assert (f"Reasoning effort: {expected_effort}" in ours) == ("enable_thinking" not in options)


def test_generation_prompt_opens_think_only_when_thinking(frontend):
    on = frontend.render(USER_ONLY)
    off = frontend.render(USER_ONLY, enable_thinking=False)

    assert on.text.endswith("<|im_start|>assistant\n<think>\n")
    assert on.starts_in_reasoning and on.enable_thinking
    assert off.text.endswith("<think>\n\n</think>\n\n")
    assert not off.starts_in_reasoning and not off.enable_thinking


def test_tool_call_arguments_as_json_string_render_like_objects(frontend):
    as_string = [dict(m) for m in TOOL_ROUND_TRIP]
    as_string[2] = {
        **as_string[2],
        "tool_calls": [
            {**c, "function": {**c["function"], "arguments": '{"city": "Paris", "days": 2}'}}
            for c in TOOL_ROUND_TRIP[2]["tool_calls"][:1]
        ],
    }
    as_object = [dict(m) for m in TOOL_ROUND_TRIP]
    as_object[2] = {**as_object[2], "tool_calls": TOOL_ROUND_TRIP[2]["tool_calls"][:1]}

    rendered = frontend.render(as_string, tools=[WEATHER_TOOL]).text

    assert rendered == frontend.render(as_object, tools=[WEATHER_TOOL]).text
    assert "<parameter=days>\n2\n</parameter>" in rendered


def test_capabilities_come_from_template_source():
    plain = ChatTemplate(qwen_style_template()).capabilities
    effort = ChatTemplate(qwen_style_template(("low", "high"), default_effort="low")).capabilities
    no_switch = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}").capabilities

    assert plain.thinking and plain.preserve_thinking and not plain.reasoning_effort
    assert effort.effort_levels == ("low", "high") and effort.default_effort == "low"
    assert not no_switch.thinking and not no_switch.preserve_thinking


@pytest.mark.parametrize(
    "source, levels, default",
    [
        (
            "{% if reasoning_effort == 'low' %}L{% elif reasoning_effort == 'max' %}M{% endif %}",
            ("low", "max"),
            None,
        ),
        (
            "{{ reasoning_effort | default('medium') }}{% if reasoning_effort in ['low'] %}{% endif %}",
            ("low", "medium"),
            "medium",
        ),
        (
            "{% set budgets = {'low': 1, 'high': 9} %}{{ budgets[reasoning_effort] }}",
            ("low", "high"),
            None,
        ),
        (
            "{% if reasoning_effort is not defined %}{% set reasoning_effort = 'high' %}{% endif %}",
            ("high",),
            "high",
        ),
    ],
)
def test_effort_levels_detected_in_common_template_forms(source, levels, default):
    caps = ChatTemplate(source).capabilities

    assert set(caps.effort_levels) == set(levels)
    assert caps.default_effort == default


def test_unsupported_effort_is_rejected(frontend, effort_frontend):
    with pytest.raises(ChatTemplateOptionError) as plain:
        frontend.render(USER_ONLY, reasoning_effort="low")
    with pytest.raises(ChatTemplateOptionError) as high:
        effort_frontend.render(USER_ONLY, reasoning_effort="high")

    assert plain.value.code == "reasoning_effort_not_supported"
    assert high.value.code == "reasoning_effort_not_supported"


def test_thinking_switch_conflicting_with_effort_is_rejected(effort_frontend):
    with pytest.raises(ChatTemplateOptionError) as off_with_effort:
        effort_frontend.render(USER_ONLY, enable_thinking=False, reasoning_effort="low")
    with pytest.raises(ChatTemplateOptionError) as on_with_none:
        effort_frontend.render(USER_ONLY, enable_thinking=True, reasoning_effort="none")

    assert off_with_effort.value.code == "conflicting_template_option"
    assert on_with_none.value.code == "conflicting_template_option"


def test_effort_none_turns_thinking_off(effort_frontend):
    prompt = effort_frontend.render(USER_ONLY, reasoning_effort="none")

    assert not prompt.enable_thinking and not prompt.starts_in_reasoning
    assert prompt.reasoning_effort is None


def test_disabling_thinking_without_a_template_switch_is_rejected(resources):
    tokenizer_json, config, _, generation = resources
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    frontend = ChatFrontend(tokenizer_json, config, source, generation)

    with pytest.raises(ChatTemplateOptionError) as error:
        frontend.render(USER_ONLY, enable_thinking=False)

    assert error.value.code == "chat_template_option_not_supported"


def test_template_raise_exception_is_a_typed_error(frontend):
    with pytest.raises(ChatTemplateError, match="unsupported role: function"):
        frontend.render([{"role": "function", "content": "x"}])


def test_python_error_inside_the_template_is_a_typed_error():
    # a tool schema of a shape this template does not expect: the sum is a TypeError in Jinja
    template = ChatTemplate("{% for t in tools %}{{ t.function.parameters.count + 1 }}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"count": "many"}}}]

    with pytest.raises(ChatTemplateError, match="TypeError"):
        template.render([{"role": "user", "content": "hi"}], tools=tools)


def test_template_embedded_in_tokenizer_config_is_used(resources):
    tokenizer_json, config, template, generation = resources
    frontend = ChatFrontend(tokenizer_json, {**config, "chat_template": template}, None, generation)

    assert frontend.render(USER_ONLY).text.endswith("<think>\n")


def test_named_tool_use_template_is_picked_when_tools_are_given(resources):
    tokenizer_json, config, template, generation = resources
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": template}]
    frontend = ChatFrontend(tokenizer_json, {**config, "chat_template": named}, None, generation)

    assert frontend.template().source == "plain"
    assert frontend.template([WEATHER_TOOL]).source == template


def test_special_tokens_reach_the_template(resources):
    tokenizer_json, config, _, generation = resources
    frontend = ChatFrontend(tokenizer_json, config, "{{ eos_token }}|{{ pad_token }}", generation)

    assert frontend.template().render(USER_ONLY) == "<|im_end|>|<|endoftext|>"

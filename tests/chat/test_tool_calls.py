import json
import re

import pytest

from ninfer.chat import (
    ANTHROPIC_NAME_LIMIT,
    OPENAI_NAME_LIMIT,
    ToolCallStreamFilter,
    parse_tool_calls,
)


def call_block(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_single_call_parses_and_content_prefix_is_trimmed():
    text = "Let me check the weather.  \n\n" + call_block("get_weather", city="Paris")

    parsed = parse_tool_calls(text)

    assert parsed.content == "Let me check the weather."
    [call] = parsed.tool_calls
    assert call.name == "get_weather" and call.arguments == {"city": "Paris"}
    assert json.loads(call.arguments_json) == {"city": "Paris"}
    assert re.fullmatch(r"call_[0-9a-f]{16}", call.id)


def test_multiple_calls_parse_in_order_with_distinct_ids():
    text = call_block("a", x="1") + "\n" + call_block("b", y="2") + "\n"

    parsed = parse_tool_calls(text)

    assert parsed.content == ""
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_call_without_parameters_has_empty_arguments():
    assert parse_tool_calls(call_block("now")).tool_calls[0].arguments == {}


@pytest.mark.parametrize(
    "raw, value",
    [
        ("Paris", "Paris"),
        ("  two words \n", "two words"),
        ("42", 42),
        ("-1.5", -1.5),
        ("true", True),
        ("null", None),
        ('{"a":[1,2]}', {"a": [1, 2]}),
        ('[1, "x"]', [1, "x"]),
        ('"quoted"', "quoted"),
        ("NaN", "NaN"),
        ("{not json", "{not json"),
        ("line one\nline two", "line one\nline two"),
    ],
)
def test_parameter_values_are_json_when_they_parse_else_strings(raw, value):
    [call] = parse_tool_calls(call_block("f", v=raw)).tool_calls

    assert call.arguments == {"v": value}


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>",  # unclosed call
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>",  # unclosed param
        "<tool_call>\n<function=f>\n</tool_call>",  # unclosed function
        "<tool_call>\n<parameter=x>\n1\n</parameter>\n</tool_call>",  # no function
        "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",  # text in function
        "<tool_call>\n<function=f>\n</function>\n<function=g>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=x>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",  # empty name
        "<tool_call>\n<function=two words>\n</function>\n</tool_call>",
        call_block("f", x="1") + "\nand then some text",  # non-whitespace suffix
        call_block("f", x="1") + "\n" + "<tool_call>\n<function=g>",  # second one malformed
    ],
)
def test_any_malformed_block_or_suffix_turns_the_whole_output_into_text(text):
    text = "Sure. " + text

    parsed = parse_tool_calls(text)

    assert parsed.tool_calls == [] and parsed.content == text


def test_output_without_calls_is_unchanged():
    text = "No tools needed.\n\n"

    assert parse_tool_calls(text).content == text


@pytest.mark.parametrize(
    "limit, length, ok",
    [
        (OPENAI_NAME_LIMIT, 64, True),
        (OPENAI_NAME_LIMIT, 65, False),
        (ANTHROPIC_NAME_LIMIT, 128, True),
        (ANTHROPIC_NAME_LIMIT, 129, False),
    ],
)
def test_tool_name_length_limits(limit, length, ok):
    text = call_block("n" * length, x="1")

    parsed = parse_tool_calls(text, name_limit=limit)

    assert bool(parsed.tool_calls) is ok
    assert parsed.content == ("" if ok else text)


def stream(text: str, chunk: int, name_limit: int = OPENAI_NAME_LIMIT):
    """Pushes `text` in pieces of `chunk` characters; returns (published pieces, parsed)."""
    filt = ToolCallStreamFilter(name_limit)
    published = [filt.push(text[i : i + chunk]) for i in range(0, len(text), chunk)]
    rest, parsed = filt.finish()
    return published + [rest], parsed


CHUNKS = [1, 2, 3, 7, 1000]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_stream_filter_publishes_the_trimmed_prefix_of_a_valid_call(chunk):
    text = "Checking Paris 🌦 now. \n \n" + call_block("get_weather", city="Paris") + "\n"

    published, parsed = stream(text, chunk)

    assert "".join(published) == "Checking Paris 🌦 now."
    assert len("".join(published).encode()) == len(parsed.content.encode())
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("chunk", CHUNKS)
def test_stream_filter_flushes_malformed_input_byte_exact(chunk):
    text = "Trying: \n<tool_call>\n<function=f>\n<parameter=x>\n1 ✓\n</function>\n</tool_call>  "

    published, parsed = stream(text, chunk)

    assert "".join(published).encode() == text.encode()
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("chunk", CHUNKS)
def test_stream_filter_keeps_trailing_whitespace_in_plain_output(chunk):
    text = "A <tool plain answer ending in <tool_cal and spaces  \n"

    published, parsed = stream(text, chunk)

    assert "".join(published) == text
    assert parsed.content == text


def test_stream_filter_holds_only_a_possible_marker_and_the_whitespace_before_it():
    filt = ToolCallStreamFilter()

    assert filt.push("Hello") == "Hello"
    assert filt.push(" \n<tool") == ""
    assert filt.push("box>") == " \n<toolbox>"
    assert filt.push("  <tool_call>\n<function=f>") == ""
    assert filt.push("\n</function>\n</tool_call>") == ""
    rest, parsed = filt.finish()
    assert rest == "" and parsed.content == "Hello \n<toolbox>"
    assert [c.name for c in parsed.tool_calls] == ["f"]


def test_stream_filter_applies_the_name_limit():
    text = call_block("n" * 100, x="1")

    openai_published, openai_parsed = stream(text, 5, OPENAI_NAME_LIMIT)
    anthropic_published, anthropic_parsed = stream(text, 5, ANTHROPIC_NAME_LIMIT)

    assert "".join(openai_published) == text and not openai_parsed.tool_calls
    assert "".join(anthropic_published) == "" and anthropic_parsed.tool_calls

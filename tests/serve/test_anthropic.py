"""Anthropic Messages: request translation (upstream checklist §8.2 Anthropic), the message body
and the SSE event sequence."""

from __future__ import annotations

import json

import pytest
from serve_helpers import model_info, typed_events

from ninfer.serve.anthropic import parse_messages_request
from ninfer.serve.errors import ApiError

CALL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
TOOL = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def body(**fields):
    return {
        "model": "claude-any",
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Hi"}],
        **fields,
    }


def rejection(info, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_messages_request(body(**fields), info)
    return caught.value


def roles(request) -> list[str]:
    return [m.role for m in request.messages]


def test_model_is_a_label_and_top_level_system_blocks_are_joined(info):
    request = parse_messages_request(
        body(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]), info
    )
    assert request.model == "claude-any"
    assert request.messages[0].role == "system" and request.messages[0].content == "A\nB"


def test_mid_array_and_consecutive_system_turns_stay_in_place(info):
    messages = [
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "s1"},
        {"role": "system", "content": "s2"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "system", "content": "s3"},
    ]
    request = parse_messages_request(body(messages=messages), info)
    assert roles(request) == ["user", "system", "system", "assistant", "user", "system"]


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        [
            {"role": "user", "content": "u"},
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u2"},
        ],
        [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
            },
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}],
            },
        ],
    ],
)
def test_misplaced_system_messages_are_invalid_message_order(info, messages):
    assert rejection(info, messages=messages).code == "invalid_message_order"


def test_tool_result_expands_in_place_and_tool_use_input_is_kept(info):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "call it", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    request = parse_messages_request(body(messages=messages, tools=[TOOL]), info)
    assert roles(request) == ["user", "assistant", "tool", "user"]
    assistant = request.messages[1]
    assert assistant.content == "Checking." and assistant.reasoning == "call it"
    assert assistant.tool_calls[0].arguments == {"city": "Paris"}
    assert json.loads(assistant.tool_calls[0].arguments_json) == {"city": "Paris"}
    assert request.messages[2].tool_call_id == "t1" and request.messages[2].content == "sunny"


def test_input_schema_maps_to_parameters_and_any_means_required(info):
    request = parse_messages_request(body(tools=[TOOL], tool_choice={"type": "any"}), info)
    [tool] = request.tools
    assert tool.parameters == TOOL["input_schema"] and tool.strict is False
    assert request.tool_choice == "required"


def test_a_tool_choice_of_type_tool_needs_a_name(info):
    err = rejection(info, tools=[TOOL], tool_choice={"type": "tool"})
    assert err.param == "tool_choice" and "needs a string 'name'" in err.message
    named = {"type": "tool", "name": TOOL["name"]}
    assert parse_messages_request(body(tools=[TOOL], tool_choice=named), info).tool_choice == (
        "function"
    )


def test_a_text_or_thinking_block_without_its_string_names_the_field(info):
    err = rejection(info, messages=[{"role": "user", "content": [{"type": "text"}]}])
    assert err.param == "messages[0].content[0].text" and "must be a string" in err.message
    turn = {"role": "assistant", "content": [{"type": "thinking", "thinking": 3}]}
    err = rejection(info, messages=[{"role": "user", "content": "Hi"}, turn])
    assert err.param == "messages[1].content[0].thinking"


def test_tool_names_up_to_128_characters_pass(info):
    parse_messages_request(body(tools=[{**TOOL, "name": "a" * 128}]), info)
    assert rejection(info, tools=[{**TOOL, "name": "a" * 129}]).status == 400


def test_tool_names_are_letters_digits_underscores_and_dashes_and_unique(info):
    """A name with a space could not be read back out of the model's call, and two tools of
    one name would make a call ambiguous: both are 400, naming the field."""
    err = rejection(info, tools=[{**TOOL, "name": "get weather"}])
    assert err.status == 400 and err.param == "tools[0].name"
    err = rejection(info, tools=[TOOL, {**TOOL, "description": "again"}])
    assert err.status == 400 and "twice" in err.message and err.param == "tools"


def test_server_tools_are_rejected(info):
    err = rejection(info, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert err.code == "tool_type_not_supported"


def test_images_are_refused_without_vision(info):
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    err = rejection(info, messages=[{"role": "user", "content": [image]}])
    assert err.code == "vision_disabled"


def test_thinking_switch_and_effort(info, effort_frontend):
    assert (
        parse_messages_request(body(thinking={"type": "disabled"}), info).enable_thinking is False
    )
    for kind in ("enabled", "adaptive", "something-new"):
        assert parse_messages_request(body(thinking={"type": kind}), info).enable_thinking
    preserved = parse_messages_request(
        body(thinking={"type": "disabled"}, preserve_thinking=True), info
    )
    assert preserved.preserve_thinking is True
    assert rejection(info, preserve_thinking="yes").param == "preserve_thinking"

    effort_info = model_info(effort_frontend)
    request = parse_messages_request(body(output_config={"effort": "low"}), effort_info)
    assert request.reasoning_effort == "low"
    assert rejection(effort_info, output_config={"effort": "high"}).code == (
        "reasoning_effort_not_supported"
    )
    assert rejection(effort_info, output_config={"effort": "minimal"}).param == (
        "output_config.effort"
    )
    conflict = rejection(
        effort_info, thinking={"type": "disabled"}, output_config={"effort": "low"}
    )
    assert conflict.code == "conflicting_template_option"
    assert rejection(effort_info, output_config={"format": {}}).status == 400


# ---- over HTTP ---------------------------------------------------------------------------


def test_body_orders_thinking_text_tool_use_and_maps_stop_reasons(make_client, engine):
    engine.script = [("reasoning", "Hmm."), ("content", "Checking.\n"), ("content", CALL_TEXT)]
    reply = make_client().post("/v1/messages", json=body(tools=[TOOL])).json()
    assert reply["type"] == "message" and reply["role"] == "assistant"
    assert reply["id"].startswith("msg_") and reply["model"] == "claude-any"
    assert [b["type"] for b in reply["content"]] == ["thinking", "text", "tool_use"]
    assert reply["content"][0] == {"type": "thinking", "thinking": "Hmm.", "signature": ""}
    assert reply["content"][2]["input"] == {"city": "Paris"}
    assert reply["content"][2]["id"].startswith("call_")
    assert reply["stop_reason"] == "tool_use" and reply["stop_sequence"] is None
    assert set(reply["usage"]) == {"input_tokens", "output_tokens"}


@pytest.mark.parametrize(
    "finish, stop_reason", [("length", "max_tokens"), ("stop", "end_turn"), ("abort", "end_turn")]
)
def test_stop_reasons(make_client, engine, finish, stop_reason):
    engine.finish = finish
    reply = make_client().post("/v1/messages", json=body()).json()
    assert reply["stop_reason"] == stop_reason


def test_a_stop_sequence_is_reported_as_one(make_client, engine):
    """A reply ended by one of `stop_sequences` says so and names it, in the message and in the
    stream's message_delta; one ended by a stop token is an end_turn."""
    engine.stop_reason = "add"
    reply = make_client().post("/v1/messages", json=body(stop_sequences=["add"])).json()
    assert reply["stop_reason"] == "stop_sequence" and reply["stop_sequence"] == "add"
    response = make_client().post("/v1/messages", json=body(stop_sequences=["add"], stream=True))
    deltas = [data for kind, data in typed_events(response.text) if kind == "message_delta"]
    assert deltas[-1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "add"}
    engine.stop_reason = 151645  # the end-of-turn token
    reply = make_client().post("/v1/messages", json=body()).json()
    assert reply["stop_reason"] == "end_turn" and reply["stop_sequence"] is None


def test_empty_output_gives_one_empty_text_block(make_client, engine):
    engine.script = []
    reply = make_client().post("/v1/messages", json=body()).json()
    assert reply["content"] == [{"type": "text", "text": ""}]


def test_thinking_cut_by_max_tokens_is_the_whole_content_in_body_and_stream(make_client, engine):
    """No empty text block beside it: the Messages API refuses one when a client sends the
    turn back."""
    engine.script, engine.finish = [("reasoning", "Hm")], "length"
    client = make_client()
    reply = client.post("/v1/messages", json=body()).json()
    assert [block["type"] for block in reply["content"]] == ["thinking"]
    assert reply["stop_reason"] == "max_tokens"
    events = typed_events(client.post("/v1/messages", json=body(stream=True)).text)
    starts = [d["content_block"]["type"] for k, d in events if k == "content_block_start"]
    assert starts == ["thinking"]


def test_stream_event_sequence(make_client, engine):
    engine.script = [
        ("reasoning", "Hm"),
        ("reasoning", "m."),
        ("content", "Hi"),
        ("content", CALL_TEXT),
    ]
    response = make_client().post("/v1/messages", json=body(tools=[TOOL], stream=True))
    assert response.headers["content-type"].startswith("text/event-stream")
    events = typed_events(response.text)
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["model"] == "claude-any"
    assert start["id"].startswith("msg_") and start["usage"]["input_tokens"] > 0
    deltas = [data["delta"] for kind, data in events if kind == "content_block_delta"]
    assert [d["type"] for d in deltas] == [
        "thinking_delta",
        "thinking_delta",
        "text_delta",
        "input_json_delta",
    ]
    assert json.loads(deltas[-1]["partial_json"]) == {"city": "Paris"}
    tool_start = events[8][1]["content_block"]
    assert tool_start["type"] == "tool_use" and tool_start["input"] == {}
    assert [data["index"] for kind, data in events if kind == "content_block_start"] == [0, 1, 2]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == 4


def test_stream_of_empty_output_has_one_empty_text_block(make_client, engine):
    engine.script = []
    events = typed_events(make_client().post("/v1/messages", json=body(stream=True)).text)
    assert [k for k, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_error_after_stream_start_is_an_error_event(make_client, engine):
    engine.finish = "error"
    events = typed_events(make_client().post("/v1/messages", json=body(stream=True)).text)
    kind, data = events[-1]
    assert kind == "error" and data["error"]["type"] == "api_error"


def test_count_tokens_returns_input_tokens_equal_to_usage(make_client):
    client = make_client()
    counted = client.post(
        "/v1/messages/count_tokens",
        json={"model": "x", "messages": [{"role": "user", "content": "Hi"}]},
    )
    reply = client.post("/v1/messages", json=body())
    assert counted.json() == {"input_tokens": reply.json()["usage"]["input_tokens"]}


def test_a_final_assistant_turn_with_text_is_continued(make_client, engine, frontend):
    """Anthropic's prefill: a conversation ending with assistant text gives a prompt that ends
    right after that text (no end of turn, no new turn), so the reply continues it; one ending
    with a user turn, or with a tool call, opens a new assistant turn as before."""
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    reply = make_client().post("/v1/messages", json=body(messages=prefill)).json()
    assert reply["type"] == "message"
    assert frontend.tokenizer.decode(engine.requests[-1].prompt_ids).endswith("The answer is")
    continued = frontend.render(prefill, continue_final=True).text
    assert continued.endswith("The answer is") and continued.count("<|im_end|>") == 1  # the user's
    closed = frontend.render(prefill).text  # without: the turn closed and a new one opened
    assert closed.count("<|im_end|>") == 2 and not closed.endswith("The answer is")
    info = model_info(frontend)
    assert parse_messages_request(body(messages=prefill), info).continue_final
    assert not parse_messages_request(body(), info).continue_final
    call = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    calling = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [call]}]
    assert not parse_messages_request(body(messages=calling, tools=[TOOL]), info).continue_final

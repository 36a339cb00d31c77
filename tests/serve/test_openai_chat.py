"""OpenAI Chat Completions: request validation (upstream checklist §8.2 Chat) and the wire
shapes of the JSON body and the chunk stream."""

from __future__ import annotations

import json
import re

import pytest
from serve_helpers import EFFORTS, MODEL_ID, chat_chunks, model_info

from ninfer.serve.errors import ApiError
from ninfer.serve.openai_chat import parse_chat_request

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)


def body(**fields):
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_tools_of_one_name_are_refused(info):
    assert "twice" in rejection(info, tools=[TOOL, TOOL]).message


def rejection(info, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat_request(body(**fields), info)
    return caught.value


def test_missing_limit_becomes_server_default_and_is_marked_defaulted(frontend):
    info = model_info(frontend, default_max_tokens=321)
    request = parse_chat_request(body(), info)
    assert request.max_tokens == 321 and request.max_tokens_defaulted
    assert request.stream is False


def test_max_completion_tokens_wins_over_max_tokens(info):
    request = parse_chat_request(body(max_tokens=10, max_completion_tokens=20), info)
    assert request.max_tokens == 20 and not request.max_tokens_defaulted


def test_preserve_thinking_sources_must_agree_and_null_counts_as_omitted(info):
    request = parse_chat_request(
        body(preserve_thinking=True, chat_template_kwargs={"preserve_thinking": None}), info
    )
    assert request.preserve_thinking is True
    err = rejection(info, preserve_thinking=True, chat_template_kwargs={"preserve_thinking": False})
    assert err.code == "conflicting_template_option"


def test_unknown_template_kwarg_is_rejected(info):
    err = rejection(info, chat_template_kwargs={"custom_flag": 1})
    assert err.code == "chat_template_option_not_supported"


def test_effort_is_checked_against_the_template(frontend, effort_frontend):
    assert rejection(model_info(frontend), reasoning_effort="low").code == (
        "reasoning_effort_not_supported"
    )
    effort_info = model_info(effort_frontend)
    assert parse_chat_request(body(reasoning_effort="low"), effort_info).reasoning_effort == "low"
    assert rejection(effort_info, reasoning_effort="high").code == "reasoning_effort_not_supported"
    assert set(EFFORTS) <= set(effort_info.template.capabilities.effort_levels)


def test_enable_thinking_contradicting_effort_is_a_conflict(effort_frontend, info):
    effort_info = model_info(effort_frontend)
    err = rejection(effort_info, enable_thinking=False, reasoning_effort="low")
    assert err.code == "conflicting_template_option"
    assert rejection(info, enable_thinking=True, reasoning_effort="none").code == (
        "conflicting_template_option"
    )
    off = parse_chat_request(body(reasoning_effort="none"), info)
    assert off.enable_thinking is False


def test_text_parts_are_joined_with_newlines(info):
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = parse_chat_request(body(messages=[{"role": "user", "content": content}]), info)
    assert request.messages[0].content == "a\nb"


def test_image_parts_are_refused_without_vision(info):
    content = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    err = rejection(info, messages=[{"role": "user", "content": content}])
    assert err.code == "vision_disabled"


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tool_type_not_supported"),
        ({"functions": [{"name": "f"}]}, "tools_not_supported"),
        ({"function_call": "auto"}, "tools_not_supported"),
        ({"response_format": {"type": "json_object"}}, "response_format_not_supported"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format_not_supported",
        ),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "unsupported_role"),
        ({"n": 2}, "n_not_supported"),
    ],
)
def test_unsupported_features_are_rejected_with_their_code(info, fields, code):
    err = rejection(info, **fields)
    assert err.status == 400 and err.code == code


def test_text_response_format_is_accepted(info):
    parse_chat_request(body(response_format={"type": "text"}), info)


def test_missing_model_is_rejected_and_unknown_model_is_404(info):
    with pytest.raises(ApiError) as caught:
        parse_chat_request({"messages": [{"role": "user", "content": "x"}]}, info)
    assert caught.value.status == 400 and caught.value.param == "model"
    assert rejection(info, model="other").status == 404


def test_tools_keep_their_fields_and_tool_choice_defaults_to_auto(info):
    tool = {**TOOL, "function": {**TOOL["function"], "strict": True}}
    request = parse_chat_request(body(tools=[tool]), info)
    [parsed] = request.tools
    assert (parsed.name, parsed.description, parsed.strict) == (
        "get_weather",
        "Weather of a city",
        True,
    )
    assert parsed.parameters == TOOL["function"]["parameters"]
    assert request.tool_choice == "auto" and request.tools_active


def test_tool_choice_none_disables_tools_and_named_choice_renders_only_that_tool(info):
    other = {"type": "function", "function": {"name": "other"}}
    none = parse_chat_request(body(tools=[TOOL, other], tool_choice="none"), info)
    assert not none.tools_active and none.template_tools() is None
    named = parse_chat_request(
        body(tools=[TOOL, other], tool_choice={"type": "function", "function": {"name": "other"}}),
        info,
    )
    assert [t["function"]["name"] for t in named.template_tools()] == ["other"]
    assert named.tools[1].parameters == {"type": "object", "properties": {}}
    assert parse_chat_request(body(tools=[TOOL], tool_choice="required"), info).tool_choice == (
        "required"
    )
    err = rejection(
        info, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "missing"}}
    )
    assert err.param == "tool_choice"


def test_tool_calls_and_tool_messages_round_trip(info):
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = parse_chat_request(body(messages=messages, tools=[TOOL]), info)
    rendered = request.template_messages()
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert rendered[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message",
    [
        {"role": "tool", "content": "x"},
        {"role": "user", "content": "x", "tool_call_id": "c"},
        {"role": "user", "content": "x", "tool_calls": []},
        {"role": "assistant"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
            ],
        },
    ],
)
def test_malformed_messages_are_rejected(info, message):
    assert rejection(info, messages=[message]).status == 400


def test_stop_accepts_a_string_or_a_list_and_ignores_empty_strings(info):
    assert parse_chat_request(body(stop="END"), info).stop == ["END"]
    assert parse_chat_request(body(stop=["a", "", "b"]), info).stop == ["a", "b"]


def test_seed_is_any_64_bit_integer_signed_or_not(info):
    """OpenAI's spec types `seed` as a signed 64-bit integer; unsigned ones are taken too."""
    for seed in (-1, -(2**63), 0, 2**64 - 1):
        assert parse_chat_request(body(seed=seed), info).sampling.seed == seed


def test_omitted_sampling_fields_do_not_override_model_defaults(info):
    sampling = parse_chat_request(body(temperature=0.5), info).sampling
    assert sampling.temperature == 0.5
    assert sampling.top_p is None and sampling.top_k is None and sampling.seed is None


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 2.5},
        {"top_p": 1.5},
        {"top_k": -1},
        {"presence_penalty": 3},
        {"seed": -(2**63) - 1},
        {"seed": 2**64},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"5": float("inf")}},
    ],
)
def test_out_of_range_sampling_values_are_rejected(info, fields):
    [param] = fields
    assert rejection(info, **fields).param == param


# ---- over HTTP ---------------------------------------------------------------------------


def test_non_stream_body_has_upstream_shape(make_client, engine):
    engine.script = [("reasoning", "Think."), ("content", "Hello"), ("content", " there")]
    answer = make_client().post("/v1/chat/completions", json=body()).json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", answer["id"])
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL_ID
    [choice] = answer["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello there",
        "reasoning_content": "Think.",
    }
    assert choice["finish_reason"] == "stop"
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3 and usage["prompt_tokens"] > 0


def test_empty_reasoning_is_omitted_and_length_maps_to_length(make_client, engine):
    engine.script, engine.finish = [("content", "cut")], "length"
    answer = make_client().post("/v1/chat/completions", json=body()).json()
    assert "reasoning_content" not in answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "length"


def test_tool_call_response(make_client, engine):
    engine.script = [("content", "Checking.\n\n"), ("content", CALL_TEXT)]
    answer = make_client().post("/v1/chat/completions", json=body(tools=[TOOL])).json()
    [choice] = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert re.fullmatch(r"call_[0-9a-f]{16}", call["id"]) and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_tool_call_with_no_prefix_has_null_content(make_client, engine):
    engine.script = [("content", CALL_TEXT)]
    answer = make_client().post("/v1/chat/completions", json=body(tools=[TOOL])).json()
    assert answer["choices"][0]["message"]["content"] is None


def test_tool_markup_without_tools_is_plain_text(make_client, engine):
    engine.script = [("content", CALL_TEXT)]
    answer = make_client().post("/v1/chat/completions", json=body()).json()
    assert answer["choices"][0]["message"]["content"] == CALL_TEXT
    assert answer["choices"][0]["finish_reason"] == "stop"


def stream(client, **fields) -> list[dict]:
    response = client.post("/v1/chat/completions", json=body(stream=True, **fields))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    return chat_chunks(response.text)


def test_stream_sequence_without_usage(make_client, engine):
    engine.script = [("reasoning", "Hmm."), ("content", "Hi"), ("content", "!")]
    chunks = stream(make_client())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"reasoning_content": "Hmm."}
    assert deltas[2:4] == [{"content": "Hi"}, {"content": "!"}]
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_with_include_usage_ends_with_a_usage_chunk(make_client, engine):
    chunks = stream(make_client(), stream_options={"include_usage": True})
    assert all("usage" in c for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_stream_tool_call_is_one_chunk_with_index_then_finish(make_client, engine):
    engine.script = [("content", "Checking."), ("content", "\n\n<tool"), ("content", CALL_TEXT[5:])]
    chunks = stream(make_client(), tools=[TOOL])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    text = "".join(d.get("content", "") for d in deltas)
    assert text == "Checking."
    [tool_delta] = [d for d in deltas if "tool_calls" in d]
    [call] = tool_delta["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_malformed_tool_region_is_flushed_byte_exact(make_client, engine):
    broken = "Sure.\n<tool_call>\n<function=get_weather>\n</tool_call> trailing"
    engine.script = [("content", broken[:8]), ("content", broken[8:])]
    chunks = stream(make_client(), tools=[TOOL])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == broken
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_text_equals_non_stream_text(make_client, engine):
    engine.script = [("reasoning", "a"), ("content", "b"), ("content", "c")]
    client = make_client()
    whole = client.post("/v1/chat/completions", json=body()).json()["choices"][0]["message"]
    chunks = stream(client)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]


def test_models_list_has_one_entry_owned_by_ninfer(make_client):
    client = make_client()
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    [card] = listing["data"]
    assert card["id"] == MODEL_ID and card["owned_by"] == "ninfer" and card["object"] == "model"
    assert client.get(f"/v1/models/{MODEL_ID}").json() == card
    missing = client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_sampling_reaches_the_engine_over_the_model_preset(make_client, engine):
    make_client().post("/v1/chat/completions", json=body(temperature=0.1, seed=7, stop="x"))
    params = engine.requests[-1].params
    assert params.temperature == 0.1 and params.seed == 7 and list(params.stop) == ["x"]
    assert params.top_k == 20 and params.top_p == 0.95  # from the generation config preset


def test_server_no_thinking_default_yields_to_the_request(frontend):
    info = model_info(frontend, thinking_default=False)
    assert parse_chat_request(body(), info).enable_thinking is False
    assert parse_chat_request(body(enable_thinking=True), info).enable_thinking is True

"""OpenAI Responses: input handling, rejected fields, the envelope, the SSE sequence and the
store (upstream checklist §8.2 Responses)."""

from __future__ import annotations

import json

import pytest
from serve_helpers import MODEL_ID, model_info, typed_events

from ninfer.serve.errors import ApiError
from ninfer.serve.response_store import ResponseStore, StoredResponse
from ninfer.serve.responses import items_to_messages, parse_responses_request

CALL_TEXT = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def body(**fields):
    return {"model": MODEL_ID, "input": "Hi", **fields}


def parse(info, store=None, **fields):
    return parse_responses_request(body(**fields), info, store or ResponseStore())


def test_instructions_and_leading_system_items_render_as_one_system_turn(info):
    """`instructions` and developer or system items before the first user turn are one system
    turn for the template (the Qwen3.5 templates take no second one); later ones keep their
    place."""
    items = [
        {"role": "developer", "content": "Work in /repo."},
        {"role": "system", "content": ""},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "Later note."},
    ]
    request = parse(info, instructions="Be brief.", input=items)
    rendered = request.chat.template_messages()
    assert [m["role"] for m in rendered] == ["system", "user", "system"]
    assert rendered[0]["content"] == "Be brief.\n\nWork in /repo."
    assert rendered[2]["content"] == "Later note."


def test_tools_of_one_name_are_refused(info):
    assert "twice" in rejection(info, tools=[TOOL, TOOL]).message


def rejection(info, **fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(info, **fields)
    return caught.value


def test_string_input_becomes_one_user_item_with_a_generated_id(info):
    call = parse(info)
    [item] = call.input_items
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg_")
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]


def test_order_is_instructions_then_previous_context_then_input(info):
    store = ResponseStore()
    parent_body = {"id": "resp_parent", "output": [
        {"id": "msg_a", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Earlier answer", "annotations": []}]},
    ]}  # fmt: skip
    parent_input = [{"id": "msg_q", "type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": "Earlier question"}]}]  # fmt: skip
    store.put(StoredResponse(parent_body, parent_input, preserve_thinking=True))
    call = parse(
        info,
        store,
        instructions="Be brief.",
        previous_response_id="resp_parent",
        input=[
            {"role": "developer", "content": "dev"},
            {"role": "user", "content": "Now?"},
        ],
    )
    messages = call.chat.messages
    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."),
        ("user", "Earlier question"),
        ("assistant", "Earlier answer"),
        ("system", "dev"),
        ("user", "Now?"),
    ]
    assert call.chat.preserve_thinking is True  # inherited from the parent
    assert (
        parse(
            info, store, previous_response_id="resp_parent", preserve_thinking=False
        ).chat.preserve_thinking
        is False
    )
    assert [i["id"] for i in call.input_items][:2] == ["msg_q", "msg_a"]


def test_unknown_previous_response_is_404(info):
    err = rejection(info, previous_response_id="resp_missing")
    assert err.status == 404 and err.code == "response_not_found"


def test_effort_none_disables_thinking_low_resolves_and_others_are_rejected(info, effort_frontend):
    assert parse(info, reasoning={"effort": "none"}).chat.enable_thinking is False
    effort_info = model_info(effort_frontend)
    assert parse(effort_info, reasoning={"effort": "low"}).chat.reasoning_effort == "low"
    assert rejection(effort_info, reasoning={"effort": "high"}).code == (
        "reasoning_effort_not_supported"
    )
    assert rejection(effort_info, reasoning={"effort": "turbo"}).param == "reasoning.effort"
    assert rejection(effort_info, reasoning={"effort": 3}).param == "reasoning.effort"


def test_reasoning_and_adjacent_calls_form_one_assistant_turn_and_outputs_are_tool_turns():
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": "r2"},
    ]
    messages = items_to_messages(items)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    turn = messages[1]
    assert turn.reasoning == "think" and [c.id for c in turn.tool_calls] == ["c1", "c2"]
    assert turn.tool_calls[0].arguments == {"a": 1}


def test_reasoning_with_no_assistant_item_after_it_is_a_turn_of_its_own():
    """An output the limit cut while it reasoned, chained on: its reasoning is the assistant
    turn between the two user turns, not a prefix of the next assistant turn's."""
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q1"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "cut"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q2"}]},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "stray"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "r"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "cut again"}]},
    ]
    messages = items_to_messages(items)
    roles = ["user", "assistant", "user", "assistant", "assistant", "tool", "assistant"]
    assert [m.role for m in messages] == roles
    assert (messages[1].content, messages[1].reasoning) == ("", "cut")
    assert messages[3].reasoning == "r2" and messages[3].tool_calls[0].id == "c1"
    assert (messages[4].content, messages[4].reasoning) == ("", "stray")
    assert (messages[6].content, messages[6].reasoning) == ("", "cut again")


def test_a_call_output_may_be_a_list_of_text_parts(info):
    """`function_call_output.output` is a string or a list of input parts (OpenAI's spec);
    text parts are joined for the tool turn, an image is refused as message content is."""
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    parts = [{"type": "input_text", "text": "sunny"}, {"type": "input_text", "text": "21 C"}]
    output = {"type": "function_call_output", "call_id": "c1", "output": parts}
    request = parse(info, input=[{"role": "user", "content": "q"}, call, output])
    assert request.input_items[-1]["output"] == parts
    assert request.chat.messages[-1].content == "sunny\n21 C"
    image = {**output, "output": [{"type": "input_image", "image_url": "http://x/y.png"}]}
    assert rejection(info, input=[call, image]).code == "vision_disabled"
    assert rejection(info, input=[call, {**output, "output": 3}]).param == "input[1].output"


def test_flat_tool_definitions_are_converted(info):
    call = parse(info, tools=[{**TOOL, "description": "d"}])
    assert call.chat.template_tools() == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object"},
                "description": "d",
            },
        }
    ]


@pytest.mark.parametrize(
    "fields, code",
    [
        ({"tools": [{**TOOL, "strict": True}]}, "strict_tools_not_supported"),
        ({"tool_choice": "required"}, "tool_choice_not_supported"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            "structured_outputs_not_supported",
        ),
        ({"text": {"format": {"type": "json_object"}}}, "structured_outputs_not_supported"),
        ({"background": True}, "background_not_supported"),
        ({"frobnicate": 1}, "unknown_parameter"),
        ({"include": ["reasoning.encrypted_content"]}, "include_not_supported"),
        ({"truncation": "auto"}, "truncation_not_supported"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls_not_supported"),
        ({"service_tier": "flex"}, "service_tier_not_supported"),
        ({"top_logprobs": 2}, "logprobs_not_supported"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_option_not_supported"),
        ({"reasoning": {"summary": "auto"}}, "reasoning_summary_not_supported"),
        (
            {"input": [{"type": "reasoning", "encrypted_content": "x"}]},
            "encrypted_reasoning_not_supported",
        ),
        ({"input": [{"type": "web_search_call"}]}, "item_type_not_supported"),
    ],
)
def test_unsupported_fields_are_rejected_with_their_code(info, fields, code):
    assert rejection(info, **fields).code == code


def test_trivial_values_are_accepted(info):
    parse(
        info,
        text={"format": {"type": "text"}},
        tool_choice="auto",
        parallel_tool_calls=True,
        truncation="disabled",
        top_logprobs=0,
        service_tier="auto",
        background=False,
        include=[],
        stream_options={"include_obfuscation": False},
    )


def test_max_output_tokens_below_16_is_rejected(info):
    assert rejection(info, max_output_tokens=15).param == "max_output_tokens"
    assert parse(info, max_output_tokens=16).chat.max_tokens == 16


def test_duplicate_item_ids_are_rejected(info):
    item = {"id": "msg_1", "role": "user", "content": "x"}
    assert rejection(info, input=[item, item]).param == "input[1].id"


# ---- over HTTP ---------------------------------------------------------------------------


def test_envelope_holds_reasoning_and_message_items_and_usage(make_client, engine, effort_frontend):
    engine.script = [("reasoning", "Think."), ("content", "Answer")]
    client = make_client(chat_frontend=effort_frontend)
    response = client.post("/v1/responses", json=body(reasoning={"effort": "low"})).json()
    assert response["object"] == "response" and response["status"] == "completed"
    assert response["id"].startswith("resp_") and "output_text" not in response
    reasoning, message = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [] and reasoning["content"][0]["text"] == "Think."
    assert message["id"].startswith("msg_") and message["content"][0]["text"] == "Answer"
    assert response["reasoning"]["effort"] == "low"
    usage = response["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == 1
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_hitting_the_limit_is_incomplete_with_reason(make_client, engine):
    engine.finish = "length"
    response = make_client().post("/v1/responses", json=body()).json()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_function_call_item_id_differs_from_call_id(make_client, engine):
    engine.script = [("content", CALL_TEXT)]
    response = make_client().post("/v1/responses", json=body(tools=[TOOL])).json()
    [item] = response["output"]
    assert item["type"] == "function_call" and item["id"].startswith("fc_")
    assert item["call_id"].startswith("call_") and item["id"] != item["call_id"]
    assert json.loads(item["arguments"]) == {"city": "Paris"}


def test_stream_sequence_numbers_ids_and_deltas_rebuild_the_output(make_client, engine):
    engine.script = [
        ("reasoning", "Th"),
        ("reasoning", "ink"),
        ("content", "An"),
        ("content", "swer"),
    ]
    client = make_client()
    response = client.post("/v1/responses", json=body(stream=True))
    assert "[DONE]" not in response.text
    events = typed_events(response.text)
    kinds = [k for k, _ in events]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress"
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert kinds[2:9] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    final = events[-1][1]["response"]
    reasoning_text = "".join(d["delta"] for k, d in events if k == "response.reasoning_text.delta")
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert final["output"][0]["content"][0]["text"] == reasoning_text == "Think"
    assert final["output"][1]["content"][0]["text"] == text == "Answer"
    added_ids = [d["item"]["id"] for k, d in events if k == "response.output_item.added"]
    assert added_ids == [item["id"] for item in final["output"]]
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_stream_function_call_arguments(make_client, engine):
    engine.script = [("content", CALL_TEXT)]
    events = typed_events(
        make_client().post("/v1/responses", json=body(tools=[TOOL], stream=True)).text
    )
    kinds = [k for k, _ in events]
    assert "response.function_call_arguments.delta" in kinds
    args = "".join(d["delta"] for k, d in events if k == "response.function_call_arguments.delta")
    final = events[-1][1]["response"]
    assert final["output"][0]["arguments"] == args


def test_stream_failure_is_one_response_failed(make_client, engine):
    engine.finish = "error"
    events = typed_events(make_client().post("/v1/responses", json=body(stream=True)).text)
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["status"] == "failed"


def test_store_get_input_items_delete(make_client):
    client = make_client()
    first = client.post("/v1/responses", json=body(input=[
        {"role": "user", "content": "one"}, {"role": "user", "content": "two"},
        {"role": "user", "content": "three"},
    ])).json()  # fmt: skip
    page = client.get(f"/v1/responses/{first['id']}/input_items", params={"limit": 2}).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["three", "two"]
    assert page["has_more"] and page["first_id"] == page["data"][0]["id"]
    rest = client.get(
        f"/v1/responses/{first['id']}/input_items", params={"after": page["last_id"]}
    ).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["one"] and not rest["has_more"]
    asc = client.get(f"/v1/responses/{first['id']}/input_items", params={"order": "asc"}).json()
    assert asc["data"][0]["content"][0]["text"] == "one"
    for params in ({"limit": 0}, {"limit": 101}, {"order": "up"}, {"after": "nope"}):
        bad = client.get(f"/v1/responses/{first['id']}/input_items", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_pagination"

    deleted = client.delete(f"/v1/responses/{first['id']}").json()
    assert deleted == {"id": first["id"], "object": "response.deleted", "deleted": True}
    gone = client.get(f"/v1/responses/{first['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


def test_unstored_responses_cannot_be_retrieved_or_chained(make_client):
    client = make_client()
    response = client.post("/v1/responses", json=body(store=False)).json()
    assert response["store"] is False
    assert client.get(f"/v1/responses/{response['id']}").status_code == 404
    chained = client.post("/v1/responses", json=body(previous_response_id=response["id"]))
    assert chained.status_code == 404


def test_input_tokens_is_stateless_and_accepts_only_model_and_input(make_client):
    client = make_client()
    counted = client.post("/v1/responses/input_tokens", json=body()).json()
    assert counted["object"] == "response.input_tokens"
    usage = client.post("/v1/responses", json=body()).json()["usage"]
    assert counted["input_tokens"] == usage["input_tokens"]
    extra = client.post("/v1/responses/input_tokens", json=body(store=False))
    assert extra.status_code == 400 and extra.json()["error"]["code"] == "unknown_parameter"


def test_cancel_and_compact_are_not_supported(make_client):
    client = make_client()
    response = client.post("/v1/responses", json=body()).json()
    cancel = client.post(f"/v1/responses/{response['id']}/cancel")
    assert cancel.status_code == 400
    compact = client.post("/v1/responses/compact", json={})
    assert compact.json()["error"]["code"] == "compaction_not_supported"


# ---- the store ---------------------------------------------------------------------------


def record(response_id: str, size: int = 100) -> StoredResponse:
    return StoredResponse({"id": response_id, "output": []}, [], False, size_bytes=size)


def test_store_rejects_an_oversize_response():
    store = ResponseStore(max_records=4, max_bytes=1000)
    with pytest.raises(ApiError) as caught:
        store.put(record("big", 1001))
    assert caught.value.code == "response_store_capacity_exceeded"


def test_store_evicts_least_recently_used_by_count_and_bytes():
    store = ResponseStore(max_records=2, max_bytes=250)
    store.put(record("a"))
    store.put(record("b"))
    store.get("a")  # now b is the least recently used
    store.put(record("c"))
    assert store.get("b") is None and store.get("a") is not None
    store.put(record("d", 200))
    assert len(store) == 1 and store.get("d") is not None and store.size_bytes == 200


def test_deleted_ids_disappear():
    store = ResponseStore()
    store.put(record("a"))
    assert store.delete("a") and store.get("a") is None and not store.delete("a")
    assert store.size_bytes == 0


def test_reasoning_cut_by_the_limit_is_the_whole_output_in_stream_and_body(make_client, engine):
    """As OpenAI's incomplete responses: no empty message item after the reasoning."""
    engine.script, engine.finish = [("reasoning", "Thinking")], "length"
    client = make_client()
    whole = client.post("/v1/responses", json=body()).json()
    events = typed_events(client.post("/v1/responses", json=body(stream=True)).text)
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.incomplete"
    shape = [(i["type"], i.get("status")) for i in final["output"]]
    assert shape == [(i["type"], i.get("status")) for i in whole["output"]]
    assert shape == [("reasoning", None)]
    done = [d["item"] for k, d in events if k == "response.output_item.done"]
    assert done == final["output"]

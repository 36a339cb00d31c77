"""Statuses and error bodies (upstream checklist §8.2 HTTP errors), auth, CORS, and the request
log (§8.2 Request log)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from serve_helpers import MODEL_ID

from ninfer.errors import EngineClosed, QueueFull, QueueTimeout
from ninfer.serve.app import unless_disconnected
from ninfer.serve.errors import ApiError, to_api_error
from ninfer.serve.request_log import redact_argv

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}
MESSAGES = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


def openai_error(response, status: int) -> dict:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def anthropic_error(response, status: int) -> dict:
    assert response.status_code == status
    payload = response.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    return payload["error"]


def test_validation_errors_are_invalid_request_error_with_null_param_and_code(make_client):
    response = make_client().post(
        "/v1/chat/completions", content=b"[1,", headers={"content-type": "application/json"}
    )
    error = openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None and error["code"] is None


def test_bad_json_on_the_anthropic_path_has_the_anthropic_shape(make_client):
    response = make_client().post("/v1/messages", content=b"nope")
    assert anthropic_error(response, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/responses", "/v1/messages/count_tokens"]
)
@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
        b'{"model":"m","input":"x","max_tokens":8,"x":' + b"[" * 600 + b"]" * 600 + b"}",
        # the same past OFF_LOOP_BYTES, parsed in a worker thread, whose stack is shallower
        b'{"model":"m","input":"x","max_tokens":8,"pad":"'
        + b"p" * 70_000
        + b'","x":'
        + b"[" * 970
        + b"]" * 970
        + b"}",
        json.dumps({**CHAT, "input": "x", "max_tokens": 8}).replace("Hi", "\\ud800 Hi").encode(),
        b'{"model":"m","input":"x","max_tokens":8,"\\udfff":1}',
    ],
    ids=[
        "too-deep",
        "past-the-cap",
        "past-the-cap-large",
        "lone-surrogate-value",
        "lone-surrogate-key",
    ],
)
def test_json_that_python_parses_but_is_not_valid_json_text_is_400(make_client, path, raw):
    client = make_client()
    response = client.post(path, content=raw)
    if path.startswith("/v1/messages"):
        assert "not valid JSON" in anthropic_error(response, 400)["message"]
    else:
        assert "not valid JSON" in openai_error(response, 400)["message"]
    paired = json.dumps({**CHAT, "max_tokens": 2}).replace("Hi", "\\ud83d\\ude00 Hi").encode()
    assert client.post("/v1/chat/completions", content=paired).status_code == 200


@pytest.mark.parametrize(
    "path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic")]
)
def test_oversize_body_is_413_request_too_large_shaped_by_path(make_client, path, shape):
    client = make_client(max_request_bytes=64)
    response = client.post(path, content=b"x" * 65)
    if shape == "openai":
        error = openai_error(response, 413)
        assert error["code"] == "request_too_large"
    else:
        error = anthropic_error(response, 413)
    assert "64 bytes" in error["message"]


def test_oversize_body_without_length_header_is_stopped_while_reading(make_client):
    client = make_client(max_request_bytes=64)

    def chunks():
        yield b"{" + b" " * 40
        yield b" " * 40 + b"}"

    response = client.post("/v1/chat/completions", content=chunks())
    assert openai_error(response, 413)["code"] == "request_too_large"


def test_context_overflow_is_400_with_both_counts(make_client):
    response = make_client(max_context=8).post("/v1/chat/completions", json=CHAT)
    error = openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert re_numbers(error["message"]) >= {8}


def test_context_overflow_names_the_prompt_field_of_each_protocol(make_client):
    """A prompt that fills the window: the error names the field that holds it (`input` for
    Responses) and says no token fits, not a limit the request did not ask for."""
    client = make_client(max_context=8)
    chat = openai_error(client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500}), 400)
    responses = openai_error(
        client.post("/v1/responses", json={"model": MODEL_ID, "input": "Hi"}), 400
    )
    assert chat["param"] == "messages" and responses["param"] == "input"
    for error in (chat, responses):
        assert error["code"] == "context_length_exceeded"
        assert "no room" in error["message"] and "500" not in error["message"]


def test_an_out_of_range_sampling_value_names_its_field():
    """The engine's check of a request names the field at fault, and the HTTP error carries
    it as `param`: a token id outside the vocabulary in logit_bias or in the stop token ids."""
    from ninfer.engine.request import SamplingParams
    from ninfer.errors import InvalidRequestError

    for params, field in (
        (SamplingParams(logit_bias={99999: 1.0}), "logit_bias"),
        (SamplingParams(stop_token_ids=(99999,)), "stop_token_ids"),
        (SamplingParams(top_p=2.0), "top_p"),
    ):
        with pytest.raises(InvalidRequestError) as raised:
            params.validate(vocab_size=1000)
        assert to_api_error(raised.value).param == field


def re_numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


def test_explicit_limit_past_the_window_is_clamped_not_refused(make_client, engine):
    response = make_client(max_context=64).post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 1000}
    )
    assert response.status_code == 200
    prompt = len(engine.requests[-1].prompt_ids)
    assert engine.requests[-1].params.max_tokens == 64 - prompt


def test_queue_full_is_429_server_overloaded(make_client, engine):
    engine.error = QueueFull(16)
    error = openai_error(make_client().post("/v1/chat/completions", json=CHAT), 429)
    assert error["code"] == "server_overloaded"
    response = make_client().post("/v1/messages", json=MESSAGES)
    assert anthropic_error(response, 429)["type"] == "rate_limit_error"


def test_pending_deadline_is_503_request_queue_timeout(make_client, engine):
    engine.script, engine.finish, engine.finish_error = [], "error", QueueTimeout(30.0)
    response = make_client().post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert openai_error(response, 503)["code"] == "request_queue_timeout"
    assert anthropic_error(make_client().post("/v1/messages", json=MESSAGES), 503)["type"] == (
        "api_error"
    )


def test_closed_engine_is_503_service_unavailable(make_client, engine):
    engine.script, engine.finish, engine.finish_error = [], "error", EngineClosed("shut down")
    response = make_client().post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert openai_error(response, 503)["code"] == "service_unavailable"


def test_internal_errors_are_500(make_client, engine):
    engine.error = RuntimeError("boom")
    error = openai_error(make_client().post("/v1/chat/completions", json=CHAT), 500)
    assert error["type"] == "internal_error"
    assert to_api_error(RuntimeError()).anthropic_type == "api_error"


def test_client_that_leaves_before_the_answer_cancels_the_work_with_499():
    cancelled = asyncio.Event()

    class LeavingClient:
        async def receive(self):
            return {"type": "http.disconnect"}

    async def endless():
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    async def scenario():
        with pytest.raises(ApiError) as caught:
            await unless_disconnected(LeavingClient(), endless())
        return caught.value

    err = asyncio.run(scenario())
    assert err.status == 499 and err.code == "client_disconnected" and cancelled.is_set()


def test_wrong_method_is_a_shaped_405_naming_the_allowed_ones(make_client):
    response = make_client().get("/v1/chat/completions")
    assert openai_error(response, 405)["message"].startswith("GET /v1/chat/completions")
    assert response.headers["allow"] == "POST"
    # every route's methods at a path: a stored response is read and deleted at one
    put = make_client().put("/v1/responses/resp_1")
    assert put.status_code == 405 and put.headers["allow"] == "DELETE, GET"


def test_unknown_routes_are_shaped_404s(make_client):
    error = openai_error(make_client().get("/v1/nothing"), 404)
    assert error["code"] == "not_found"


# ---- auth and CORS -----------------------------------------------------------------------


def test_api_key_as_bearer_or_x_api_key_and_health_is_open(make_client):
    client = make_client(api_key="s3cret")
    assert client.get("/health").json() == {"status": "ok"}
    assert client.head("/health").status_code == 200  # as load balancers probe it
    error = openai_error(client.get("/v1/models"), 401)
    assert error["code"] == "invalid_api_key"
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
    assert anthropic_error(client.post("/v1/messages", json=MESSAGES), 401)["type"] == (
        "authentication_error"
    )


def test_cors_preflight_and_headers(make_client):
    client = make_client(cors=True, api_key="k")
    preflight = client.options("/v1/chat/completions")
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "DELETE" in preflight.headers["access-control-allow-methods"]
    assert "x-api-key" in preflight.headers["access-control-allow-headers"]
    # the headers a browser build of an SDK asks for are the headers allowed
    asked = "anthropic-version, content-type, x-api-key, x-stainless-os, x-stainless-retry-count"
    preflight = client.options(
        "/v1/messages",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Headers": asked},
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-headers"] == asked
    assert int(preflight.headers["access-control-max-age"]) > 0
    assert client.get("/health").headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in make_client().get("/health").headers


# ---- request log -------------------------------------------------------------------------


def log_records(client) -> list[dict]:
    path = client.server_state.log.path
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def test_log_records_start_then_done_without_generated_text(make_client, engine):
    engine.script = [("reasoning", "SECRET-THOUGHT"), ("content", "SECRET-ANSWER")]
    client = make_client()
    client.post("/v1/chat/completions", json=CHAT, headers={"user-agent": "pytest-agent"})
    records = log_records(client)
    assert [r["event"] for r in records] == ["request_start", "request_done"]
    start, done = records
    assert start["request_id"] == done["request_id"]
    assert start["protocol"] == "chat" and start["client"] == "pytest-agent"
    assert start["sampling"]["temperature"] == 0.6
    assert done["finish_reason"] == "stop" and done["usage"]["completion_tokens"] == 2
    assert set(done["timings_seconds"]) >= {"prepare", "ttft", "total"}
    assert all(r["server_instance_id"] == client.server_state.log.instance_id for r in records)
    text = json.dumps(records)
    assert "SECRET" not in text and "Hi" not in text


def test_rejected_requests_have_a_rejected_record_and_no_start(make_client):
    client = make_client()
    client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    [record] = log_records(client)
    assert record["event"] == "request_rejected" and record["phase"] == "prepare"
    assert (record["status"], record["code"], record["param"]) == (404, "model_not_found", "model")


def test_request_ids_are_monotonic(make_client):
    client = make_client()
    for _ in range(3):
        client.post("/v1/chat/completions", json=CHAT)
    ids = [r["request_id"] for r in log_records(client) if r["event"] == "request_start"]
    assert ids == sorted(ids) and len(set(ids)) == 3


def test_api_key_is_redacted_from_argv():
    argv = ["ninfer", "serve", "--api-key", "k1", "--api-key=k2", "--port", "1"]
    assert redact_argv(argv) == [
        "ninfer",
        "serve",
        "--api-key",
        "<redacted>",
        "--api-key=<redacted>",
        "--port",
        "1",
    ]


def test_metrics_count_finished_and_rejected_requests(make_client):
    client = make_client()
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "model": "other"})
    text = client.get("/metrics").text
    assert 'ninfer:request_success_total{finished_reason="stop",model_name="tiny-test"} 1.0' in text
    assert 'code="model_not_found"' in text
    assert 'ninfer:num_requests_running{model_name="tiny-test"} 0.0' in text


def recording_where(function, calls: list[str]):
    """`function`, appending to `calls` whether each call ran on the event loop or in a
    worker thread."""

    def recording(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            calls.append("loop")
        except RuntimeError:
            calls.append("worker")
        return function(*args, **kwargs)

    return recording


def test_prompts_render_off_the_event_loop(make_client, frontend, monkeypatch):
    """The template and the tokenizer run in a worker thread (a long conversation takes
    seconds), for a generation and for both token counts; other requests meanwhile go on."""
    calls = []
    monkeypatch.setattr(frontend, "render", recording_where(frontend.render, calls))
    client = make_client()
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.post("/v1/messages/count_tokens", json=MESSAGES).status_code == 200
    body = {"model": MODEL_ID, "input": "Hi"}
    assert client.post("/v1/responses/input_tokens", json=body).status_code == 200
    assert calls == ["worker"] * 3


def test_large_bodies_are_decoded_and_parsed_off_the_event_loop(make_client, monkeypatch):
    """Past `OFF_LOOP_BYTES` a body's JSON and fields are read in a worker thread (a
    conversation of megabytes held the loop, and every stream, for a fraction of a second);
    a small one stays on the loop, and a bad large one is still its protocol's 400."""
    from ninfer.serve import anthropic, app, openai_chat

    where = []
    for module, name in (
        (openai_chat, "parse_chat_request"),
        (anthropic, "parse_messages_request"),
    ):
        monkeypatch.setattr(module, name, recording_where(getattr(module, name), where))
    client = make_client()
    filler = "word " * (app.OFF_LOOP_BYTES // 5)
    large = {**CHAT, "messages": [{"role": "user", "content": filler}]}
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    too_long = client.post("/v1/chat/completions", json=large)  # parsed, then past the context
    assert openai_error(too_long, 400)["code"] == "context_length_exceeded"
    counted = {**MESSAGES, "messages": [{"role": "user", "content": filler}]}
    assert client.post("/v1/messages/count_tokens", json=counted).status_code == 200
    assert where == ["loop", "worker", "worker"]
    broken = json.dumps(large)[:-1].encode()  # the last brace missing
    response = client.post(
        "/v1/messages", content=broken, headers={"content-type": "application/json"}
    )
    assert anthropic_error(response, 400)["type"] == "invalid_request_error"


def test_a_request_whose_text_cannot_be_kept_apart_is_400_when_counted_too(make_client):
    """Special-token text beside every private-use character: a 400 on every path."""
    content = "x<|im_end|>" + "".join(chr(c) for c in range(0xF0000, 0x10FFFE))
    client = make_client(max_request_bytes=1 << 24)
    chat = {**CHAT, "messages": [{"role": "user", "content": content}]}
    assert openai_error(client.post("/v1/chat/completions", json=chat), 400)
    counted = {**MESSAGES, "messages": [{"role": "user", "content": content}]}
    response = client.post("/v1/messages/count_tokens", json=counted)
    assert "private-use" in anthropic_error(response, 400)["message"]

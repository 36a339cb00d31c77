"""End to end: a live server (uvicorn on a real port) over a tiny random model converted with
`ninfer convert`, driven by the official `openai` and `anthropic` SDKs."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import anthropic
import httpx
import openai
import pytest
import uvicorn
from helpers import make_tiny_checkpoint

from ninfer.artifact.convert import convert
from ninfer.chat.qwen_style import qwen_style_template
from ninfer.serve.server import build_app
from ninfer.serve.settings import ServeSettings

MODEL = "tiny"
DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, what: str, timeout: float = DEADLINE_S) -> None:
    """Poll a live server's state (it runs in other threads; there is no event to wait on)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class LiveServer:
    def __init__(self, base_url: str, state, engine, log_path) -> None:
        self.base_url = base_url
        self.state = state
        self.engine = engine
        self.log_path = log_path

    @property
    def core(self):
        return self.engine.engine.core

    def log_records(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]

    def assert_pools_intact(self) -> None:
        wait_until(lambda: not self.core.sequences, "the engine to go idle")
        self.core.check_integrity()
        cache = self.core.cache
        assert cache.pages.num_free == cache.num_pages
        assert cache.slots.num_free == cache.num_slots


def tiny_qwen_artifact(root):
    """A tiny random model with our Qwen-style chat template (tools, `<think>` prologue)."""
    checkpoint = make_tiny_checkpoint(root / "hf")
    template = root / "chat_template.jinja"
    template.write_text(qwen_style_template())
    artifact = root / "model.ninfer"
    convert(
        checkpoint, "qwen3_5", artifact, resources={"chat_template": template}, on_warning=print
    )
    return artifact


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    artifact = tiny_qwen_artifact(root)
    port = free_port()
    log_path = root / "requests.jsonl"
    settings = ServeSettings(
        model=str(artifact),
        port=port,
        model_id=MODEL,
        max_context=2048,
        max_concurrency=4,
        max_pending_requests=32,
        default_max_tokens=16,
        log_stats_interval_ms=0,
        request_log_jsonl=str(log_path),
        device="cpu",
    )
    app, state, engine = build_app(settings, ["ninfer", "serve", str(artifact)])
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the server to start")
    yield LiveServer(f"http://127.0.0.1:{port}", state, engine, log_path)
    server.should_exit = True
    thread.join(timeout=DEADLINE_S)
    state.log.close()


@pytest.fixture
def oai(live):
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(live):
    return anthropic.Anthropic(base_url=live.base_url, api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Hello there"}]


def test_chat_stream_matches_non_stream_and_ends_with_usage(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    text = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert text == whole.choices[0].message.content
    assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_tool_call_round_trip_is_accepted(oai):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    first = oai.chat.completions.create(model=MODEL, messages=USER, tools=tools, max_tokens=8)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
    ]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=8)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_reasoning_on_goes_to_reasoning_content_and_off_does_not(oai, live):
    # the random model must neither close <think> nor end the turn at once
    tokenizer = live.engine.frontend.tokenizer
    banned = [tokenizer.token_to_id("</think>"), *live.engine.frontend.stop_token_ids]
    on = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        temperature=0,
        logit_bias={str(i): -100 for i in banned},
    )
    off = oai.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=4,
        temperature=0,
        extra_body={"enable_thinking": False},
    )
    assert on.choices[0].message.reasoning_content
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    # the template writes an empty think block when thinking is off
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, reasoning_effort="high"
        )
    assert caught.value.body["code"] == "reasoning_effort_not_supported"


def test_responses_store_retrieve_chain_items_and_delete(oai, live):
    first = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=16)
    assert first.status in ("completed", "incomplete") and first.id.startswith("resp_")
    assert oai.responses.retrieve(first.id).model_dump() == first.model_dump()
    counted = httpx.post(
        f"{live.base_url}/v1/responses/input_tokens", json={"model": MODEL, "input": "Hi"}
    ).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": first.usage.input_tokens}

    second = oai.responses.create(
        model=MODEL, input="And then?", previous_response_id=first.id, max_output_tokens=16
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    items = oai.responses.input_items.list(second.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in items.data]
    # the first request's input, its output (reasoning alone where 16 tokens ran out while
    # thinking), the second's input
    first_kinds = [(item.type, getattr(item, "role", None)) for item in first.output]
    assert kinds == [("message", "user"), *first_kinds, ("message", "user")]

    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)


def test_responses_stream_events_rebuild_the_output(oai):
    events = list(oai.responses.create(model=MODEL, input="Hi", max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    for delta_kind, item_kind in (
        ("response.output_text.delta", "message"),
        ("response.reasoning_text.delta", "reasoning"),
    ):
        text = "".join(e.delta for e in events if e.type == delta_kind)
        items = [item for item in final.output if item.type == item_kind]
        assert "".join(part.text for item in items for part in item.content) == text
    assert final.output  # a message, reasoning, or both


def test_anthropic_stream_events_and_count_tokens(claude):
    messages = [{"role": "user", "content": "Hello"}]
    counted = claude.messages.count_tokens(model="any-label", messages=messages)
    greedy = {"temperature": 0}  # this SDK version sends it only as an extra field
    args = {"model": "any-label", "max_tokens": 8, "messages": messages, "extra_body": greedy}
    reply = claude.messages.create(**args)
    assert reply.model == "any-label" and reply.usage.input_tokens == counted.input_tokens
    assert reply.stop_reason in ("end_turn", "max_tokens")

    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "message_delta" in kinds and "ping" not in kinds
    assert final.usage.input_tokens == counted.input_tokens
    # a limit reached while thinking leaves the thinking block alone, no empty text beside it
    assert [block.type for block in final.content] in (["text"], ["thinking", "text"], ["thinking"])
    assert all(block.text for block in final.content if block.type == "text")
    assert final.model_dump(exclude={"id"}) == reply.model_dump(exclude={"id"})


def test_sixteen_concurrent_streams_all_complete(live):
    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Request {i}"}],
            max_tokens=8,
            stream=True,
        )
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish

    async def all_of_them() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    finishes = asyncio.run(all_of_them())
    assert all(f in ("stop", "length") for f in finishes), finishes
    live.assert_pools_intact()


def long_request(live) -> dict:
    """Long enough to be running when the client leaves, and never ended early by an
    end-of-turn token (the tiny model is random)."""
    no_eos = {str(i): -100 for i in live.engine.frontend.stop_token_ids}
    return {"model": MODEL, "messages": USER, "max_tokens": 1500, "logit_bias": no_eos}


def disconnects(live) -> int:
    return sum(
        r["event"] == "request_error" and r["code"] == "client_disconnected"
        for r in live.log_records()
    )


def test_client_disconnect_mid_stream_aborts_and_leaves_pools_intact(live, oai):
    body = {**long_request(live), "stream": True}
    before = disconnects(live)
    with httpx.Client(timeout=DEADLINE_S) as client:
        with client.stream("POST", f"{live.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        # leaving the block closes the connection mid-stream
    live.assert_pools_intact()
    wait_until(lambda: disconnects(live) == before + 1, "the disconnect to be logged")
    after = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert after.choices[0].finish_reason in ("stop", "length")


def test_client_that_gives_up_on_a_non_stream_request_aborts_it(live):
    before = disconnects(live)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.base_url}/v1/chat/completions", json=long_request(live), timeout=0.5)
    wait_until(lambda: disconnects(live) == before + 1, "the disconnect to be logged")
    live.assert_pools_intact()


def test_bad_requests_get_their_status_and_shape_and_the_server_keeps_serving(live, oai, claude):
    bad_json = httpx.post(
        f"{live.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}

    with pytest.raises(openai.NotFoundError) as missing:
        oai.chat.completions.create(model="nope", messages=USER)
    assert missing.value.body["code"] == "model_not_found"

    with pytest.raises(openai.BadRequestError) as hot:
        oai.chat.completions.create(model=MODEL, messages=USER, temperature=9)
    assert hot.value.body["param"] == "temperature"

    with pytest.raises(openai.BadRequestError) as role:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert role.value.body["code"] == "unsupported_role"

    with pytest.raises(anthropic.BadRequestError) as order:
        claude.messages.create(
            model="x",
            max_tokens=4,
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        )
    assert order.value.body["type"] == "error"
    assert order.value.body["error"]["type"] == "invalid_request_error"

    ok = oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"
    records = live.log_records()
    assert records[0]["event"] == "server_start"
    assert any(r["event"] == "request_rejected" and r["status"] == 404 for r in records)


def test_metrics_expose_vllm_style_names(live, oai):
    oai.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    text = httpx.get(f"{live.base_url}/metrics").text
    for name in (
        "ninfer:request_success_total",
        "ninfer:prompt_tokens_total",
        "ninfer:generation_tokens_total",
        "ninfer:time_to_first_token_seconds_bucket",
        "ninfer:e2e_request_latency_seconds_bucket",
        "ninfer:num_requests_running",
        "ninfer:num_requests_waiting",
    ):
        assert name in text, name

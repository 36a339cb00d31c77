"""The public engine: the threaded `Engine`, request handles and `AsyncEngine` streaming, on the
tiny fp32 artifact."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

import ninfer
from ninfer.engine.request import GenerationRequest, SamplingParams, TokenEvent
from ninfer.errors import (
    ContextLengthExceeded,
    EngineClosed,
    EngineError,
    QueueFull,
    QueueTimeout,
)

GREEDY = SamplingParams.greedy(max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(artifact_path):
    with ninfer.Engine(artifact_path, device="cpu", dtype="float32", max_context=512) as eng:
        yield eng
    eng.core.check_integrity()
    assert eng.core.cache.pages.num_free == eng.core.cache.num_pages


def test_generate_returns_completions_in_prompt_order(engine):
    single = engine.generate([5, 6, 7], GREEDY)
    batch = engine.generate([[5, 6, 7], [8, 9], [1] * 30], GREEDY)
    assert batch[0].token_ids == single.token_ids
    assert [len(c.token_ids) for c in batch] == [8, 8, 8]
    assert all(c.finish_reason == "length" and c.usage.completion_tokens == 8 for c in batch)


def test_generate_feeds_more_prompts_than_the_queue_holds(artifact_path):
    with ninfer.Engine(
        artifact_path, device="cpu", max_concurrency=2, max_pending_requests=1
    ) as eng:
        results = eng.generate([[i + 1, i + 2] for i in range(7)], GREEDY)
    assert len(results) == 7 and all(len(r.token_ids) == 8 for r in results)


def test_text_prompt_is_tokenized_and_answer_detokenized(engine):
    done = engine.generate("Hello", SamplingParams.greedy(max_tokens=6, ignore_eos=True))
    assert done.content == engine.tokenizer.decode(done.token_ids)
    assert done.usage.prompt_tokens == len(engine.tokenizer.encode("Hello"))


def test_handle_streams_events_until_the_last(engine):
    handle = engine.submit(GenerationRequest([1, 2, 3], GREEDY))
    events = list(handle)
    assert [len(e.token_ids) for e in events] == [1] * 8
    assert events[-1].finish_reason == "length" and events[-1].timings.total > 0
    assert not any(e.finished for e in events[:-1])


def test_submit_checks_limits_in_the_callers_thread(engine):
    with pytest.raises(ContextLengthExceeded):
        engine.submit(GenerationRequest([1] * 500, SamplingParams(max_tokens=100)))


def test_queue_full_when_lanes_and_pending_slots_are_taken(artifact_path):
    release = threading.Event()
    first_event = threading.Event()

    def blocking_sink(event: TokenEvent) -> None:
        # holds the engine thread on the first request's first event, so nothing finishes
        first_event.set()
        release.wait()

    eng = ninfer.Engine(artifact_path, device="cpu", max_concurrency=1, max_pending_requests=1)
    try:
        eng.submit(GenerationRequest([1, 2], GREEDY), sink=blocking_sink)
        first_event.wait()
        pending = eng.submit(GenerationRequest([3, 4], GREEDY))
        with pytest.raises(QueueFull, match="1 requests pending"):
            eng.submit(GenerationRequest([5, 6], GREEDY))
        release.set()
        assert len(pending.result().token_ids) == 8
        assert len(eng.submit(GenerationRequest([5, 6], GREEDY)).result().token_ids) == 8
    finally:
        release.set()
        eng.close()


def test_pending_deadline_fails_a_request_that_never_started(artifact_path):
    eng = ninfer.Engine(artifact_path, device="cpu", max_concurrency=1, pending_timeout=0.01)
    with eng:
        long = eng.submit(
            GenerationRequest([1], SamplingParams.greedy(max_tokens=300, ignore_eos=True))
        )
        waiting = eng.submit(GenerationRequest([2], GREEDY))
        with pytest.raises(QueueTimeout):
            waiting.result()
        assert len(long.result().token_ids) == 300


def test_a_request_whose_start_fails_ends_with_the_error_and_the_next_runs(engine, monkeypatch):
    """Its start fails after its pages were taken (a bug or a device failure): it ends with an
    EngineError, holding nothing (the fixture checks every page is back), and the engine
    serves the next request."""
    slots = engine.core.cache.slots
    allocate = slots.allocate
    calls = []

    def fails_once(owner):
        calls.append(owner)
        if len(calls) == 1:
            raise TypeError("a slot allocation that fails")
        return allocate(owner)

    monkeypatch.setattr(slots, "allocate", fails_once)
    with pytest.raises(EngineError, match="a slot allocation that fails"):
        engine.generate([5, 6, 7], GREEDY)
    assert len(engine.generate([5, 6, 7], GREEDY).token_ids) == 8


def test_steps_that_keep_failing_end_the_requests_instead_of_hanging(engine, monkeypatch):
    """A failure the step cannot pin on a batch, twice in a row: every live request ends with
    it, and the engine stays up."""
    step = engine.core.step
    failing = [True]

    def broken_step():
        if failing[0]:
            raise RuntimeError("a step that fails before any batch")
        return step()

    monkeypatch.setattr(engine.core, "step", broken_step)
    handle = engine.submit(GenerationRequest([1, 2], GREEDY))
    with pytest.raises(EngineError, match="a step that fails before any batch"):
        handle.result()
    failing[0] = False
    assert len(engine.generate([1, 2], GREEDY).token_ids) == 8


def test_abort_from_another_thread_ends_the_stream(engine):
    handle = engine.submit(
        GenerationRequest([1, 2], SamplingParams.greedy(max_tokens=400, ignore_eos=True))
    )
    events = []
    for event in handle:
        events.append(event)
        if len(events) == 2:
            threading.Thread(target=handle.abort).start()
    assert events[-1].finish_reason == "abort"
    assert len(events) < 400


def test_close_ends_running_requests_with_engine_closed(artifact_path):
    eng = ninfer.Engine(artifact_path, device="cpu")
    handle = eng.submit(
        GenerationRequest([1], SamplingParams.greedy(max_tokens=400, ignore_eos=True))
    )
    next(iter(handle))
    eng.close()
    with pytest.raises(EngineClosed):
        handle.result()
    with pytest.raises(EngineClosed):
        eng.submit(GenerationRequest([1], GREEDY))


def test_async_engine_streams_deltas_finish_usage_and_timings(artifact_path):
    async def main():
        async with ninfer.AsyncEngine(artifact_path, device="cpu") as engine:
            params = SamplingParams(max_tokens=10, seed=7, ignore_eos=True)
            events = [e async for e in engine.generate(GenerationRequest([1, 2, 3], params))]
            again = await engine.complete(GenerationRequest([1, 2, 3], params))
            return engine, events, again

    engine, events, again = asyncio.run(main())
    last = events[-1]
    assert [t for e in events for t in e.token_ids] == again.token_ids
    assert "".join(e.content for e in events) == again.content
    assert last.finish_reason == "length" and last.usage.completion_tokens == 10
    assert last.timings.ttft > 0
    engine.engine.core.check_integrity()


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_leaving_an_async_stream_early_aborts_the_request(artifact_path, how):
    async def main():
        engine = ninfer.AsyncEngine(artifact_path, device="cpu")
        request = GenerationRequest([1], SamplingParams.greedy(max_tokens=400, ignore_eos=True))
        stream = engine.submit(request)
        if how == "break":
            async for _ in stream:
                break
        else:  # what a server sees when its client disconnects
            started = asyncio.Event()

            async def consume():
                async for _ in stream:
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        rest = [event async for event in stream]  # the events still in flight, then the end
        await engine.aclose()
        return engine, rest

    engine, rest = asyncio.run(main())
    assert rest[-1].finish_reason == "abort"
    assert sum(len(e.token_ids) for e in rest) < 399
    engine.engine.core.check_integrity()


def test_chat_renders_the_template_and_splits_nothing_without_think(engine):
    done = engine.chat(
        [{"role": "user", "content": "hi"}],
        SamplingParams.greedy(max_tokens=5, ignore_eos=True),
        enable_thinking=False,
    )
    assert done.usage.prompt_tokens > 5
    assert done.content + done.reasoning != "" or done.token_ids

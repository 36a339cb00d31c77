"""The public engine: the threaded `Engine`, request handles and `AsyncEngine` streaming, on the
tiny fp32 artifact."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest

import ninfer
from ninfer.engine.request import GenerationRequest, SamplingParams, TokenEvent
from ninfer.errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    EngineError,
    InvalidRequestError,
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


def test_an_id_submitted_again_right_after_its_abort_runs_once_the_first_has_ended(engine):
    """Abort, then submit under the same id at once: the second request waits for the first
    to end (its abort takes effect at a step boundary) instead of being refused as already
    running."""
    long = SamplingParams.greedy(max_tokens=400, ignore_eos=True)
    first = engine.submit(GenerationRequest([1, 2], long, request_id="same"))
    next(iter(first))
    engine.abort("same")
    second = engine.submit(GenerationRequest([3, 4], GREEDY, request_id="same"))
    assert first.result().finish_reason == "abort"
    completion = second.result()
    assert completion.finish_reason == "length" and len(completion.token_ids) == 8


def _hold_the_next_step(engine) -> tuple[threading.Event, threading.Event]:
    """(release, entered): the engine thread waits inside its next step until released, so
    that commands sent meanwhile are taken together after it."""
    release, entered = threading.Event(), threading.Event()
    step = engine.core.step

    def held():
        entered.set()
        release.wait(30)
        engine.core.step = step
        return step()

    engine.core.step = held
    return release, entered


def _first_aborted_inside_a_step(engine, request_id: str):
    """(events, release): a long request under `request_id`, aborted while the engine thread
    is held inside a step (so that what is sent next is taken with the abort, before the
    aborted request has ended); its remaining events, and the step's release."""
    long = SamplingParams.greedy(max_tokens=300, ignore_eos=True)
    first = engine.submit(GenerationRequest([1, 2], long, request_id=request_id))
    events = iter(first)
    next(events)
    release, entered = _hold_the_next_step(engine)
    assert entered.wait(30)
    first.abort()
    return events, release


@pytest.mark.parametrize("how", ["handle", "id"])
def test_a_request_waiting_for_an_aborted_id_can_itself_be_aborted(engine, how):
    """The second request waits behind the first's abort; aborting it there (its handle, or
    the id) ends it too, rather than the abort reaching only the first."""
    events, release = _first_aborted_inside_a_step(engine, "x")
    long = SamplingParams.greedy(max_tokens=300, ignore_eos=True)
    second = engine.submit(GenerationRequest([3, 4], long, request_id="x"))
    second.abort() if how == "handle" else engine.abort("x")
    release.set()
    assert list(events)[-1].finish_reason == "abort"
    assert second.result().finish_reason == "abort"


def test_requests_behind_a_waiting_one_keep_their_order(engine):
    """A request waiting for an aborted id holds back those submitted after it, so lanes go
    in submission order."""
    events, release = _first_aborted_inside_a_step(engine, "a")
    admitted = []
    add = engine.core.add
    engine.core.add = lambda request, *rest: (
        admitted.append(request.request_id) or add(request, *rest)
    )
    handles = [engine.submit(GenerationRequest([3], GREEDY, request_id=i)) for i in "abc"]
    release.set()
    assert list(events)[-1].finish_reason == "abort"
    assert [h.result().finish_reason for h in handles] == ["length"] * 3
    assert admitted == ["a", "b", "c"]


def test_a_handles_late_abort_leaves_a_later_request_with_its_id_alone(engine):
    """A handle aborts its own request only: one that finished unread, aborted after a new
    request took its id, does not end the new one."""
    ended = threading.Event()
    request = GenerationRequest([1, 2], GREEDY, request_id="reused")
    done = engine.submit(request, sink=lambda event: event.finished and ended.set())
    assert ended.wait(60)  # ended on the engine thread; the handle has read nothing
    later = engine.submit(
        GenerationRequest([3], SamplingParams.greedy(max_tokens=40, ignore_eos=True), "reused")
    )
    done.abort()  # not finished as far as the handle knows
    assert later.result().finish_reason == "length"


def test_a_handles_late_abort_leaves_a_resubmission_of_the_same_request_alone(engine):
    """The same `GenerationRequest` submitted twice (a retry keeps its id): the first
    handle's late abort ends only the first submission."""
    ended = threading.Event()
    request = GenerationRequest([1, 2], SamplingParams.greedy(max_tokens=40, ignore_eos=True))
    first = engine.submit(request, sink=lambda event: event.finished and ended.set())
    assert ended.wait(60)
    retry = engine.submit(request)
    first.abort()
    assert retry.result().finish_reason == "length"


def test_an_engine_dropped_without_close_is_collected_and_stops_its_thread(artifact_path):
    """The engine thread holds no reference to its `Engine`: one dropped without `close()`
    (a notebook cell run again) is collected, and its thread ends with it."""
    eng = ninfer.Engine(artifact_path, device="cpu", dtype="float32", max_context=512)
    assert len(eng.generate([1, 2], GREEDY).token_ids) == 8
    thread, dropped = eng._worker.thread, weakref.ref(eng)
    del eng
    gc.collect()
    assert dropped() is None
    thread.join(30)
    assert not thread.is_alive()


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


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"request_id": ["x"]}, "request_id"),
        ({"request_id": None}, "request_id"),
        ({"prompt_ids": [1.5, 2.0]}, "prompt_ids"),
        ({"prompt_ids": [True, False]}, "prompt_ids"),
        ({"params": None}, "params must be SamplingParams"),
        ({"params": SamplingParams(top_k=2.5)}, "top_k"),
        ({"params": SamplingParams(max_tokens=2.5)}, "max_tokens"),
        ({"params": SamplingParams(logprobs=True)}, "logprobs"),
        ({"params": SamplingParams(temperature="0.5")}, "temperature"),
        ({"params": SamplingParams(stop="return")}, "a string would be its characters"),
        ({"params": SamplingParams(stop_token_ids=None)}, "stop_token_ids"),
        ({"params": SamplingParams(logit_bias=[1, 2])}, "logit_bias"),
        ({"params": SamplingParams(logit_bias={13: "1"})}, "logit_bias"),
        ({"params": SamplingParams(ignore_eos="no")}, "ignore_eos"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_at_submit_and_others_run_on(
    engine, request_fields, message
):
    """A wrong type used to pass the checks and fail inside the engine: an unhashable or None
    id killed the engine thread or freed page 0, a float top_k failed steps (two in a row end
    every request)."""
    other = engine.submit(GenerationRequest([1, 2, 3], GREEDY))
    fields = {"prompt_ids": [1, 2], "params": GREEDY, **request_fields}
    with pytest.raises(InvalidRequestError, match=message):
        engine.submit(GenerationRequest(**fields))
    assert len(other.result().token_ids) == 8


def _close_while_submitting(artifact_path) -> bool:
    """Eight threads submit until the engine refuses; whether every handle then ends."""
    eng = ninfer.Engine(artifact_path, device="cpu", max_pending_requests=10**7)
    handles, stop = [], threading.Event()

    def submitting():
        while not stop.is_set():
            try:
                handles.append(eng.submit(GenerationRequest([1, 2], GREEDY)))
            except EngineClosed:
                return
            except QueueFull:
                pass

    threads = [threading.Thread(target=submitting) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    eng.close()
    stop.set()
    for thread in threads:
        thread.join()
    ended = threading.Event()

    def drain():
        for handle in handles:
            with contextlib.suppress(EngineClosed):
                handle.result()
        ended.set()

    threading.Thread(target=drain, daemon=True).start()
    return ended.wait(30)


def test_submit_racing_close_leaves_no_handle_unended(artifact_path):
    """Requests queued while `close` runs end with `EngineClosed`; none is left waiting. (On
    this machine the race's window is too narrow for the test to force; a reproducer on the
    shipped model left 3 handles hanging in 6 trials before.)"""
    for _ in range(3):
        assert _close_while_submitting(artifact_path), "a handle never ended"


def test_generate_on_a_queue_full_of_others_requests_raises_queue_full(artifact_path):
    release = threading.Event()
    eng = ninfer.Engine(artifact_path, device="cpu", max_concurrency=1, max_pending_requests=0)
    try:
        eng.submit(GenerationRequest([1, 2], GREEDY), sink=lambda event: release.wait())
        with pytest.raises(QueueFull):
            eng.generate([3, 4], GREEDY)
    finally:
        release.set()
        eng.close()


def test_a_batch_that_fails_leaves_none_of_its_requests_running(artifact_path):
    long = SamplingParams.greedy(max_tokens=4000, ignore_eos=True)
    with ninfer.Engine(artifact_path, device="cpu", max_concurrency=1, max_context=4096) as eng:
        with pytest.raises(ContextLengthExceeded):
            eng.generate([[1, 2], [3] * 5000], long)
        started = time.monotonic()
        done = eng.submit(GenerationRequest([5, 6], GREEDY)).result()
        # the batch's first prompt was aborted, not left to run its 4000 tokens (over 10 s
        # here) ahead of the next request
        assert time.monotonic() - started < 5 and len(done.token_ids) == 8


def test_an_engine_left_open_at_exit_is_closed_cleanly(artifact_path):
    script = (
        "import ninfer\n"
        f"e = ninfer.Engine({str(artifact_path)!r}, device='cpu')\n"
        "e.submit(ninfer.GenerationRequest([1, 2, 3], ninfer.SamplingParams(max_tokens=300)))\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()[-500:]


def test_timings_count_from_submit_including_the_step_already_running(artifact_path):
    """A request handed over while the engine thread is inside a long step: its queue time,
    ttft and total include that wait (they counted from when the thread picked it up)."""
    config = {"device": "cpu", "max_context": 4096, "prefill_chunk": 4096}
    with ninfer.Engine(artifact_path, **config) as eng:
        eng.submit(GenerationRequest([5] * 4000, SamplingParams(max_tokens=1)))
        time.sleep(0.05)  # the engine thread is in the 4000-token prefill now
        started = time.perf_counter()
        done = eng.submit(GenerationRequest([1, 2, 3], GREEDY)).result()
        wall = time.perf_counter() - started
    assert done.timings.total >= 0.9 * wall
    assert done.timings.queue >= 0.5 * (wall - done.timings.prefill - done.timings.decode)


def test_generate_returns_the_text_as_generated(engine, monkeypatch):
    """A raw completion is not a chat turn: no reasoning split and no leading whitespace
    trimmed, so the prompt followed by the text is the whole string."""
    requests = []
    submit = engine.submit

    def recording(request, sink=None):
        requests.append(request)
        return submit(request, sink)

    monkeypatch.setattr(engine, "submit", recording)
    params = [SamplingParams(max_tokens=4, seed=seed, ignore_eos=True) for seed in range(20)]
    for p in params:
        done = engine.generate("Hello", p)
        assert done.text == engine.tokenizer.decode(done.token_ids) and not done.reasoning
    assert all(not request.split_reasoning for request in requests)


def test_leaving_a_handles_loop_early_aborts_the_request(engine):
    long = SamplingParams.greedy(max_tokens=400, ignore_eos=True)
    handle = engine.submit(GenerationRequest([1, 2, 3], long))
    for _ in handle:
        break
    started = time.monotonic()
    done = engine.submit(GenerationRequest([5, 6], GREEDY)).result()
    assert len(done.token_ids) == 8 and time.monotonic() - started < 5
    assert engine._worker.live == 0


def test_result_after_the_events_were_iterated_returns_them_all_again(artifact_path):
    """`result()` after iterating, or called twice, gives the whole completion (it gave an
    empty one); a failed request raises its error each time."""
    with ninfer.Engine(artifact_path, device="cpu") as eng:
        handle = eng.submit(GenerationRequest([1, 2, 3], GREEDY))
        events = list(handle)
        first, second = handle.result(), handle.result()
        assert first.token_ids == [t for e in events for t in e.token_ids] == second.token_ids
        assert first.finish_reason == "length" and first.usage.completion_tokens == 8
        long = SamplingParams.greedy(max_tokens=400, ignore_eos=True)
        failing = eng.submit(GenerationRequest([1, 2], long))
    for _ in range(2):
        with pytest.raises(EngineClosed):
            failing.result()


@pytest.mark.parametrize(
    "call",
    [
        lambda eng: eng.generate(None),
        lambda eng: eng.generate(5),
        lambda eng: eng.generate([1.5, 2.0]),
        lambda eng: eng.generate([1, 2], {"max_tokens": 3}),
        lambda eng: eng.chat("hello"),
        lambda eng: eng.chat(["hi"]),
    ],
)
def test_arguments_of_the_wrong_type_are_invalid_requests(engine, call):
    with pytest.raises(InvalidRequestError):
        call(engine)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_context": "4096"},
        {"max_context": 100.5},
        {"max_concurrency": True},
        {"pending_timeout": "1"},
        {"cuda_graph": "no"},
        {"idle_prefill_chunk": 2.0},
        {"kv_capacity": 4096.0},
        {"gdn_state_dtype": None},
        {"gdn_state_dtype": "float16"},
        {"gdn_state_dtype": "fp32"},
    ],
)
def test_engine_settings_of_the_wrong_type_are_config_errors(fields):
    from ninfer.engine.config import EngineConfig

    with pytest.raises(ConfigError, match=next(iter(fields))):
        EngineConfig(**fields)

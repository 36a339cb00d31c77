"""The engine step loop on a tiny random model (CPU, fp32), driven one step at a time: batching
is invisible in the tokens, aborts release everything, limits raise typed errors, sampling is
reproducible, and text, usage and timings reach the events."""

from __future__ import annotations

import random

import pytest
import torch

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Completion
from ninfer.engine.request import GenerationRequest, SamplingParams, TokenEvent
from ninfer.engine.sequence import Status
from ninfer.errors import ConfigError, ContextLengthExceeded, InvalidRequestError


def prompt(length: int, seed: int) -> list[int]:
    gen = random.Random(seed)
    return [gen.randrange(256) for _ in range(length)]  # byte tokens of the tiny tokenizer


class Recorder:
    """Collects each request's events into a Completion."""

    def __init__(self) -> None:
        self.completions: dict[str, Completion] = {}
        self.events: list[TokenEvent] = []

    def sink_for(self, request_id: str):
        self.completions[request_id] = Completion(request_id)

        def sink(event: TokenEvent) -> None:
            self.events.append(event)
            self.completions[request_id].add(event)

        return sink


def submit(core, recorder: Recorder, request: GenerationRequest):
    return core.add(request, recorder.sink_for(request.request_id))


def run_to_end(core) -> None:
    while core.step():
        core.check_integrity()
    core.check_integrity()
    assert core.cache.pages.num_free == core.cache.num_pages
    assert core.cache.slots.num_free == core.cache.num_slots


def generate(core, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, list[int]]:
    recorder = Recorder()
    for request_id, ids in prompts.items():
        submit(core, recorder, GenerationRequest(ids, params, request_id=request_id))
    run_to_end(core)
    return {rid: c.token_ids for rid, c in recorder.completions.items()}


GREEDY = SamplingParams.greedy(max_tokens=12, ignore_eos=True)


def test_requests_batched_together_give_the_tokens_each_gives_alone(make_core, hf_model):
    prompts = {"a": prompt(3, 1), "b": prompt(40, 2), "c": prompt(70, 3), "d": prompt(130, 4)}
    together = generate(make_core(max_context=256, prefill_chunk=32), prompts, GREEDY)
    for request_id, ids in prompts.items():
        alone = generate(make_core(max_context=256), {request_id: ids}, GREEDY)
        assert together[request_id] == alone[request_id]
    for request_id in ("a", "d"):
        ids = prompts[request_id]
        reference = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
        assert together[request_id] == reference[0, len(ids) :].tolist()


def test_requests_arriving_mid_decode_do_not_change_the_others(make_core):
    prompts = {"a": prompt(20, 5), "b": prompt(90, 6)}
    expected = {rid: generate(make_core(), {rid: ids}, GREEDY)[rid] for rid, ids in prompts.items()}
    core = make_core(prefill_chunk=16)
    recorder = Recorder()
    submit(core, recorder, GenerationRequest(prompts["a"], GREEDY, request_id="a"))
    for _ in range(4):
        core.step()
    submit(core, recorder, GenerationRequest(prompts["b"], GREEDY, request_id="b"))
    run_to_end(core)
    assert {rid: c.token_ids for rid, c in recorder.completions.items()} == expected


@pytest.mark.parametrize("chunk", [3, 7, 64, 100])
def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(make_core, chunk):
    prompts = {"a": prompt(150, 7), "b": prompt(33, 8)}
    whole = generate(make_core(prefill_chunk=4096), prompts, GREEDY)
    assert generate(make_core(prefill_chunk=chunk), prompts, GREEDY) == whole


def test_idle_prefill_chunk_applies_only_while_nothing_decodes(make_core):
    """A lone prompt takes `idle_prefill_chunk` tokens per step; once a request decodes,
    chunks shrink to `prefill_chunk` so the decode rounds between them stay short."""
    core = make_core(prefill_chunk=16, idle_prefill_chunk=64)
    recorder = Recorder()
    first = submit(core, recorder, GenerationRequest(prompt(100, 20), GREEDY, request_id="a"))
    core.step()
    assert first.num_cached == 64
    core.step()
    assert first.num_cached == 100  # the rest, still alone
    second = submit(core, recorder, GenerationRequest(prompt(100, 21), GREEDY, request_id="b"))
    cached = [0]
    while second.num_cached < second.prompt_len:
        core.step()
        cached.append(second.num_cached)
    steps = {after - before for before, after in zip(cached, cached[1:])}
    assert steps == {0, 16, 100 - 6 * 16}  # "a" decodes: ordinary chunks between its rounds
    run_to_end(core)
    assert len(recorder.completions["b"].token_ids) == 12


def test_idle_prefill_chunk_follows_a_smaller_prefill_chunk_unless_set():
    """Left unset it is 4 x prefill_chunk, so a prefill_chunk lowered to bound activation
    memory bounds the idle steps too; set, it is never below prefill_chunk."""
    assert EngineConfig().idle_chunk == 4096
    assert EngineConfig(prefill_chunk=256).idle_chunk == 1024
    assert EngineConfig(prefill_chunk=256, idle_prefill_chunk=8192).idle_chunk == 8192
    assert EngineConfig(prefill_chunk=256, idle_prefill_chunk=16).idle_chunk == 256


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_capacity": 0}, "must be tokens or 'auto'"),
        ({"max_context": 4096, "kv_capacity": 1024}, "must hold at least one request"),
        ({"default_max_tokens": 0}, "default_max_tokens"),
        ({"tensor_parallel": 0}, "tensor_parallel"),
        ({"expert_parallel": True}, "expert_parallel needs"),
        ({"dtype": "int8"}, "dtype"),
        ({"idle_prefill_chunk": 0}, "idle_prefill_chunk"),
    ],
    ids=lambda value: str(value)[:24],
)
def test_every_engine_setting_is_checked_at_construction(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_abort_mid_prefill_frees_pages_and_slot(make_core):
    core = make_core(prefill_chunk=16)
    recorder = Recorder()
    seq = submit(core, recorder, GenerationRequest(prompt(100, 9), GREEDY, request_id="a"))
    core.step()
    assert seq.status is Status.RUNNING and 0 < seq.num_cached < seq.prompt_len
    core.abort("a")
    run_to_end(core)
    last = recorder.events[-1]
    assert last.finish_reason == "abort" and recorder.completions["a"].token_ids == []
    assert last.usage.prompt_tokens == 100 and last.usage.completion_tokens == 0


def test_abort_mid_decode_frees_everything_and_keeps_the_others_running(make_core):
    core = make_core()
    recorder = Recorder()
    submit(core, recorder, GenerationRequest(prompt(10, 10), GREEDY, request_id="a"))
    submit(core, recorder, GenerationRequest(prompt(12, 11), GREEDY, request_id="b"))
    while len(recorder.completions["a"].token_ids) < 3:
        core.step()
    core.abort("a")
    run_to_end(core)
    assert recorder.completions["a"].finish_reason == "abort"
    assert len(recorder.completions["a"].token_ids) < 12
    assert recorder.completions["b"].finish_reason == "length"
    assert len(recorder.completions["b"].token_ids) == 12


def test_abort_while_waiting_never_runs_the_request(make_core):
    core = make_core(max_concurrency=1)
    recorder = Recorder()
    submit(core, recorder, GenerationRequest(prompt(10, 12), GREEDY, request_id="a"))
    waiting = submit(core, recorder, GenerationRequest(prompt(10, 13), GREEDY, request_id="b"))
    core.step()
    assert waiting.status is Status.WAITING
    core.abort("b")
    run_to_end(core)
    assert recorder.completions["b"].finish_reason == "abort"
    assert recorder.completions["b"].token_ids == []
    assert recorder.completions["a"].finish_reason == "length"


def test_context_overflow_names_both_numbers(make_core):
    core = make_core(max_context=64)
    request = GenerationRequest(prompt(40, 14), SamplingParams(max_tokens=30))
    with pytest.raises(ContextLengthExceeded, match=r"40 tokens.*30.*64 tokens") as info:
        core.add(request, lambda e: None)
    assert (info.value.prompt_tokens, info.value.max_tokens) == (40, 30)
    with pytest.raises(ContextLengthExceeded):
        core.add(GenerationRequest(prompt(64, 15)), lambda e: None)
    core.check_integrity()


def test_output_limit_defaults_to_the_rest_of_the_context(make_core):
    core = make_core(max_context=50)
    recorder = Recorder()
    submit(
        core,
        recorder,
        GenerationRequest(prompt(40, 16), SamplingParams.greedy(ignore_eos=True), request_id="a"),
    )
    run_to_end(core)
    assert len(recorder.completions["a"].token_ids) == 10
    assert recorder.completions["a"].finish_reason == "length"


def test_invalid_requests_are_rejected_before_queueing(make_core):
    core = make_core()
    with pytest.raises(InvalidRequestError, match="empty"):
        core.add(GenerationRequest([]), lambda e: None)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        core.add(GenerationRequest([1, 10_000]), lambda e: None)
    with pytest.raises(InvalidRequestError, match="top_p"):
        core.add(GenerationRequest([1], SamplingParams(top_p=0)), lambda e: None)
    for seed in (2**64, -(2**63) - 1):  # would repeat a 64-bit seed's tokens
        with pytest.raises(InvalidRequestError, match="64-bit integer"):
            core.add(GenerationRequest([1], SamplingParams(seed=seed)), lambda e: None)
    assert not core.has_work


def test_same_seed_same_tokens_different_seed_different_tokens(make_core):
    ids = prompt(8, 17)

    def sample(seed: int, neighbours: int = 0) -> list[int]:
        prompts = {"x": ids} | {f"n{i}": prompt(5 + i, 100 + i) for i in range(neighbours)}
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        return generate(make_core(), prompts, params)["x"]

    first = sample(1)
    assert sample(1) == first
    assert sample(1, neighbours=3) == first  # other requests in the batch change nothing
    assert sample(2) != first


def test_stop_token_ends_the_request_and_is_reported(make_core):
    ids = prompt(6, 18)
    free_run = generate(make_core(), {"a": ids}, GREEDY)["a"]
    stop_id = free_run[4]
    first = free_run.index(stop_id)
    core = make_core()
    recorder = Recorder()
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])
    submit(core, recorder, GenerationRequest(ids, params, request_id="a"))
    run_to_end(core)
    done = recorder.completions["a"]
    assert done.token_ids == free_run[: first + 1]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop_id)


def test_model_eos_stops_unless_ignored(make_core):
    eos = sorted(make_core().eos_token_ids)
    assert eos == [256, 258]
    core = make_core()
    bias = {eos[0]: 100.0}
    recorder = Recorder()
    submit(
        core,
        recorder,
        GenerationRequest(
            [1, 2], SamplingParams.greedy(max_tokens=5, logit_bias=bias), request_id="a"
        ),
    )
    submit(
        core,
        recorder,
        GenerationRequest(
            [1, 2],
            SamplingParams.greedy(max_tokens=5, logit_bias=bias, ignore_eos=True),
            request_id="b",
        ),
    )
    run_to_end(core)
    assert recorder.completions["a"].token_ids == [256]
    assert recorder.completions["a"].stop_reason == 256
    assert recorder.completions["b"].token_ids == [256] * 5


def test_streamed_text_is_the_decoded_output_with_multibyte_characters_whole(make_core):
    core = make_core()
    recorder = Recorder()
    # byte tokens only: "é" is C3 A9, so a character spans two tokens (and two events)
    bias = {0xC3: 100.0, 0xA9: 100.0, ord("a"): 100.0}
    params = SamplingParams(max_tokens=40, seed=3, logit_bias=bias)
    submit(core, recorder, GenerationRequest([10], params, request_id="a"))
    run_to_end(core)
    done = recorder.completions["a"]
    pieces = [e.content for e in recorder.events]
    assert "".join(pieces) == core.frontend.tokenizer.decode(done.token_ids)
    assert "é" in done.content


def test_last_event_carries_usage_and_ordered_timings(make_core):
    core = make_core()
    recorder = Recorder()
    submit(core, recorder, GenerationRequest(prompt(30, 19), GREEDY, request_id="a"))
    run_to_end(core)
    last = recorder.events[-1]
    assert last.finished and all(not e.finished for e in recorder.events[:-1])
    assert last.usage.prompt_tokens == 30 and last.usage.completion_tokens == 12
    t = last.timings
    assert 0 <= t.queue <= t.ttft <= t.total
    assert t.prefill > 0 and t.decode > 0
    assert abs(t.queue + t.prefill - t.ttft) < 1e-6
    assert abs(t.ttft + t.decode - t.total) < 1e-6


def test_logprobs_come_with_each_token(make_core):
    core = make_core()
    recorder = Recorder()
    params = SamplingParams.greedy(max_tokens=3, ignore_eos=True, logprobs=2)
    submit(core, recorder, GenerationRequest(prompt(5, 20), params, request_id="a"))
    run_to_end(core)
    done = recorder.completions["a"]
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    for lp in done.logprobs:
        assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id  # greedy picks the top one
        assert lp.logprob == pytest.approx(lp.top[0][1]) and lp.logprob <= 0


def test_lanes_bound_the_running_requests(make_core):
    core = make_core(max_concurrency=2)
    recorder = Recorder()
    seqs = [
        submit(core, recorder, GenerationRequest(prompt(5, 30 + i), GREEDY, request_id=str(i)))
        for i in range(3)
    ]
    core.step()
    assert [s.status for s in seqs] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    run_to_end(core)
    assert all(c.finish_reason == "length" for c in recorder.completions.values())


def test_blocked_head_is_protected_and_only_safe_requests_backfill(make_core):
    # 3 pages of 64 tokens. A holds 1; the head B needs all 3 and waits for A.
    core = make_core(max_context=192, kv_capacity=192, prefill_chunk=64)
    recorder = Recorder()

    def add(request_id: str, length: int, max_tokens: int):
        params = SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True)
        request = GenerationRequest(prompt(length, ord(request_id)), params, request_id=request_id)
        return submit(core, recorder, request)

    a = add("A", 30, 20)  # 1 page, done within 21 steps
    b = add("B", 150, 30)  # 3 pages: the blocked head
    c = add("C", 5, 10)  # 1 page, done within 11 steps: before A, cannot delay B
    d = add("D", 5, 30)  # 1 page but up to 31 steps: would hold a page B needs after A ends
    core.step()
    assert [s.status for s in (a, b, c, d)] == [
        Status.RUNNING,
        Status.WAITING,
        Status.RUNNING,
        Status.WAITING,
    ]
    run_to_end(core)
    assert b.admitted_at < d.admitted_at
    assert b.admitted_at >= max(a.finished_at, c.finished_at)
    assert {c.finish_reason for c in recorder.completions.values()} == {"length"}


def test_a_request_larger_than_the_pool_is_refused(make_core):
    core = make_core(max_context=256, kv_capacity=256)
    assert core.cache.num_pages == 4
    with pytest.raises(ContextLengthExceeded):
        core.add(GenerationRequest(prompt(10, 1), SamplingParams(max_tokens=300)), print)


LETTERS = {ord(c): 100.0 for c in "abcdefghijklmnopqrstuvwxyz"}  # byte tokens: text only


def test_stop_string_spanning_tokens_cuts_the_content_at_its_first_character(make_core):
    free = generate_text(make_core(), SamplingParams.greedy(max_tokens=30, logit_bias=LETTERS))
    stop = free.content[5:8]  # three characters, three tokens
    cut = free.content.index(stop)
    params = SamplingParams.greedy(max_tokens=30, logit_bias=LETTERS, stop=[stop])
    done = generate_text(make_core(), params)
    assert done.content == free.content[:cut]
    assert (done.finish_reason, done.stop_reason) == ("stop", stop)
    assert len(done.token_ids) == cut + len(stop)  # the stop's tokens are generated and counted


def test_output_after_an_open_think_is_reasoning(make_core):
    params = SamplingParams.greedy(max_tokens=10, logit_bias=LETTERS)
    done = generate_text(make_core(), params, starts_in_reasoning=True)
    assert done.content == "" and len(done.reasoning) == 10
    assert done.usage.reasoning_tokens == 10


def generate_text(core, params: SamplingParams, **request_fields) -> Completion:
    recorder = Recorder()
    submit(core, recorder, GenerationRequest([10, 20], params, request_id="t", **request_fields))
    run_to_end(core)
    return recorder.completions["t"]


def test_penalty_counts_start_fresh_for_a_request_reusing_a_state_slot(make_core):
    params = SamplingParams.greedy(max_tokens=12, ignore_eos=True, frequency_penalty=2.0)
    ids = prompt(6, 21)
    fresh = generate(make_core(max_concurrency=1), {"b": ids}, params)["b"]
    core = make_core(max_concurrency=1)  # one slot: "b" reuses the slot "a" used
    assert generate(core, {"a": ids}, params)["a"] == fresh
    assert generate(core, {"b": ids}, params)["b"] == fresh

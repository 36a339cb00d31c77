"""Overlapped decode steps (`EngineConfig.overlap`): each decode step is launched before the
one in flight is read back, its input ids taken from that step's device output. On the shipped
model (CPU), every request's events must be those of the engine without overlap, whatever ends
it (length, a stop token, a stop string, an abort) and however requests come and go; and the
steps must really overlap."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ninfer
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import load_core
from ninfer.engine.request import GenerationRequest, SamplingParams

MODEL = Path(ninfer.__file__).parent / "assets" / "demo.ninfer"


def run(requests, overlap: bool, max_concurrency: int = 3, abort_after: dict | None = None):
    """Run (prompt ids, params) requests to the end; every request's events as comparable
    tuples, and the runner's calls in order."""
    core = load_core(
        MODEL,
        EngineConfig(
            device="cpu", max_context=512, max_concurrency=max_concurrency, overlap=overlap
        ),
    )
    calls: list[str] = []
    runner = core.runner
    launch, collect = runner.launch, runner.collect

    def logged_launch(*args, **kwargs):
        calls.append("launch")
        return launch(*args, **kwargs)

    def logged_collect(launched):
        calls.append("collect")
        return collect(launched)

    runner.launch, runner.collect = logged_launch, logged_collect
    events: dict[str, list] = {}
    abort_after = abort_after or {}
    for i, (prompt, params) in enumerate(requests):
        request_id = f"r{i}"
        events[request_id] = []

        def sink(event, request_id=request_id):
            events[request_id].append(
                (
                    tuple(event.token_ids),
                    event.content,
                    event.reasoning,
                    event.finish_reason,
                    event.stop_reason,
                    tuple((lp.token_id, round(lp.logprob, 5)) for lp in event.logprobs or ()),
                )
            )
            if len(events[request_id]) == abort_after.get(request_id):
                core.abort(request_id)

        core.add(GenerationRequest(prompt, params, request_id=request_id), sink)
    while core.has_work:
        core.step()
    core.check_integrity()
    return events, calls


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + (7 * i) % 400 for i in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_requests_of_different_lengths_and_arrivals_match():
    requests = [
        (prompt(5), GREEDY),
        (prompt(40, 3), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        (prompt(12, 99), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (prompt(70, 5), SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)),
        (prompt(3, 200), GREEDY),
    ]
    plain, _ = run(requests, overlap=False)
    overlapped, calls = run(requests, overlap=True)
    assert overlapped == plain
    # a decode step was launched while the one before it was still in flight
    assert any(calls[i : i + 3] == ["launch", "launch", "collect"] for i in range(len(calls)))


def test_seeded_sampling_penalties_and_logprobs_match():
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        seed=1234,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logprobs=3,
        max_tokens=20,
        ignore_eos=True,
    )
    requests = [(prompt(8), params), (prompt(20, 50), params), (prompt(4, 7), params)]
    assert run(requests, overlap=True)[0] == run(requests, overlap=False)[0]


def test_stop_tokens_and_strings_end_requests_alike():
    """A request ended by a stop token or string while its next step is in flight: that
    step's row for it is dropped, and its events are those without overlap."""
    first = run([(prompt(6), GREEDY)], overlap=False)[0]["r0"]
    tokens = [t for event in first for t in event[0]]
    text = "".join(event[1] for event in first)
    stop_string = text[len(text) // 2 : len(text) // 2 + 3] if len(text) >= 6 else None
    requests = [
        (prompt(6), SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[5]])),
        (prompt(30, 9), GREEDY),
    ]
    if stop_string and stop_string.strip():
        requests.append(
            (prompt(6), SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_string]))
        )
    plain, _ = run(requests, overlap=False)
    assert plain["r0"][-1][3] == "stop"
    assert run(requests, overlap=True)[0] == plain


@pytest.mark.parametrize("max_concurrency", [1, 2, 4])
def test_an_abort_mid_decode_and_queued_requests_match(max_concurrency):
    requests = [(prompt(5 + 3 * i, 11 * i), GREEDY) for i in range(5)]
    aborts = {"r1": 4, "r3": 2}
    plain, _ = run(requests, False, max_concurrency, aborts)
    overlapped, calls = run(requests, True, max_concurrency, aborts)
    assert overlapped == plain
    assert plain["r1"][-1][3] == "abort"
    # requests queued for a lane do not stop the steps from overlapping
    assert any(calls[i : i + 3] == ["launch", "launch", "collect"] for i in range(len(calls)))


def test_collect_waits_for_its_own_copy_and_reads_it():
    """On CUDA a launched step's tokens are copied to pinned host memory behind its work:
    `collect` waits for that copy's event, not for the device (which may run a later step),
    and reads the host copy."""
    from types import SimpleNamespace

    from ninfer.engine.runner import LaunchedStep, ModelRunner
    from ninfer.engine.sampler import SampleOutput

    class Event:
        waited = False

        def synchronize(self):
            self.waited = True

    device_out = SampleOutput(token_ids=torch.tensor([9, 9]))  # not to be read
    host_out = SampleOutput(token_ids=torch.tensor([4, 5]))
    ready = Event()
    batch = SimpleNamespace(seqs=[], sampled=[True, True])
    launched = LaunchedStep(batch, device_out, host_out, ready, [None, None])
    result = ModelRunner.collect(None, launched)
    assert ready.waited and result.token_ids == [4, 5]

"""The bench's recording runner on a stand-in CUDA runner: its two events bracket a step's device
work (from the staged graph replay, or the eager forward, to the sampler's last launch), so a
step's host time excludes nothing the device ran and includes the host's input staging; with a
step launched before the one in flight is read back, each read-back step keeps its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.bench.targets import _RecordingRunner


class Clock:
    now = 0.0


class FakeEvent:
    """A CUDA event whose time is the fake clock's when it was last recorded."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.time: float | None = None

    def record(self) -> None:
        self.time = Clock.now

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.time - self.time) * 1e3


class FakeGraphs:
    def stage(self, inputs, size) -> None:
        Clock.now += 0.002  # host fills and copies the static inputs


class FakeRunner:
    """ModelRunner's order of work: forward (staging, then replay when graphed), then the
    sampler, then the host sync on the sampled ids."""

    def __init__(self, graphed: bool) -> None:
        self.device = torch.device("cuda")
        self.graphs = FakeGraphs() if graphed else None
        self.sampler = SimpleNamespace(sample=self._sample)

    def forward(self, inputs):
        Clock.now += 0.001  # host builds the inputs
        if self.graphs is not None:
            self.graphs.stage(inputs, 1)
        Clock.now += 0.010  # device runs the forward
        return "logits"

    def _sample(self, logits, rows):
        Clock.now += 0.003
        return "tokens"

    def launch(self, batch, **kwargs):
        logits = self.forward(None)
        if batch.sampled[0]:
            self.sampler.sample(logits, [])
        return batch

    def collect(self, launched):
        Clock.now += 0.004  # the host sync and turning ids into events
        return launched


def batch(sampled: bool = True):
    seq = SimpleNamespace(num_cached=3)
    return SimpleNamespace(is_decode=True, seqs=[seq], query_lens=[1], sampled=[sampled])


@pytest.fixture(autouse=True)
def fake_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)


# graphed: replay + sampling; eager: the forward from its entry (the host's launches inside it
# are not separable from device time by two events) + sampling
@pytest.mark.parametrize(("graphed", "device_seconds"), [(True, 0.013), (False, 0.014)])
def test_device_time_spans_the_forward_and_sampling(graphed, device_seconds):
    recorder = _RecordingRunner(FakeRunner(graphed))
    recorder.run(batch())
    assert recorder.device_seconds() == pytest.approx(device_seconds)


def test_a_step_that_samples_nothing_has_no_device_time():
    recorder = _RecordingRunner(FakeRunner(graphed=True))
    recorder.run(batch())
    recorder.run(batch(sampled=False))
    assert recorder.device_seconds() is None


def test_a_cpu_runner_is_not_hooked():
    runner = FakeRunner(graphed=False)
    runner.device = torch.device("cpu")
    recorder = _RecordingRunner(runner)
    recorder.run(batch())
    assert recorder.device_seconds() is None
    assert "forward" not in vars(runner)


def test_a_step_read_back_after_the_next_launch_keeps_its_own_time_and_shape():
    recorder = _RecordingRunner(FakeRunner(graphed=True))
    first = recorder.launch(batch())
    Clock.now += 0.050  # the host does other work before launching the next step
    second_batch = batch()
    second_batch.seqs[0].num_cached = 4
    second = recorder.launch(second_batch)
    recorder.collect(first)
    assert recorder.device_seconds() == pytest.approx(0.013)
    assert recorder.last.context_lens == (3,)
    recorder.collect(second)
    assert recorder.last.context_lens == (4,)

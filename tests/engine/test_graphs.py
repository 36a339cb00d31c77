"""CUDA-graph decode on the CPU: batch sizes, padding rows and the static-buffer forward the
graphs capture (run eagerly here), against the ordinary decode forward. The capture itself
is tested in tests/gpu/test_graphs_gpu.py; here only the order of its calls into pieces."""

from __future__ import annotations

import pytest
import torch

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import uses_cuda_graphs
from ninfer.engine.graphs import (
    DecodeBuffers,
    DecodeGraphs,
    capture_sizes,
    fill_decode_rows,
    graph_memory_bytes,
    graph_size,
)
from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.engine.runner import StepInputs
from ninfer.models.context import make_context


def decode_inputs(seqs: list[tuple[int, list[int], int, int]]) -> StepInputs:
    """seqs: (context_len, pages, state_slot, input_id) per sequence."""
    return StepInputs(
        input_ids=[s[3] for s in seqs],
        positions=[s[0] for s in seqs],
        context_lens=[s[0] for s in seqs],
        query_lens=[1] * len(seqs),
        page_lists=[s[1] for s in seqs],
        state_slots=[s[2] for s in seqs],
        logit_rows=list(range(len(seqs))),
    )


def test_every_batch_size_up_to_the_lanes_is_captured():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 3, 4, 5]


def test_a_batch_runs_on_the_smallest_size_that_holds_it():
    sizes = [1, 2, 4, 8]
    assert graph_size(1, sizes) == 1
    assert graph_size(3, sizes) == 4
    assert graph_size(8, sizes) == 8
    assert graph_size(9, sizes) is None
    assert graph_size(0, sizes) is None


def test_padding_rows_decode_into_the_scratch_page_and_slot():
    buffers = DecodeBuffers.allocate(6, 4, "cpu")
    inputs = decode_inputs([(70, [5, 9], 2, 11), (0, [3], 0, 12), (128, [1, 4, 7], 1, 13)])
    fill_decode_rows(buffers, inputs, 5, scratch_page=10, scratch_slot=3)

    assert buffers.input_ids[:5].tolist() == [11, 12, 13, 0, 0]
    assert buffers.positions[:5].tolist() == [70, 0, 128, 0, 0]
    assert buffers.context_lens[:5].tolist() == [70, 0, 128, 0, 0]
    assert buffers.seq_lens[:5].tolist() == [71, 1, 129, 1, 1]
    assert buffers.state_slots[:5].tolist() == [2, 0, 1, 3, 3]
    assert buffers.kv_write_slots[:5].tolist() == [
        9 * PAGE_SIZE + 6,
        3 * PAGE_SIZE,
        7 * PAGE_SIZE,
        10 * PAGE_SIZE,
        10 * PAGE_SIZE,
    ]
    assert buffers.page_table[:5].tolist() == [
        [5, 9, -1, -1],
        [3, -1, -1, -1],
        [1, 4, 7, -1],
        [10, -1, -1, -1],
        [10, -1, -1, -1],
    ]


def test_refilling_with_fewer_pages_clears_the_old_page_ids():
    buffers = DecodeBuffers.allocate(2, 4, "cpu")
    fill_decode_rows(buffers, decode_inputs([(200, [1, 2, 3, 4], 0, 5)]), 1, 9, 9)
    fill_decode_rows(buffers, decode_inputs([(3, [6], 0, 5)]), 1, 9, 9)
    assert buffers.page_table[0].tolist() == [6, -1, -1, -1]


def test_rows_a_graph_cannot_run_are_refused():
    buffers = DecodeBuffers.allocate(2, 2, "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        fill_decode_rows(buffers, decode_inputs([(0, [1], 0, 1)] * 3), 2, 9, 9)
    with pytest.raises(ValueError, match="pages"):
        fill_decode_rows(buffers, decode_inputs([(200, [1, 2, 3, 4], 0, 1)]), 1, 9, 9)
    prefill = decode_inputs([(0, [1], 0, 1)])
    prefill.query_lens = [2]
    with pytest.raises(ValueError, match="decode steps only"):
        fill_decode_rows(buffers, prefill, 1, 9, 9)


def test_graphs_are_used_only_on_cuda_in_half_precision_on_one_rank(make_core):
    core = make_core()
    model = core.runner.model
    assert core.runner.graphs is None
    assert not uses_cuda_graphs(EngineConfig(), model)  # a CPU model


def test_graphs_need_a_cache_with_scratch(make_core):
    core = make_core()
    with pytest.raises(ValueError, match="scratch"):
        DecodeGraphs(core.runner.model, core.cache, max_context=128, sizes=[1, 2])


def _prefill(model, cache, prompts, slots, page_lists):
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    ctx = make_context(
        cache,
        context_lens=[0] * len(prompts),
        query_lens=[len(p) for p in prompts],
        page_lists=page_lists,
        state_slots=slots,
    )
    model(ids, positions, ctx)


def _snapshot(cache):
    return [t.clone() for t in (*cache.k, *cache.v, *cache.gdn_state, *cache.conv_window)]


def _restore(cache, saved):
    for tensor, value in zip((*cache.k, *cache.v, *cache.gdn_state, *cache.conv_window), saved):
        tensor.copy_(value)


@torch.inference_mode()
def test_padded_static_forward_equals_the_ordinary_decode_forward(make_core):
    """Three sequences in a graph of five rows: their logits and the cache rows they own come
    out as from the ordinary decode step; the padding touched only the scratch page and slot."""
    model = make_core().runner.model
    cache = ModelCache(model.cache_spec(), 12, 4, scratch=True)
    graphs = DecodeGraphs(model, cache, max_context=4 * PAGE_SIZE, sizes=[1, 5])
    prompts = [[3, 4, 5], list(range(10, 80)), [7] * 20]
    slots = [2, 0, 3]
    page_lists = [[4], [1, 8], [6]]
    _prefill(model, cache, prompts, slots, page_lists)
    inputs = decode_inputs(
        [
            (len(p), pages, slot, 30 + i)
            for i, (p, pages, slot) in enumerate(zip(prompts, page_lists, slots))
        ]
    )
    before = _snapshot(cache)

    ctx = make_context(
        cache,
        context_lens=inputs.context_lens,
        query_lens=inputs.query_lens,
        page_lists=inputs.page_lists,
        state_slots=inputs.state_slots,
    )
    hidden = model(torch.tensor(inputs.input_ids), torch.tensor(inputs.positions), ctx)
    expected = model.compute_logits(hidden)
    expected_cache = _snapshot(cache)

    _restore(cache, before)
    size = graphs.size_for(inputs)
    assert size == 5
    graphs.stage(inputs, size)
    logits = graphs.forward_static(size)[:3]

    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    scratch_page, scratch_slot = cache.scratch_page, cache.scratch_slot
    for i, (got, want) in enumerate(zip(_snapshot(cache), expected_cache)):
        if i < 2 * len(cache.k):
            got, want = got[:scratch_page], want[:scratch_page]
        else:
            got, want = got[:scratch_slot], want[:scratch_slot]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prefill_step_has_no_graph(make_core):
    model = make_core().runner.model
    cache = ModelCache(model.cache_spec(), 4, 2, scratch=True)
    graphs = DecodeGraphs(model, cache, max_context=PAGE_SIZE, sizes=[1, 2])
    prefill = decode_inputs([(0, [1], 0, 1)])
    prefill.query_lens = [3]
    assert graphs.size_for(prefill) is None
    assert graphs.size_for(decode_inputs([(0, [1], 0, 1)] * 3)) is None


def test_graph_memory_counts_gathered_expert_weights_only_for_dense_experts():
    """Dense experts gather each token's expert weights inside the decode graph; encoded ones
    only hold the (token, choice) pairs' activations, so the pool keeps more K/V pages."""
    from ninfer.bench.shapes import SHAPES
    from ninfer.models.qwen3_5 import Qwen3_5Config

    config = Qwen3_5Config.from_hf(SHAPES["qwen3_5-35b-a3b"], is_moe=True)
    dense = graph_memory_bytes(config, 64, 4096)
    encoded = graph_memory_bytes(config, 64, 4096, encoded_experts=True)
    gathered = 64 * 3 * config.moe_intermediate_size * config.hidden_size * 4
    assert dense - encoded > gathered * 0.9


class _RecordedGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: notes when its capture begins and ends."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.name = f"g{sum(entry.startswith('new') for entry in log)}"
        log.append(f"new {self.name}")

    def capture_begin(self, pool=None) -> None:
        self.log.append(f"begin {self.name}")

    def capture_end(self) -> None:
        self.log.append(f"end {self.name}")


class _Layers(torch.nn.Module):
    def __init__(self, count: int, order: list[int]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(count))
        self.order = order
        self.device = torch.device("cpu")

    def forward_static(self, size: int) -> torch.Tensor:
        for i in self.order:
            self.layers[i](torch.zeros(1))
        return torch.zeros(size, 4)


def _capture(monkeypatch, count: int, order: list[int]):
    """`DecodeGraphs._capture_segments` over a model of `count` identity layers run in
    `order`, with the CUDA capture calls recorded; returns (log, result or exception)."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _RecordedGraph(log))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _NullStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: _NullStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _NullStream())
    model = _Layers(count, order)
    owner = type("Owner", (), {"model": model, "forward_static": model.forward_static})()
    try:
        return log, DecodeGraphs._capture_segments(owner, 2, pool=None)
    except RuntimeError as exc:
        return log, exc


class _NullStream:
    def wait_stream(self, other) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_a_decode_step_is_captured_in_pieces_split_at_the_segment_layers(monkeypatch):
    """Eight layers: pieces begin at layers 1 and 4, each capture ends before the next begins."""
    log, (graphs, logits) = _capture(monkeypatch, 8, list(range(8)))
    assert len(graphs) == 3 and logits.shape == (2, 4)
    assert [entry for entry in log if not entry.startswith("new")] == [
        "begin g0", "end g0", "begin g1", "end g1", "begin g2", "end g2",
    ]  # fmt: skip
    _, (graphs, _) = _capture(monkeypatch, 1, [0])  # no layer past the first: one graph
    assert len(graphs) == 1


@pytest.mark.parametrize(
    ("order", "message"),
    [([0, 1, 2, 3, 5, 6, 7], "did not run"), ([0, 1, 2, 3, 4, 4], "ran twice")],
    ids=["layer-skipped", "layer-twice"],
)
def test_a_capture_that_goes_wrong_is_ended_and_reported(monkeypatch, order, message):
    """A forward that skips a piece's first layer, or runs one twice, is an error, and no
    capture is left open on the stream."""
    log, result = _capture(monkeypatch, 8, order)
    assert isinstance(result, RuntimeError) and message in str(result)
    began = [entry.split()[1] for entry in log if entry.startswith("begin")]
    ended = [entry.split()[1] for entry in log if entry.startswith("end")]
    assert began == ended


def test_staging_alternates_host_copies_and_takes_device_ids(make_core):
    """With overlapped steps the next step is staged while the copy from the last one's host
    buffers may still be queued: consecutive steps fill different host copies. A step fed by
    the one in flight takes its ids from the given device tensor."""
    model = make_core().runner.model
    cache = ModelCache(model.cache_spec(), 4, 2, scratch=True)
    graphs = DecodeGraphs(model, cache, max_context=PAGE_SIZE, sizes=[1, 2])
    first = decode_inputs([(5, [1], 0, 11), (6, [2], 1, 12)])
    graphs.stage(first, 2)
    written = [t.clone() for t in graphs.hosts[0].tensors()]
    second = decode_inputs([(6, [1], 0, 0), (7, [2], 1, 0)])
    second.device_ids = torch.tensor([21, 22])
    graphs.stage(second, 2)
    assert all(torch.equal(a, b) for a, b in zip(graphs.hosts[0].tensors(), written))
    assert graphs.static.input_ids[:2].tolist() == [21, 22]
    assert graphs.static.positions[:2].tolist() == [6, 7]

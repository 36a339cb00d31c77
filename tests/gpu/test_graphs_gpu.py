"""CUDA-graph decode and quantized linears on the GPU: greedy tokens with graphs equal those
without for several batch compositions (dense, MoE, quantized, padded graph sizes), the
graphs are really used, and a `GroupwiseLinear` computes the dequantized product on both of
its paths (relative error of bf16 operands, METHOD.md)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import ninfer
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import load_core, shipped_model_path
from ninfer.engine.graphs import SEGMENT_STARTS
from ninfer.engine.request import GenerationRequest, SamplingParams
from ninfer.models.layers.linear import GEMV_FORMATS, GEMV_MAX_ROWS, GroupwiseLinear
from ninfer.quant import get_format

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def mixed_requests(seed: int, count: int, vocab: int = 4000) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs of varied lengths, so requests finish at different steps and
    decode batches shrink and grow as others are admitted."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(10, vocab) for _ in range(rng.randrange(1, 300))], rng.randrange(2, 30))
        for _ in range(count)
    ]


def run_core(core, requests) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True)
        outputs[str(i)] = []
        core.add(
            GenerationRequest(prompt, params, request_id=str(i), detokenize=False),
            lambda event, out=outputs[str(i)]: out.extend(event.token_ids),
        )
    while core.has_work:
        core.step()
    core.check_integrity()
    assert core.cache.pages.num_free == core.cache.num_pages
    return [outputs[str(i)] for i in range(len(requests))]


def tokens(path, requests, *, cuda_graph: bool, sizes=None, **fields) -> list[list[int]]:
    config = EngineConfig(device="cuda", dtype="bfloat16", cuda_graph=cuda_graph, **fields)
    core = load_core(path, config)
    assert (core.runner.graphs is not None) == cuda_graph
    if sizes is not None:
        core.runner.capture_graphs(config.max_context, sizes)
    replays = count_replays(core)
    out = run_core(core, requests)
    if cuda_graph:
        assert replays["decode"] > 0, "no decode step ran from a graph"
    return out


def count_replays(core) -> dict[str, int]:
    counter = {"decode": 0}
    graphs = core.runner.graphs
    if graphs is not None:
        run = graphs.run

        def counted(inputs, size):
            counter["decode"] += 1
            return run(inputs, size)

        graphs.run = counted
    return counter


@pytest.mark.parametrize(
    ("max_concurrency", "prefill_chunk"), [(1, 1024), (3, 64), (8, 128)], ids=str
)
@pytest.mark.parametrize("gdn_state_dtype", ["float32", "bfloat16"])
def test_greedy_tokens_with_graphs_equal_tokens_without(
    max_concurrency, prefill_chunk, gdn_state_dtype
):
    requests = mixed_requests(max_concurrency, 12)
    fields = dict(
        max_context=512,
        max_concurrency=max_concurrency,
        prefill_chunk=prefill_chunk,
        gdn_state_dtype=gdn_state_dtype,
    )
    eager = tokens(shipped_model_path(), requests, cuda_graph=False, **fields)
    graphed = tokens(shipped_model_path(), requests, cuda_graph=True, **fields)
    assert graphed == eager


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graphs", "eager"])
def test_overlapped_steps_give_the_tokens_of_steps_read_back_one_by_one(cuda_graph):
    """Each decode step launched before the one in flight is read back, its ids taken from
    that step's device output (EngineConfig.overlap): the same tokens, and the steps really
    overlap (a launch between another launch and its read-back)."""
    requests = mixed_requests(5, 12)
    fields = dict(max_context=512, max_concurrency=4, prefill_chunk=128, cuda_graph=cuda_graph)
    one_by_one = tokens(shipped_model_path(), requests, overlap=False, **fields)
    core = load_core(shipped_model_path(), EngineConfig(device="cuda", dtype="bfloat16", **fields))
    calls = []
    launch, collect = core.runner.launch, core.runner.collect
    core.runner.launch = lambda *a, **k: calls.append("launch") or launch(*a, **k)
    core.runner.collect = lambda launched: calls.append("collect") or collect(launched)
    assert run_core(core, requests) == one_by_one
    assert any(calls[i : i + 3] == ["launch", "launch", "collect"] for i in range(len(calls)))


def test_batches_padded_to_a_larger_graph_give_the_same_tokens():
    """Graphs of 2 and 8 rows only: batches of 1 and 3..7 run with padding rows."""
    requests = mixed_requests(11, 14)
    fields = dict(max_context=512, max_concurrency=8, prefill_chunk=256)
    eager = tokens(shipped_model_path(), requests, cuda_graph=False, **fields)
    padded = tokens(shipped_model_path(), requests, cuda_graph=True, sizes=[2, 8], **fields)
    assert padded == eager


def test_fp32_runs_without_graphs():
    core = load_core(shipped_model_path(), EngineConfig(device="cuda", dtype="float32"))
    assert core.runner.graphs is None
    assert core.cache.scratch_page is None


def test_moe_greedy_tokens_with_graphs_equal_tokens_without(tiny_artifact):
    _, path = tiny_artifact(weights="bf16", moe=True, hidden=128)
    requests = mixed_requests(5, 8, vocab=512)
    fields = dict(max_context=512, max_concurrency=4, prefill_chunk=128)
    assert tokens(path, requests, cuda_graph=True, **fields) == tokens(
        path, requests, cuda_graph=False, **fields
    )


def test_quantized_model_keeps_linears_encoded_and_graphs_agree(tiny_artifact):
    _, path = tiny_artifact(weights="groupwise-int", layers=4, hidden=128)
    core = load_core(path, EngineConfig(device="cuda", dtype="bfloat16", cuda_graph=False))
    layers = [m for m in core.runner.model.modules() if isinstance(m, GroupwiseLinear)]
    assert layers and {m.format for m in layers} <= GEMV_FORMATS
    assert all(m.codes.is_cuda for m in layers)
    head = core.runner.model.lm_head  # stored q6_g64: kept encoded, widened to q8_g32
    assert isinstance(head, GroupwiseLinear) and head.format == "q8_g32_fp16"
    requests = mixed_requests(9, 8, vocab=512)
    fields = dict(max_context=512, max_concurrency=4, prefill_chunk=128)
    assert tokens(path, requests, cuda_graph=True, **fields) == tokens(
        path, requests, cuda_graph=False, **fields
    )


def test_quantized_model_logits_close_to_the_dequantized_model(tiny_artifact):
    """The same q4 artifact: encoded linears in bf16 on the GPU vs dequantized fp32 on the CPU."""
    _, path = tiny_artifact(weights="groupwise-int", layers=4, hidden=128)
    assert_top_logprob_close_to_cpu_fp32(path, list(range(20, 60)))


def assert_top_logprob_close_to_cpu_fp32(path, prompt: list[int]) -> None:
    """The CPU fp32 run's most likely next token is among the GPU bf16 run's top 5, with a
    log-probability within 0.1."""
    params = SamplingParams.greedy(max_tokens=1, ignore_eos=True, logprobs=5)

    def top(device, dtype):
        with ninfer.Engine(path, device=device, dtype=dtype, max_context=256) as engine:
            return dict(engine.generate(prompt, params).logprobs[0].top)

    ref, ours = top("cpu", "float32"), top("cuda", "bfloat16")
    best = max(ref, key=ref.get)
    assert best in ours
    assert abs(ours[best] - ref[best]) < 0.1


def test_gemv_formats_are_the_kernels_formats():
    from ninfer.kernels.groupwise_gemv_triton import SUPPORTED

    assert set(SUPPORTED) == GEMV_FORMATS


@pytest.mark.parametrize("format_name", sorted(GEMV_FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 8, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 200])
@pytest.mark.parametrize(("n", "k"), [(512, 1024), (1000, 5120), (48, 2048)], ids=str)
def test_groupwise_linear_on_gpu_equals_the_dequantized_product(format_name, rows, n, k):
    encoded = get_format(format_name).encode(torch.randn(n, k, device="cuda") * k**-0.5)
    layer = GroupwiseLinear(encoded)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    exact = F.linear(x.double(), encoded.decode(torch.float64))
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert relative_error(out, exact) < 1e-2


def test_graph_memory_is_taken_from_the_auto_kv_pool():
    from ninfer.engine.engine import pool_pages

    config = EngineConfig(max_context=1 << 20, max_concurrency=64)
    page_bytes = 1 << 20
    device = torch.device("cuda")
    without = pool_pages(config, page_bytes, device)
    reserved = pool_pages(config, page_bytes, device, reserve_bytes=64 * page_bytes)
    assert abs((without - reserved) - 64) <= 1


def test_every_batch_size_up_to_the_lanes_has_a_graph():
    core = load_core(
        shipped_model_path(),
        EngineConfig(device="cuda", dtype="bfloat16", max_context=1024, max_concurrency=8),
    )
    assert sorted(core.runner.graphs.graphs) == list(range(1, 9))
    assert core.cache.scratch_page == core.cache.num_pages
    # each size is split into graphs at SEGMENT_STARTS (the layers the model has)
    layers = len(core.runner.model.layers)
    pieces = 1 + sum(start < layers for start in SEGMENT_STARTS)
    assert pieces > 1
    assert all(len(graphs) == pieces for graphs in core.runner.graphs.graphs.values())

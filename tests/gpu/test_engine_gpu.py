"""The whole engine on the GPU against the CPU reference path, on the shipped model: greedy
tokens in fp32 must match the CPU exactly whatever the batch composition, bf16 logits stay
within bf16 tolerance of the fp32 CPU logits, and a long mixed run leaves the pools intact."""

from __future__ import annotations

import random

import pytest
import torch

import ninfer
from ninfer.engine.request import GenerationRequest, SamplingParams
from ninfer.engine.runner import ModelRunner
from ninfer.kernels import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [
    [5, 6, 7],
    list(range(100, 190)),
    [random.Random(3).randrange(10, 8000) for _ in range(300)],
    [42] * 20,
]
GREEDY = SamplingParams.greedy(max_tokens=24, ignore_eos=True)


def greedy_tokens(device: str, dtype: str, prompts, **config) -> list[list[int]]:
    with ninfer.Engine(None, device=device, dtype=dtype, max_context=1024, **config) as engine:
        results = engine.generate(prompts, GREEDY)
        engine.core.check_integrity()
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def cpu_tokens():
    return greedy_tokens("cpu", "float32", PROMPTS)


@pytest.mark.parametrize(
    ("max_concurrency", "prefill_chunk"), [(1, 1024), (4, 64), (8, 128)], ids=str
)
def test_fp32_greedy_tokens_on_gpu_equal_cpu(cpu_tokens, max_concurrency, prefill_chunk):
    gpu = greedy_tokens(
        "cuda", "float32", PROMPTS, max_concurrency=max_concurrency, prefill_chunk=prefill_chunk
    )
    assert gpu == cpu_tokens


def test_bf16_logprobs_on_gpu_close_to_cpu_fp32():
    """bf16 rounding may reorder near-tied candidates, so compare log-probabilities of the
    reference's top candidates rather than demanding the same argmax."""
    params = SamplingParams.greedy(max_tokens=1, ignore_eos=True, logprobs=5)

    def first_token(device, dtype):
        with ninfer.Engine(None, device=device, dtype=dtype, max_context=1024) as engine:
            prompt = engine.tokenizer.encode("import os\nimport sys\n\n\ndef main(argv):\n    ")
            return dict(engine.generate(prompt, params).logprobs[0].top)

    ref, ours = first_token("cpu", "float32"), first_token("cuda", "bfloat16")
    best = max(ref, key=ref.get)
    assert best in ours
    assert abs(ours[best] - ref[best]) < 0.1


def test_hundred_mixed_requests_leave_the_pools_intact():
    rng = random.Random(0)
    with ninfer.Engine(
        None, device="cuda", max_context=1024, max_concurrency=8, max_pending_requests=100
    ) as engine:
        handles = []
        for i in range(100):
            prompt = [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 400))]
            params = SamplingParams(
                temperature=0.8, top_p=0.95, seed=i, max_tokens=rng.randrange(1, 40)
            )
            handles.append(engine.submit(GenerationRequest(prompt, params)))
        for i, handle in enumerate(handles):
            if i % 7 == 3:
                handle.abort()
        results = [h.result() for h in handles]
        assert all(r.finish_reason in ("stop", "length", "abort") for r in results)
        engine.core.check_integrity()
        assert engine.core.cache.pages.num_free == engine.core.cache.num_pages


@pytest.mark.skipif(not dispatch.HAS_FLA, reason="needs fla-core")
def test_bf16_engine_start_warms_fla_for_the_gdn_heads_before_graph_capture(monkeypatch):
    order = []
    warm, capture = dispatch.warm_up_chunk_gated_delta_rule, ModelRunner.capture_graphs

    def warm_and_record(*args):
        order.append(("warm", args[:4]))
        return warm(*args)

    def capture_and_record(self, *args):
        order.append(("capture", None))
        return capture(self, *args)

    monkeypatch.setattr(dispatch, "warm_up_chunk_gated_delta_rule", warm_and_record)
    monkeypatch.setattr(ModelRunner, "capture_graphs", capture_and_record)
    with ninfer.Engine(None, device="cuda", dtype="bfloat16", max_context=1024) as engine:
        config = engine.core.runner.model.local_config
    heads = (
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    assert order == [("warm", heads), ("capture", None)]

"""Engine start pays fla's one-time autotuning of the GDN prefill kernels, for each of the
model's head shapes, wherever the prefill runs them (CUDA in half precision); a CPU engine
warms nothing."""

from __future__ import annotations

import torch

from ninfer.engine.engine import warm_up_kernels
from ninfer.kernels import dispatch, gdn_chunked_fla


def test_warm_up_runs_fla_only_where_the_prefill_would(monkeypatch):
    calls = []
    monkeypatch.setattr(dispatch, "HAS_FLA", True)
    monkeypatch.setattr(dispatch, "HAS_TRITON", True)
    monkeypatch.setattr(gdn_chunked_fla, "warm_up", lambda *args: calls.append(args))
    assert dispatch.warm_up_chunk_gated_delta_rule(2, 4, 8, 16, torch.bfloat16, "cuda")
    assert calls == [(2, 4, 8, 16, torch.bfloat16, torch.device("cuda"))]
    assert not dispatch.warm_up_chunk_gated_delta_rule(2, 4, 8, 16, torch.float32, "cuda")
    assert not dispatch.warm_up_chunk_gated_delta_rule(2, 4, 8, 16, torch.bfloat16, "cpu")
    monkeypatch.setattr(dispatch, "HAS_FLA", False)
    assert not dispatch.warm_up_chunk_gated_delta_rule(2, 4, 8, 16, torch.bfloat16, "cuda")
    assert len(calls) == 1


def test_each_gdn_head_shape_of_the_model_is_warmed_once(make_core, monkeypatch):
    model = make_core().runner.model
    config = model.local_config
    calls = []

    def record(*args):
        calls.append(args)
        return True

    monkeypatch.setattr(dispatch, "warm_up_chunk_gated_delta_rule", record)
    shape = (
        config.linear_num_key_heads,
        config.linear_num_value_heads,
        config.linear_key_head_dim,
        config.linear_value_head_dim,
    )
    assert warm_up_kernels(model) == [shape]
    assert calls == [(*shape, model.dtype, model.device)]


def test_a_cpu_engine_starts_without_warming_anything(make_core, monkeypatch):
    def refuse(*args):
        raise AssertionError("fla warm-up on a CPU engine")

    monkeypatch.setattr(gdn_chunked_fla, "warm_up", refuse)
    core = make_core()
    assert warm_up_kernels(core.runner.model) == []

"""Decoder norms folded into their neighbouring products (`kernels/norm_fold.py`), on the CPU:
the model's wiring (which product folds which norm, what each layer hands the next) through
the reference fallbacks, against the model with every norm its own call; and which models
fold. The GPU kernels run it in tests/gpu/test_gluon_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen import Runner, convert_to_artifact, load_ours, make_hf_model

from ninfer.models import qwen3_5
from ninfer.models.layers import norms


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    hf = make_hf_model("dense_3gdn_1attn_gqa2")
    return load_ours(convert_to_artifact(hf, tmp_path_factory.mktemp("fold")), torch.float32)


def _steps(model, steps, calls: list | None = None, counts: list | None = None):
    """The logits of each step, two sequences; with `calls`, the length it reached during
    each step is put in `counts`."""
    runner = Runner(model)
    runner.add("a")
    runner.add("b")
    out = []
    for step in steps:
        if calls is not None:
            calls.clear()
        out.append(torch.cat(list(runner.step(step).values())))
        if calls is not None:
            counts.append(len(calls))
    return out


# rows per step: 2 to 8 fold, 1 and 9 do not
STEPS = [{"a": [3, 17, 40, 5, 88, 1, 60]}, {"a": [9], "b": [4, 70]}, {"a": [21], "b": [7]}]
STEPS += [{"a": [5]}, {"a": list(range(30, 39))}]


def test_folded_norms_give_the_model_within_the_rounding_they_move(dense_model, monkeypatch):
    """fp32: the folded model's logits are the unfolded one's but for the order of the norm's
    multiplications; the folded steps call the norm twice (the first layer's input norm and
    the final norm), the others once per norm."""
    want = _steps(dense_model, STEPS)
    calls = []
    real = norms.rms_norm
    monkeypatch.setattr(norms, "rms_norm", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(qwen3_5, "takes_norm_folds", lambda x: 2 <= x.shape[0] <= 8)
    monkeypatch.setattr(dense_model, "fold_norms", True)
    counts = []
    got = _steps(dense_model, STEPS, calls, counts)
    norms_per_step = 2 * len(dense_model.layers) + 1
    assert counts == [2, 2, 2, norms_per_step, norms_per_step]
    for ours, ref in zip(got, want, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


def test_only_a_model_whose_products_take_the_fold_folds(dense_model, tmp_path):
    """The CPU keeps linears dense: no layer folds. A MoE layer never does."""
    assert not dense_model.fold_norms
    assert not any(layer.folds_norms() for layer in dense_model.layers)
    moe = load_ours(
        convert_to_artifact(make_hf_model("moe_top2_mha_untied"), tmp_path), torch.float32
    )
    assert not any(layer.folds_norms() for layer in moe.layers)

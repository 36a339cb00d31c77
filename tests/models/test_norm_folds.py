"""Decoder norms folded into their neighbouring products (`kernels/norm_fold.py`), on the CPU:
the model's wiring (which product folds which norm, what each layer hands the next) through
the reference fallbacks, against the model with every norm its own call; and which models
fold. The GPU kernels run it in tests/gpu/test_norm_fold_gpu.py."""

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
    """The logits of each step, two sequences; with `calls`, what it held after each step is
    put in `counts` (it is cleared before each)."""
    runner = Runner(model)
    runner.add("a")
    runner.add("b")
    out = []
    for step in steps:
        if calls is not None:
            calls.clear()
        out.append(torch.cat(list(runner.step(step).values())))
        if calls is not None:
            counts.append(sorted(calls))
    return out


# rows per step: 2 to 8 fold, 1 and 9 do not; the third is a decode step of two sequences
STEPS = [{"a": [3, 17, 40, 5, 88, 1, 60]}, {"a": [9], "b": [4, 70]}, {"a": [21], "b": [7]}]
STEPS += [{"a": [5]}, {"a": list(range(30, 39))}]


def test_folded_norms_give_the_model_within_the_rounding_they_move(dense_model, monkeypatch):
    """fp32: the folded model's logits are the unfolded one's but for the order of the norms'
    multiplications. Folded steps call the RMS norm twice (the first layer's input norm and
    the final norm), and a folded decode step no GDN output norm; the others call each norm
    once a layer."""
    want = _steps(dense_model, STEPS)
    calls = []
    rms, gated = norms.rms_norm, norms.gated_rms_norm
    monkeypatch.setattr(norms, "rms_norm", lambda *args: calls.append("rms") or rms(*args))
    monkeypatch.setattr(norms, "gated_rms_norm", lambda *a: calls.append("gated") or gated(*a))
    monkeypatch.setattr(qwen3_5, "takes_norm_folds", lambda x: 2 <= x.shape[0] <= 8)
    monkeypatch.setattr(dense_model, "fold_norms", True)
    counts = []
    got = _steps(dense_model, STEPS, calls, counts)
    layers = dense_model.layers
    gdn = ["gated"] * sum(layer.layer_type == "linear_attention" for layer in layers)
    unfolded = gdn + ["rms"] * (2 * len(layers) + 1)
    assert counts == [gdn + ["rms"] * 2, gdn + ["rms"] * 2, ["rms"] * 2, unfolded, unfolded]
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

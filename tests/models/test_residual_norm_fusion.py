"""Each decoder layer leaves its residual adds to the norms after them (the next layer's input
norm, its own post-attention norm, the final norm), which on the GPU add and normalise in one
kernel. On the CPU the model must give the bits of the textbook form
h = h + mixer(norm(h)); h = h + mlp(norm(h))."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen import Runner, convert_to_artifact, load_ours, make_hf_model

from ninfer.models.layers import norms


class UnfusedForward:
    """The model with its forward written out with explicit residual adds; every other
    attribute (cache spec, logits, dtype) is the model's own."""

    def __init__(self, model) -> None:
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    @torch.inference_mode()
    def __call__(self, input_ids, positions, ctx) -> torch.Tensor:
        m = self.model
        hidden = m.embed_tokens(input_ids)
        cos, sin = m.rotary.cos_sin(positions, hidden.dtype)
        for layer in m.layers:
            normed = layer.input_layernorm(hidden)
            if layer.layer_type == "full_attention":
                hidden = hidden + layer.self_attn(normed, cos, sin, ctx)
            else:
                hidden = hidden + layer.linear_attn(normed, ctx)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return m.norm(hidden)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    built = {}

    def get(name: str, dtype: torch.dtype):
        if name not in built:
            hf = make_hf_model(name)
            built[name] = convert_to_artifact(hf, tmp_path_factory.mktemp(name))
        return load_ours(built[name], dtype)

    return get


@pytest.mark.parametrize("name", ["dense_3gdn_1attn_gqa2", "moe_top2_mha_untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_residual_adds_give_the_unfused_bits(tiny_models, name, dtype):
    model = tiny_models(name, dtype)
    fused, unfused = Runner(model), Runner(UnfusedForward(model))
    steps = [[3, 17, 40, 5, 88, 1, 60], [9], [21], [4, 70]]
    for runner in (fused, unfused):
        runner.add("a")
    for new_tokens in steps:
        logits = fused.step({"a": new_tokens})["a"]
        ref_logits = unfused.step({"a": new_tokens})["a"]
        assert torch.equal(fused.hidden["a"], unfused.hidden["a"])
        assert torch.equal(logits, ref_logits)


def test_every_residual_add_but_the_first_is_fused_into_a_norm(tiny_models, monkeypatch):
    """One decode step: of the 2 * layers residual adds, the embeddings' first is not an add at
    all; the rest, and the final norm's, arrive as a norm's residual, none as a separate add."""
    model = tiny_models("dense_3gdn_1attn_gqa2", torch.float32)
    runner = Runner(model)
    runner.add("a")
    runner.step({"a": [3, 17, 40]})
    fused_norms, plain_norms = [], []
    real = norms.rms_norm

    def recording(x, weight, eps, residual=None, split=None):
        (plain_norms if residual is None else fused_norms).append(x.shape)
        return real(x, weight, eps, residual, split)

    monkeypatch.setattr(norms, "rms_norm", recording)
    runner.step({"a": [9]})
    layers = len(model.layers)
    hidden = model.config.hidden_size
    assert fused_norms == [(1, hidden)] * (2 * layers)
    # the first layer's input norm only: q_norm and k_norm run in the attention prelude
    assert plain_norms == [(1, hidden)]

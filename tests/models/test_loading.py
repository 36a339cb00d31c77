"""Loading by logical name: the registry picks the class from architectures / model_type and
names the supported ones when it cannot; quantized artifacts are dequantized on load."""

import pytest
import torch
from tiny_qwen import Runner, rel_err

from ninfer.artifact.artifact import Artifact
from ninfer.errors import UnsupportedModelError
from ninfer.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ninfer.models.registry import load_model, model_class


def test_registry_maps_architectures_and_model_types():
    assert model_class({"architectures": ["Qwen3_5ForConditionalGeneration"]}) is Qwen3_5ForCausalLM
    assert model_class({"model_type": "qwen3_5_moe"}) is Qwen3_5MoeForCausalLM
    assert model_class({"model_type": "qwen3_5_text"}) is Qwen3_5ForCausalLM


def test_unknown_model_is_an_error_listing_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="qwen3_5, qwen3_5_moe"):
        model_class({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


def logits_of(path, dtype=torch.float32):
    artifact = Artifact.open(path)
    model = load_model(artifact, artifact.config(), dtype=dtype)
    runner = Runner(model)
    runner.add("a")
    return runner.step({"a": list(range(0, 300, 3))})["a"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_groupwise_int_artifact_loads_dequantized_close_to_fp32(tiny_artifact, moe):
    _, exact = tiny_artifact(weights="fp32", moe=moe, seed=3)
    _, quantized = tiny_artifact(weights="groupwise-int", moe=moe, seed=3)
    # 4-bit weights move these tiny random logits by ~12%; a misread layout moves them by ~100%
    assert rel_err(logits_of(quantized), logits_of(exact)) <= 0.25


def test_bf16_artifact_loads_in_bf16(tiny_artifact):
    _, path = tiny_artifact(weights="bf16", tie=True)
    artifact = Artifact.open(path)
    model = load_model(artifact, artifact.config(), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not hasattr(model, "lm_head")
    assert model.cache_spec().num_attention_layers == 2  # 4 layers, every 2nd is attention

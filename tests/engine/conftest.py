"""Engine fixtures: one tiny fp32 artifact (converted once per session) with its byte-level
tokenizer, the transformers model it came from, and a factory of step-by-step engine cores."""

from __future__ import annotations

import pytest
import torch
from helpers import convert_tiny

from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import load_core


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(checkpoint_dir, artifact_path) of a tiny random dense Qwen3.5 in fp32."""
    return convert_tiny(tmp_path_factory.mktemp("engine-tiny"), weights="fp32")


@pytest.fixture(scope="session")
def artifact_path(tiny):
    return tiny[1]


@pytest.fixture(scope="session")
def hf_model(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()


@pytest.fixture
def make_core(artifact_path):
    """make_core(**EngineConfig fields) -> an EngineCore on CPU in fp32, driven by `step()`."""

    def build(**fields):
        fields.setdefault("device", "cpu")
        fields.setdefault("dtype", "float32")
        # chunk tests ask for small chunks: keep them when nothing decodes too
        fields.setdefault("idle_prefill_chunk", fields.get("prefill_chunk", 1))
        return load_core(artifact_path, EngineConfig(**fields))

    return build

"""Fixtures shared by the whole suite. Helpers that build tiny checkpoints live in helpers.py."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in Triton's interpreter, which must be switched on
# before Triton is first imported by any test module (tests/kernels/test_triton_interpreted.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import convert_tiny, make_tiny_checkpoint


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """A factory: tiny_checkpoint(**options) -> path of a fresh tiny HF checkpoint directory."""
    counter = iter(range(1_000_000))

    def build(**options):
        return make_tiny_checkpoint(tmp_path / f"hf-{next(counter)}", **options)

    return build


@pytest.fixture
def tiny_artifact(tmp_path):
    """A factory: tiny_artifact(weights=..., **checkpoint options) -> (checkpoint_dir, artifact_path)."""
    counter = iter(range(1_000_000))

    def build(**options):
        directory = tmp_path / f"tiny-{next(counter)}"
        directory.mkdir()
        return convert_tiny(directory, **options)

    return build

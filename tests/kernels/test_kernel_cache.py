"""Triton's kernel and autotune cache goes to the ninfer cache directory unless the user chose."""

from __future__ import annotations

import os

from ninfer.kernels.kernel_cache import persist_triton_cache

VARIABLES = ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "FLA_CACHE_RESULTS", "XDG_CACHE_HOME")


def test_cache_lands_under_ninfer_cache_dir(monkeypatch, tmp_path):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    assert persist_triton_cache() == tmp_path / "triton"

    assert os.environ["FLA_CACHE_RESULTS"] == "1" and os.environ["TRITON_CACHE_AUTOTUNING"] == "1"


def test_user_choice_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("FLA_CACHE_RESULTS", "0")
    assert persist_triton_cache() == tmp_path / "mine"

    assert os.environ["FLA_CACHE_RESULTS"] == "0"

"""Where compiled Triton kernels and autotune results live between runs.

Triton keeps both on disk in its cache directory; fla-core's chunked Gated DeltaNet kernels
autotune once per head shape (about 50 s on an H200 the first time) and, with
`FLA_CACHE_RESULTS=1`, store the winning configs there too. We point that directory at
`<ninfer cache>/triton` so a server start after the first finds everything compiled and tuned:
`$NINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/ninfer`, else `~/.cache/ninfer`. Variables the user
set (`TRITON_CACHE_DIR`, `FLA_CACHE_RESULTS`, `TRITON_CACHE_AUTOTUNING`) are left alone. Only
environment variables change here: Triton reads them when it first compiles, so this must run
before the first kernel launch, not before the first import.
"""

from __future__ import annotations

import os
from pathlib import Path


def ninfer_cache_dir() -> Path:
    if os.environ.get("NINFER_CACHE_DIR"):
        return Path(os.environ["NINFER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ninfer"


def persist_triton_cache() -> Path:
    """Send Triton's kernel and autotune cache to the ninfer cache directory (unless the user
    chose one) and keep autotune results there; returns the directory in use."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(ninfer_cache_dir() / "triton"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # every autotuner, not only fla's
    os.environ.setdefault("FLA_CACHE_RESULTS", "1")
    return Path(os.environ["TRITON_CACHE_DIR"])

"""ninfer: an inference engine and server for Qwen3.5-family models.

`import ninfer` stays light: `Engine`, `AsyncEngine`, `SamplingParams` and friends load (with
torch) on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "ninfer.engine.engine",
    "AsyncEngine": "ninfer.engine.engine",
    "Completion": "ninfer.engine.engine",
    "EngineConfig": "ninfer.engine.config",
    "SamplingParams": "ninfer.engine.request",
    "GenerationRequest": "ninfer.engine.request",
    "TokenEvent": "ninfer.engine.request",
}

__all__ = [
    "AsyncEngine",
    "Completion",
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "SamplingParams",
    "TokenEvent",
    "__version__",
]

if TYPE_CHECKING:
    from ninfer.engine.config import EngineConfig
    from ninfer.engine.engine import AsyncEngine, Completion, Engine
    from ninfer.engine.request import GenerationRequest, SamplingParams, TokenEvent


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

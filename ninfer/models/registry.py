"""Maps a checkpoint's `architectures` / `model_type` to its model class, and loads it."""

from __future__ import annotations

from typing import Any

import torch

from ninfer.errors import UnsupportedModelError
from ninfer.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from ninfer.models.weights import WeightSource
from ninfer.parallel.shard import Shard

MODEL_TYPES: dict[str, type[Qwen3_5ForCausalLM]] = {
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
}
ARCHITECTURES: dict[str, type[Qwen3_5ForCausalLM]] = {
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}


def model_class(config: dict[str, Any]) -> type[Qwen3_5ForCausalLM]:
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = config.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise UnsupportedModelError(
        f"unsupported model (architectures={config.get('architectures')}, "
        f"model_type={model_type!r}); supported model_type: {', '.join(sorted(MODEL_TYPES))}"
    )


def load_model(
    source: WeightSource,
    config: dict[str, Any] | None = None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    shard: Shard | None = None,
) -> Qwen3_5ForCausalLM:
    """Load the model for `config` (default: the source's own text config, for an Artifact)
    with weights from `source` by logical name, in `dtype` on `device`; with a `shard`, only
    this rank's part (ninfer/parallel/shard.py)."""
    if config is None:
        config = source.config()  # type: ignore[attr-defined]
    return model_class(config).from_source(source, config, device=device, dtype=dtype, shard=shard)

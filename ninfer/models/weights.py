"""Weight sources: anything with `tensor(name, dtype=None)` and `has(name)` over logical names
(`text/...`, `mtp/...`). `Artifact` is one; `StateDictSource` wraps a dict of tensors, e.g. an HF
model's state_dict renamed by `hf_to_logical`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch


class WeightSource(Protocol):
    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


class StateDictSource:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    @classmethod
    def from_hf_state_dict(cls, state_dict: Mapping[str, torch.Tensor]) -> StateDictSource:
        return cls(hf_to_logical(state_dict))

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"no tensor {name!r} in the weight source")
        value = self.tensors[name]
        return value if dtype is None else value.to(dtype)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def names(self, prefix: str = "") -> list[str]:
        return sorted(n for n in self.tensors if n.startswith(prefix))


def hf_to_logical(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an HF Qwen3.5 text state_dict (runtime layout, fused experts) to logical names.

    Drops `lm_head.weight` when it is the embedding itself (tied), and vision tensors.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.startswith("mtp."):
            out["mtp/" + key.removeprefix("mtp.")] = value
            continue
        if key.startswith(("model.visual.", "visual.")):
            continue
        name = key.removeprefix("model.language_model.").removeprefix("model.")
        out["text/" + name] = value
    head, embed = out.get("text/lm_head.weight"), out.get("text/embed_tokens.weight")
    if head is not None and embed is not None and head.data_ptr() == embed.data_ptr():
        del out["text/lm_head.weight"]
    return out

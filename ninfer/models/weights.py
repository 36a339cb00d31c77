"""Weight sources: anything with `tensor(name, dtype=None)` and `has(name)` over logical names
(`text/...`, `mtp/...`). `Artifact` is one; `StateDictSource` wraps a dict of tensors under those
names (random bench weights, test fixtures)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from ninfer.quant import EncodedTensor


class WeightSource(Protocol):
    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def has(self, name: str) -> bool: ...


class StateDictSource:
    """Tensors by logical name; `encoded` optionally holds some of them in a stored format
    (what `Artifact.encoded` returns), e.g. the bench's random quantized weights."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        encoded: Mapping[str, EncodedTensor] | None = None,
    ) -> None:
        self.tensors = dict(tensors)
        self.encoded_tensors = dict(encoded or {})

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        if name in self.encoded_tensors:
            return self.encoded_tensors[name].decode(dtype)
        if name not in self.tensors:
            raise KeyError(f"no tensor {name!r} in the weight source")
        value = self.tensors[name]
        return value if dtype is None else value.to(dtype)

    def encoded(self, name: str) -> EncodedTensor:
        """The stored form of a tensor given encoded; KeyError for plain ones."""
        if name not in self.encoded_tensors:
            raise KeyError(f"tensor {name!r} is not stored encoded")
        return self.encoded_tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors or name in self.encoded_tensors

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.encoded_tensors:
            return tuple(self.encoded_tensors[name].shape)
        return tuple(self.tensors[name].shape)

    def names(self, prefix: str = "") -> list[str]:
        names = set(self.tensors) | set(self.encoded_tensors)
        return sorted(n for n in names if n.startswith(prefix))

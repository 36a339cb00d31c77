"""Conversion recipes: which checkpoint tensors become which logical tensors, in which format.

A recipe is a built-in name (`qwen3_5`, `qwen3_5_moe`) or a Python file that defines `RECIPE`,
an object with `name`, `plan(checkpoint, components, profile) -> ConversionPlan` (usually a
`Qwen3_5Recipe` or subclass with `choose_format` overridden)."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ninfer.artifact.checkpoint import Checkpoint
from ninfer.errors import ConversionError

BUILTIN_RECIPES = ("qwen3_5", "qwen3_5_moe")
PROFILES = ("bf16", "fp32", "groupwise-int")


@dataclass(slots=True)
class TensorPlan:
    """One logical tensor: where it comes from in the checkpoint and how it is stored.

    `combine` is `single` (one key), `stack` (keys stacked on a new leading dimension) or
    `stack_pairs` (keys alternate gate, up per expert: each pair is concatenated along rows,
    then the pairs are stacked, giving [E, 2I, H])."""

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]
    format: str
    combine: str = "single"

    def load(self, checkpoint: Checkpoint) -> torch.Tensor:
        if self.combine == "single":
            tensor = checkpoint.load(self.sources[0])
        elif self.combine == "stack":
            tensor = torch.stack([checkpoint.load(key) for key in self.sources])
        elif self.combine == "stack_pairs":
            pairs = zip(self.sources[0::2], self.sources[1::2])
            tensor = torch.stack(
                [torch.cat([checkpoint.load(g), checkpoint.load(u)]) for g, u in pairs]
            )
        else:
            raise ConversionError(f"tensor {self.name}: unknown combine rule {self.combine!r}")
        if tuple(tensor.shape) != self.shape:
            raise ConversionError(
                f"tensor {self.name}: checkpoint gives shape {list(tensor.shape)}, planned {list(self.shape)}"
            )
        return tensor


@dataclass(slots=True)
class ConversionPlan:
    components: dict[str, dict]  # component -> {"config": ..., "target"?: ...}
    tensors: list[TensorPlan]
    warnings: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> number of checkpoint keys


class Recipe(Protocol):
    name: str

    def plan(
        self, checkpoint: Checkpoint, components: set[str] | None, profile: str
    ) -> ConversionPlan: ...


def load_recipe(spec: str) -> Recipe:
    """A built-in recipe by name, or `RECIPE` from a Python file."""
    if spec.endswith(".py") or "/" in spec:
        path = Path(spec)
        if not path.is_file():
            raise ConversionError(f"{path}: recipe file not found")
        if path.suffix != ".py":
            raise ConversionError(f"{path}: a recipe file is a Python file (.py)")
        module_spec = importlib.util.spec_from_file_location(f"ninfer_recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise ConversionError(
                f"{path}: recipe failed to load ({type(exc).__name__}: {exc})"
            ) from None
        recipe = getattr(module, "RECIPE", None)
        if recipe is None or not hasattr(recipe, "plan"):
            raise ConversionError(f"{path}: defines no RECIPE with a plan() method")
        return recipe
    if spec not in BUILTIN_RECIPES:
        raise ConversionError(
            f"unknown recipe {spec!r} (built-in: {', '.join(BUILTIN_RECIPES)}; or a path to a .py file)"
        )
    return importlib.import_module(f"ninfer.artifact.recipes.{spec}").RECIPE

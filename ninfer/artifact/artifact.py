"""`Artifact`: the logical view of a `.ninfer` container that models and the engine use: HF
configs per component, resources by role, and tensors by logical name (`text/...`, `mtp/...`)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from ninfer.artifact.container import Container
from ninfer.errors import ArtifactError
from ninfer.quant import EncodedTensor, get_format


class Artifact:
    """A memory-mapped artifact. Plain tensors (bf16/fp32/int32) are views of the mapping."""

    def __init__(self, container: Container):
        self.container = container
        self.path = container.path
        self.root = container.root
        for component, spec in self.root["components"].items():
            if not (
                isinstance(spec, dict)
                and isinstance(spec.get("config", {}), dict)
                and isinstance(spec.get("resources", {}), dict)
            ):
                raise ArtifactError(f"{self.path}: component {component!r} is malformed")
        self._bindings: dict[str, dict] = container.root["bindings"]
        for name, binding in self._bindings.items():
            refs = _binding_objects(binding)
            if not refs:
                raise ArtifactError(f"{self.path}: binding {name} is malformed or names no object")
            for ref in refs:
                if (
                    not isinstance(ref, str)
                    or container.objects.get(ref, {}).get("kind") != "tensor"
                ):
                    raise ArtifactError(
                        f"{self.path}: binding {name} refers to missing tensor object {ref!r}"
                    )

    @classmethod
    def open(cls, path: str | os.PathLike, verify: bool = False) -> Artifact:
        container = Container.open(Path(path))
        if verify:
            container.verify()
        return cls(container)

    # components and resources ---------------------------------------------------------------

    @property
    def components(self) -> list[str]:
        return list(self.root["components"])

    @property
    def metadata(self) -> dict:
        return self.root.get("metadata", {})

    def _component(self, component: str) -> dict:
        try:
            return self.root["components"][component]
        except KeyError:
            raise ArtifactError(
                f"{self.path}: no component {component!r} (has {', '.join(self.components)})"
            ) from None

    def config(self, component: str = "text") -> dict:
        """The Hugging Face config.json stored in the component, unchanged."""
        return copy.deepcopy(self._component(component).get("config", {}))

    def resource(self, role: str, component: str = "text") -> bytes | None:
        object_id = self._component(component).get("resources", {}).get(role)
        if object_id is None:
            return None
        return self.container.object_bytes(object_id).numpy().tobytes()

    # tensors ---------------------------------------------------------------------------------

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self._bindings if name.startswith(prefix))

    def has(self, name: str) -> bool:
        return name in self._bindings

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical tensor's shape, read from the container's index (no data)."""
        binding = self._binding(name)
        if "object" in binding:
            return tuple(self.container.object(binding["object"])["shape"])
        return tuple(binding["shape"])

    def _binding(self, name: str) -> dict:
        try:
            return self._bindings[name]
        except KeyError:
            raise ArtifactError(f"{self.path}: no tensor named {name!r}") from None

    def _encoded_object(self, object_id: str) -> EncodedTensor:
        obj = self.container.object(object_id)
        fmt = get_format(obj["format"])
        return fmt.from_bytes(self.container.object_bytes(object_id), tuple(obj["shape"]))

    def encoded(self, name: str) -> EncodedTensor:
        """The stored planes (codes, scales, ...) and their format, for kernels that decode on the fly."""
        binding = self._binding(name)
        if "object" not in binding:
            raise ArtifactError(
                f"{self.path}: tensor {name} is bound to parts of other objects; decode it with tensor()"
            )
        return self._encoded_object(binding["object"])

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical tensor: a zero-copy view for plain formats, dequantized (fp32 unless
        `dtype` says otherwise) for quantized ones. Views share one copy-on-write mapping:
        modifying one in place changes what later calls return (never the file), so copy first."""
        binding = self._binding(name)
        if "object" in binding:
            return self._encoded_object(binding["object"]).decode(dtype)
        pieces = []
        for part in binding["parts"]:
            begin, end = part["range"]
            flat = self._encoded_object(part["object"]).decode(dtype).reshape(-1)
            pieces.append(flat[begin:end])
        return torch.cat(pieces).reshape(binding["shape"])

    def verify(self) -> int:
        """Check every object's checksum; returns how many objects were checked."""
        return self.container.verify()


def _binding_objects(binding: object) -> list:
    """The object ids a binding refers to; empty when the binding is malformed."""
    if not isinstance(binding, dict):
        return []
    if "object" in binding:
        return [binding["object"]]
    parts, shape = binding.get("parts"), binding.get("shape")
    well_formed = (
        isinstance(parts, list)
        and isinstance(shape, list)
        and all(
            isinstance(p, dict)
            and isinstance(p.get("range"), list)
            and len(p["range"]) == 2
            and all(isinstance(i, int) for i in p["range"])
            for p in parts
        )
    )
    return [p.get("object") for p in parts] if well_formed else []

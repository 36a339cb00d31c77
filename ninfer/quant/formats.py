"""Weight formats: the registry, the plane layout every format shares, and the plain formats
(bf16, fp32, int32). Quantized formats live in their own modules and register themselves here.

A format turns a logical tensor into named *planes* (codes, scales, ...). Every plane's leading
dimension is the tensor's row count (the product of all dimensions but the last), so a tensor can
be encoded a slab of rows at a time and the slabs concatenated. In the stored object the planes
follow one another in the format's order, each starting at a multiple of 256 bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PLANE_ALIGN = 256


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class PlaneSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(slots=True)
class EncodedTensor:
    """A logical tensor in its stored form: what GPU kernels consume (`Artifact.encoded`)."""

    format: str
    layout: str
    shape: tuple[int, ...]
    planes: dict[str, torch.Tensor]

    def decode(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return get_format(self.format).decode(self.planes, self.shape, dtype)


def rows_and_k(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor is handled as [rows, K] with K its last dimension; a scalar is one 1-element row."""
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


class WeightFormat:
    """One stored representation. Subclasses set `name`, `layout`, and implement the three hooks."""

    name: str = ""
    layout: str = ""
    quantized: bool = False

    def plane_specs(self, shape: tuple[int, ...]) -> list[PlaneSpec]:
        raise NotImplementedError

    def encode_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode a [rows, K] slab; returns planes whose leading dimension is that row count."""
        raise NotImplementedError

    def decode(
        self, planes: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype.is_floating_point

    # Shared machinery -------------------------------------------------------------------------

    def encoded_nbytes(self, shape: tuple[int, ...]) -> int:
        end = 0
        for spec in self.plane_specs(tuple(shape)):
            end = align_up(end, PLANE_ALIGN) + spec.nbytes
        return end

    def encode(self, tensor: torch.Tensor, rows_per_slab: int | None = None) -> EncodedTensor:
        """Encode a whole tensor, optionally a slab of rows at a time to bound temporary memory."""
        shape = tuple(tensor.shape)
        if not self.accepts(tensor.dtype):
            raise ValueError(f"format {self.name} cannot store a {tensor.dtype} tensor")
        n_rows, k = rows_and_k(shape)
        rows = tensor.reshape(n_rows, k)
        step = n_rows if not rows_per_slab else max(1, rows_per_slab)
        slabs = [self.encode_rows(rows[i : i + step]) for i in range(0, n_rows, step)] or [
            self.encode_rows(rows)
        ]
        if len(slabs) == 1:
            planes = slabs[0]
        else:
            planes = {key: torch.cat([s[key] for s in slabs]) for key in slabs[0]}
        return EncodedTensor(self.name, self.layout, shape, planes)

    def to_bytes(self, encoded: EncodedTensor) -> torch.Tensor:
        """The stored object as a flat uint8 tensor (planes at 256-byte aligned offsets)."""
        specs = self.plane_specs(encoded.shape)
        if len(specs) == 1:
            plane = encoded.planes[specs[0].name].contiguous()
            return plane.reshape(-1).view(torch.uint8)
        out = torch.zeros(self.encoded_nbytes(encoded.shape), dtype=torch.uint8)
        offset = 0
        for spec in specs:
            offset = align_up(offset, PLANE_ALIGN)
            plane = encoded.planes[spec.name].contiguous().reshape(-1).view(torch.uint8)
            if plane.numel() != spec.nbytes:
                raise ValueError(
                    f"{self.name}: plane {spec.name} has {plane.numel()} bytes, expected {spec.nbytes}"
                )
            out[offset : offset + spec.nbytes] = plane
            offset += spec.nbytes
        return out

    def from_bytes(self, data: torch.Tensor, shape: tuple[int, ...]) -> EncodedTensor:
        """View a stored object (flat uint8) as planes, without copying when aligned."""
        planes = {}
        offset = 0
        for spec in self.plane_specs(tuple(shape)):
            offset = align_up(offset, PLANE_ALIGN)
            raw = data[offset : offset + spec.nbytes]
            planes[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
            offset += spec.nbytes
        return EncodedTensor(self.name, self.layout, tuple(shape), planes)


class PlainFormat(WeightFormat):
    """Values stored as-is, little-endian, C order (`contiguous_le_v1`)."""

    layout = "contiguous_le_v1"

    def __init__(self, name: str, dtype: torch.dtype):
        self.name = name
        self.dtype = dtype

    def accepts(self, dtype: torch.dtype) -> bool:
        if self.dtype.is_floating_point:
            return dtype.is_floating_point
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool

    def plane_specs(self, shape: tuple[int, ...]) -> list[PlaneSpec]:
        return [PlaneSpec("data", self.dtype, tuple(shape))]

    def encode_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.dtype.is_floating_point:
            info = torch.iinfo(self.dtype)
            if rows.numel() and (rows.min() < info.min or rows.max() > info.max):
                raise ValueError(f"format {self.name}: values out of range")
        return {"data": rows.to(self.dtype)}

    def encode(self, tensor: torch.Tensor, rows_per_slab: int | None = None) -> EncodedTensor:
        shape = tuple(tensor.shape)
        if not self.accepts(tensor.dtype):
            raise ValueError(f"format {self.name} cannot store a {tensor.dtype} tensor")
        data = self.encode_rows(tensor)["data"].contiguous()
        return EncodedTensor(self.name, self.layout, shape, {"data": data})

    def decode(
        self, planes: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> torch.Tensor:
        data = planes["data"].reshape(shape)
        return data if dtype is None or dtype == data.dtype else data.to(dtype)


_REGISTRY: dict[str, WeightFormat] = {}


def register_format(fmt: WeightFormat) -> WeightFormat:
    if fmt.name in _REGISTRY:
        raise ValueError(f"weight format {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt
    return fmt


def get_format(name: str) -> WeightFormat:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown weight format {name!r} (known: {known})") from None


def format_names() -> list[str]:
    return sorted(_REGISTRY)


register_format(PlainFormat("bf16", torch.bfloat16))
register_format(PlainFormat("fp32", torch.float32))
register_format(PlainFormat("int32", torch.int32))

"""`GroupwiseLinear`: a bias-free linear layer whose weight stays in its stored group-wise int
form (`q8_g32_fp16`, `q4_g64_fp16`) on the GPU. Decode-sized batches run the grouped-int GEMV,
which reads the codes once and dequantizes in registers; larger batches (prefill) dequantize
the weight to the activation dtype (the Triton dequantization kernel, at about the copy rate)
into one transient buffer and run a dense matmul, which is compute-bound anyway.

`quantize_linears` swaps the `nn.Linear`s of a model built on the meta device for these where
the weight source stores a supported format. It is used on CUDA in half precision only: the
CPU path keeps every weight dequantized at load, so it stays the exact reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels.dispatch import groupwise_dequant, groupwise_linear
from ninfer.quant import EncodedTensor

# Rows up to this many go through the GEMV; beyond it a dequantized bf16 matmul is faster.
GEMV_MAX_ROWS = 16


def encoded_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x [M, K] @ W.T for an encoded [N, K] weight: the GEMV for up to `GEMV_MAX_ROWS` rows,
    else the weight dequantized to x's dtype and a dense matmul."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return groupwise_linear(x.contiguous(), weight)
    return F.linear(x, groupwise_dequant(weight, x.dtype))


class GroupwiseLinear(nn.Module):
    def __init__(self, encoded: EncodedTensor) -> None:
        super().__init__()
        if len(encoded.shape) != 2:
            raise ValueError(f"a linear weight is 2-D, got shape {encoded.shape}")
        self.format = encoded.format
        self.layout = encoded.layout
        self.shape = tuple(encoded.shape)
        self.plane_names = tuple(encoded.planes)
        for name, plane in encoded.planes.items():
            self.register_buffer(name, plane, persistent=False)

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def encoded(self) -> EncodedTensor:
        planes = {name: getattr(self, name) for name in self.plane_names}
        return EncodedTensor(self.format, self.layout, self.shape, planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return encoded_linear(x, self.encoded)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


# The formats `groupwise_gemv_triton.SUPPORTED` runs (a GPU test keeps the two equal); named
# here so that deciding what to keep encoded never imports Triton.
GEMV_FORMATS = frozenset({"q8_g32_fp16", "q4_g64_fp16"})


def quantize_linears(model: nn.Module, source, device: torch.device, to_logical) -> list[str]:
    """Replace every `nn.Linear` of `model` whose weight `source.encoded(name)` stores in a GEMV
    format by a `GroupwiseLinear` holding the planes on `device`. `to_logical` maps a parameter
    name to its logical tensor name. Returns the replaced modules' names."""
    encoded_of = getattr(source, "encoded", None)
    if encoded_of is None:
        return []
    replaced = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        try:
            encoded = encoded_of(to_logical(f"{name}.weight"))
        except (KeyError, ArtifactError):
            continue  # not stored as one object (parts), or not in the source
        if encoded.format not in GEMV_FORMATS or tuple(encoded.shape) != tuple(module.weight.shape):
            continue
        planes = {key: plane.to(device) for key, plane in encoded.planes.items()}
        layer = GroupwiseLinear(
            EncodedTensor(encoded.format, encoded.layout, encoded.shape, planes)
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        replaced.append(name)
    return replaced

"""`GroupwiseLinear`: a bias-free linear layer whose weight stays in its stored group-wise int
form (`q8_g32_fp16`, `q4_g64_fp16`) on the GPU. Decode-sized batches run the grouped-int GEMV,
which reads the codes once and dequantizes in registers; larger batches (prefill) dequantize
the weight to the activation dtype (the Triton dequantization kernel, at about the copy rate)
into one transient buffer and run a dense matmul, which is compute-bound anyway.

`quantize_linears` swaps the `nn.Linear`s of a model built on the meta device for these where
the weight source stores a supported format, or q5_g64/q6_g64 (the head of the groupwise-int
profile), which are widened to q8_g32 holding the same values: read at 8.5 bits per weight
instead of as a 16-bit dequantized matrix (the 27B head: 1.35 GB a step instead of 2.54). A
q6 head is also kept as stored for decode-sized products, read at 6.25 bits (0.99 GB): one row
by the integer GEMV, two to eight by the Gluon kernel on Hopper. It is used on CUDA in half
precision only: the CPU path keeps every weight dequantized at load, so it stays the exact
reference.

`fuse_linears` stacks the weight rows of linears that read one input into one `FusedLinear`
after loading, so a decode step launches one GEMV where it launched several (row_groups_v1
stores every row on its own, so stacked planes are a valid encoded tensor; a row's dot product
is the same in the stacked matrix)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels.dispatch import (
    groupwise_dequant,
    groupwise_linear,
    groupwise_linear_then_norm,
    integer_linear,
    takes_q6_linear,
)
from ninfer.kernels.norm_fold import (
    FOLDED_ROWS,
    REFERENCE_BLOCK,
    HeadNormedRows,
    NormAfter,
    NormedRows,
    fold_norm,
)
from ninfer.kernels.x_split import INT_MAX_ROWS
from ninfer.quant import EncodedTensor
from ninfer.quant.groupwise import widen_to_q8

# Rows up to this many go through the GEMV; beyond it a dequantized bf16 matmul is faster.
GEMV_MAX_ROWS = 16
# Above GEMV_MAX_ROWS the weight is dequantized this many bytes of it at a time (so a head of
# 248k rows does not need its whole dense matrix at once: 2.5 GB at the 27B shape).
DEQUANT_BLOCK_BYTES = 512 << 20


def encoded_linear(x: torch.Tensor, weight: EncodedTensor) -> torch.Tensor:
    """x [M, K] @ W.T for an encoded [N, K] weight: the GEMV for up to `GEMV_MAX_ROWS` rows,
    else the weight dequantized to x's dtype, in blocks of rows of at most
    `DEQUANT_BLOCK_BYTES`, and a dense matmul per block."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return groupwise_linear(x.contiguous(), weight)
    rows, k = weight.shape
    block = max(1, DEQUANT_BLOCK_BYTES // (k * x.element_size()))
    if block >= rows:
        return F.linear(x, groupwise_dequant(weight, x.dtype))
    out = x.new_empty(x.shape[0], rows)
    for start in range(0, rows, block):
        part = _row_block(weight, start, min(start + block, rows))
        out[:, start : start + part.shape[0]] = F.linear(x, groupwise_dequant(part, x.dtype))
    return out


def _row_block(weight: EncodedTensor, start: int, end: int) -> EncodedTensor:
    """Rows [start, end) of an encoded [N, K] weight (`row_groups_v1` keeps every row apart)."""
    planes = {name: plane[start:end] for name, plane in weight.planes.items()}
    return EncodedTensor(weight.format, weight.layout, (end - start, weight.shape[1]), planes)


class GroupwiseLinear(nn.Module):
    """`one_row`: the same weight in a format only some kernels read (q6_g64 beside the q8_g32
    it widens to), which products of up to INT_MAX_ROWS rows read instead (the integer GEMV),
    and products of two to eight rows where the Gluon kernel takes them
    (`dispatch.takes_q6_linear`)."""

    def __init__(self, encoded: EncodedTensor, one_row: EncodedTensor | None = None) -> None:
        super().__init__()
        if len(encoded.shape) != 2:
            raise ValueError(f"a linear weight is 2-D, got shape {encoded.shape}")
        if one_row is not None and tuple(one_row.shape) != tuple(encoded.shape):
            raise ValueError(f"one-row weight {one_row.shape} for a {encoded.shape} linear")
        self.format = encoded.format
        self.layout = encoded.layout
        self.shape = tuple(encoded.shape)
        self.plane_names = tuple(encoded.planes)
        for name, plane in encoded.planes.items():
            self.register_buffer(name, plane, persistent=False)
        self.one_row_format = one_row.format if one_row is not None else None
        self.one_row_planes = tuple(one_row.planes) if one_row is not None else ()
        for name in self.one_row_planes:
            self.register_buffer(f"one_row_{name}", one_row.planes[name], persistent=False)

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

    @property
    def one_row(self) -> EncodedTensor | None:
        if self.one_row_format is None:
            return None
        planes = {name: getattr(self, f"one_row_{name}") for name in self.one_row_planes}
        return EncodedTensor(self.one_row_format, self.layout, self.shape, planes)

    @property
    def split_format(self) -> str:
        """The format whose x split a producer writes for this linear (`kernels/x_split.py`):
        the one-row weight's where there is one, as only one-row products read a split."""
        return self.one_row_format or self.format

    def forward(self, x: torch.Tensor | NormedRows | HeadNormedRows) -> torch.Tensor:
        """x may be a folded norm's rows (`kernels/norm_fold.py`), which the decode-sized
        product takes as they are and any other reads materialized."""
        one_row = self.one_row
        if isinstance(x, FOLDED_ROWS):
            if one_row is None and x.shape[0] <= GEMV_MAX_ROWS:
                return groupwise_linear(x, self.encoded)
            x = x.materialize()
        if one_row is not None and 0 < x.shape[0] <= INT_MAX_ROWS:
            return integer_linear(x.contiguous(), one_row)
        if one_row is not None and takes_q6_linear(x, one_row):
            return groupwise_linear(x, one_row)
        return encoded_linear(x, self.encoded)

    def extra_repr(self) -> str:
        one_row = f", one_row={self.one_row_format}" if self.one_row_format else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}{one_row}"
        )


# The formats `groupwise_gemv_triton.SUPPORTED` runs (a GPU test keeps the two equal); named
# here so that deciding what to keep encoded never imports Triton.
GEMV_FORMATS = frozenset({"q8_g32_fp16", "q4_g64_fp16"})
# Kept encoded too, widened to q8_g32 (`quant.groupwise.widen_to_q8`).
WIDENED_FORMATS = frozenset({"q5_g64_fp16", "q6_g64_fp16"})
# ... and those of them also kept as stored, for one- to eight-row products
# (`GroupwiseLinear.one_row`):
# the 27B head read at 6.25 bits a weight instead of 8.5 (0.99 GB a step instead of 1.35),
# for 0.99 GB more memory.
ONE_ROW_FORMATS = frozenset({"q6_g64_fp16"})


def quantize_linears(
    model: nn.Module, source, device: torch.device, to_logical, part_of=None
) -> list[str]:
    """Replace every `nn.Linear` of `model` whose weight `source.encoded(name)` stores in a GEMV
    format by a `GroupwiseLinear` holding the planes on `device`. `to_logical` maps a parameter
    name to its logical tensor name; `part_of(parameter name, encoded)` (tensor parallelism)
    cuts this rank's part of a stored weight, None where it cannot stay encoded. Returns the
    replaced modules' names."""
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
        if encoded.format not in GEMV_FORMATS | WIDENED_FORMATS:
            continue
        if part_of is not None:
            encoded = part_of(f"{name}.weight", encoded)
            if encoded is None:
                continue
        if tuple(encoded.shape) != tuple(module.weight.shape):
            continue
        planes = {key: plane.to(device) for key, plane in encoded.planes.items()}
        on_device = EncodedTensor(encoded.format, encoded.layout, encoded.shape, planes)
        one_row = on_device if encoded.format in ONE_ROW_FORMATS else None
        if encoded.format in WIDENED_FORMATS:
            on_device = widen_to_q8(on_device)
        layer = GroupwiseLinear(on_device, one_row)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer)
        replaced.append(name)
    return replaced


class FusedLinear(nn.Module):
    """Linears over one input run as one: `linear` holds their weight rows stacked in order,
    `forward` returns each one's output. On the GPU that is one product, split into views,
    except where encoded weights take more rows than the GEMV: those are dequantized one part
    at a time, so the transient dense weight of prefill is no larger than unfused. On the CPU,
    the reference path, each part is its own product over its rows of the stacked weight: MKL
    picks its kernel by the product's shape, so a stacked product can round differently (it
    does at a few rows per part), and the reference stays bit for bit what it was unfused."""

    def __init__(self, linear: nn.Module, out_features: Sequence[int]) -> None:
        super().__init__()
        if sum(out_features) != linear.out_features:
            raise ValueError(f"parts {tuple(out_features)} do not add up to {linear.out_features}")
        self.linear = linear
        self.split_sizes = tuple(out_features)

    def forward(self, x: torch.Tensor | NormedRows | HeadNormedRows) -> tuple[torch.Tensor, ...]:
        encoded = isinstance(self.linear, GroupwiseLinear)
        if isinstance(x, FOLDED_ROWS):
            if encoded and x.shape[0] <= GEMV_MAX_ROWS:
                return self.linear(x).split(self.split_sizes, dim=-1)
            x = x.materialize()
        if x.device.type != "cpu" and not (encoded and x.shape[0] > GEMV_MAX_ROWS):
            return self.linear(x).split(self.split_sizes, dim=-1)
        outputs, start = [], 0
        for rows in self.split_sizes:
            if encoded:
                part = _row_block(self.linear.encoded, start, start + rows)
                outputs.append(encoded_linear(x, part))
            else:
                outputs.append(F.linear(x, self.linear.weight[start : start + rows]))
            start += rows
        return tuple(outputs)

    def extra_repr(self) -> str:
        return f"split_sizes={self.split_sizes}"


def linear_then_norm(
    linear: nn.Module, x: torch.Tensor | HeadNormedRows, after: NormAfter | None
) -> torch.Tensor | tuple[NormedRows, torch.Tensor]:
    """linear(x), or with `after` the norm after it folded in: (norm(linear(x) + residual) as
    `NormedRows`, linear(x) + residual), from the product's epilogue where it is kept encoded
    and the kernel takes it (`dispatch.groupwise_linear_then_norm`), else computed after it.
    x may be the GDN output norm's folded rows."""
    if after is None:
        return linear(x)
    if isinstance(linear, GroupwiseLinear) and linear.one_row is None:
        return groupwise_linear_then_norm(x, linear.encoded, after)
    if isinstance(x, HeadNormedRows) and not isinstance(linear, GroupwiseLinear):
        x = x.materialize()
    return fold_norm(linear(x), after, REFERENCE_BLOCK)


def fuse_linears(linears: Sequence[nn.Module]) -> FusedLinear | None:
    """One `FusedLinear` computing the outputs of `linears` (bias-free, one input width), or
    None where their weights cannot be stacked: dense and encoded mixed, different dtypes,
    devices or formats, or one-row weights (`GroupwiseLinear.one_row`), which would be lost."""
    first = linears[0]
    if not all(linear.in_features == first.in_features for linear in linears):
        return None
    sizes = [linear.out_features for linear in linears]
    if all(type(linear) is nn.Linear and linear.bias is None for linear in linears):
        weights = [linear.weight for linear in linears]
        if len({(w.dtype, w.device) for w in weights}) != 1:
            return None
        with torch.device("meta"):
            stacked = nn.Linear(first.in_features, sum(sizes), bias=False)
        stacked.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
        return FusedLinear(stacked, sizes)
    if all(isinstance(linear, GroupwiseLinear) for linear in linears):
        stored = {(linear.format, linear.layout, linear.plane_names) for linear in linears}
        if len(stored) != 1 or any(linear.one_row_format for linear in linears):
            return None
        fmt, layout, plane_names = stored.pop()
        planes = {
            name: torch.cat([getattr(linear, name) for linear in linears]) for name in plane_names
        }
        shape = (sum(sizes), first.in_features)
        return FusedLinear(GroupwiseLinear(EncodedTensor(fmt, layout, shape, planes)), sizes)
    return None


def fuse_into(parent: nn.Module, fused_name: str, names: Sequence[str]) -> bool:
    """Replace `parent`'s linears `names` by `parent.<fused_name>`, a `FusedLinear` returning
    their outputs in that order, where `fuse_linears` can; the originals are dropped, so their
    weights are freed. Returns whether it fused."""
    fused = fuse_linears([getattr(parent, name) for name in names])
    if fused is None:
        return False
    for name in names:
        delattr(parent, name)
    setattr(parent, fused_name, fused)
    return True

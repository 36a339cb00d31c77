"""x split once, by the kernel that makes x. The one-row integer GEMV multiplies int8 codes of
x (`groupwise_gemv_triton`), and splitting x into them was one more small launch before every
product: 256 per 27B decode step. The kernels that write a GEMV's input (RMSNorm, the SwiGLU
product, the attention output gate, the GDN gated norm) write the codes beside their output
when asked with a `SplitRequest`, from the values in their registers
(`groupwise_gemv_triton.split_values`: no store and read-back), and attach them to it; the
GEMV takes attached codes of its own format and splits x itself otherwise, so nothing
depends on them being there.

Codes are trusted only while x is unchanged: a write into x, or into a view of it, after they
were attached bumps the tensor's version and they are ignored. Tensors made under
`torch.inference_mode` (the engine's forward) keep no version; there the contract is the
model's: each producer's output goes straight to its GEMV and nothing writes into it between.
Importable without Triton."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

# The integer GEMV's formats: (bits per code, values per group).
INT_FORMATS = {"q8_g32_fp16": (8, 32), "q4_g64_fp16": (4, 64)}
# The x split each format's integer GEMV reads: its own, and for q6_g64 (read as a q4 low plane
# plus two high bits) q4's.
SPLIT_LAYOUTS = {**INT_FORMATS, "q6_g64_fp16": (4, 64)}
# Up to this many x rows a dense product runs the integer kernel; beyond it the tensor-core
# kernel, which reads x itself (bench/decode_kernels.md).
INT_MAX_ROWS = 1
# Groups of x one program of the split kernel, or of a norm writing codes, handles.
SPLIT_BLOCK_GROUPS = 16
_ATTRIBUTE = "_ninfer_x_split"
# The live tensors that carry a split, by device and address: a tensor's memory is its own
# while it lives, so a contiguous view of all of it at that address shows the same values.
_owners: weakref.WeakValueDictionary[tuple[torch.device, int], torch.Tensor] = (
    weakref.WeakValueDictionary()
)


@dataclass(frozen=True, slots=True)
class SplitRequest:
    """What a producer of x is asked to write beside it: codes for the integer GEMV of this
    format, when x has at most `max_rows` rows (the rows that GEMV takes)."""

    bits: int
    group: int
    max_rows: int

    @classmethod
    def for_format(cls, format: str, max_rows: int = INT_MAX_ROWS) -> SplitRequest | None:
        if format not in SPLIT_LAYOUTS:
            return None
        return cls(*SPLIT_LAYOUTS[format], max_rows)

    def wanted(self, x_rows: int, width: int) -> bool:
        return 0 < x_rows <= self.max_rows and width % self.group == 0


@dataclass(frozen=True, slots=True)
class XSplit:
    """x [M, K] as codes [M, 2, K/4] int32 (coarse words, then fine words), per-group q4
    corrections [M, K/group] int32 and per-group fine steps [M, K/group] fp32."""

    bits: int
    group: int
    codes: torch.Tensor
    corr: torch.Tensor
    steps: torch.Tensor
    version: int | None  # x's version when attached; None for an inference tensor


def split_buffers(rows: int, width: int, group: int, device) -> tuple[torch.Tensor, ...]:
    """Empty (codes, corrections, steps) for `rows` x rows of `width` values."""
    groups = width // group
    return (
        torch.empty(rows, 2, width // 4, dtype=torch.int32, device=device),
        torch.empty(rows, groups, dtype=torch.int32, device=device),
        torch.empty(rows, groups, dtype=torch.float32, device=device),
    )


def attach(x: torch.Tensor, request: SplitRequest, buffers: tuple[torch.Tensor, ...]) -> None:
    """Mark `buffers`, just written from x's current values, as x's split."""
    codes, corr, steps = buffers
    split = XSplit(request.bits, request.group, codes, corr, steps, _version(x))
    setattr(x, _ATTRIBUTE, split)
    _owners[(x.device, x.data_ptr())] = x


def attached(x: torch.Tensor, bits: int, group: int, num_groups: int) -> XSplit | None:
    """x's split in this format over `num_groups` groups per row, if one was attached to x or
    to a live tensor that x views whole (a reshape of a producer's output; views made under
    inference mode do not record their base, so the owner is found by address) and x has not
    changed since; else None."""
    owner = x if hasattr(x, _ATTRIBUTE) else _owners.get((x.device, x.data_ptr()))
    if owner is None:
        return None
    if owner is not x and not (
        x.is_contiguous()
        and owner.is_contiguous()
        and x.numel() == owner.numel()
        and x.dtype == owner.dtype
    ):
        return None
    split = getattr(owner, _ATTRIBUTE)
    if (split.bits, split.group) != (bits, group):
        return None
    if split.version != _version(owner) or tuple(split.corr.shape) != (x.shape[0], num_groups):
        return None
    return split


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version


def producer_buffers(
    request: SplitRequest | None, rows: int, width: int, device, block: int | None = None
) -> tuple[torch.Tensor, ...] | None:
    """The split buffers a producer of `rows` x rows of `width` values writes when asked, or
    None when it is not (no request, more rows than the GEMV takes, a partial group, or
    programs of `block` columns that do not cover a power of two of whole groups)."""
    if request is None or not request.wanted(rows, width):
        return None
    if block is not None and not blocks_hold_groups(request, block):
        return None
    return split_buffers(rows, width, request.group, device)


def blocks_hold_groups(request: SplitRequest, block: int) -> bool:
    """Whether programs of `block` columns each cover a power of two of whole groups, as a
    producer that writes its own columns' codes needs."""
    groups = block // request.group
    return block % request.group == 0 and groups > 0 and groups & (groups - 1) == 0


def split_launch_args(
    request: SplitRequest | None,
    buffers: tuple[torch.Tensor, ...] | None,
    placeholder,
    block: int | None = None,
) -> tuple[tuple, dict]:
    """The producer kernels' split arguments: (codes, corr, steps) pointers (`placeholder`
    when none are written) and their SPLIT_BITS (0: write none) and SPLIT_GROUP constants. A
    producer whose programs write blocks of `block` columns splits each block whole
    (`split_block`); one without (`block` None: the norm, which splits a row in parts) also
    gets SPLIT_BLOCK_G, the groups of a part."""
    parts = {} if block is not None else {"SPLIT_BLOCK_G": SPLIT_BLOCK_GROUPS}
    if buffers is None:
        return (placeholder, placeholder, placeholder), {"SPLIT_BITS": 0, "SPLIT_GROUP": 64} | parts
    return buffers, {"SPLIT_BITS": request.bits, "SPLIT_GROUP": request.group} | parts

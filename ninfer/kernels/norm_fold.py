"""A decoder layer's RMSNorm folded into the products on either side of it. At a decode step
of two to eight rows on Hopper each norm was a launch of its own between two products, and a
launch in that chain costs about its own length again (docs/performance.md, Measurements 24
and 27). The norm reads the product's output y and the residual stream r and writes

    h = y + r                                  (rounded to the activation dtype)
    norm(h) = h * rsqrt(mean(h^2) + eps) * (1 + w)

Folded, the product before it (a mixer's out projection, the MLP's down) writes from its
epilogue h, the weighted rows u = h * (1 + w) and, per block of its output columns, the sum of
h^2 of each row (`NormedRows`); the products after it read u as their x and multiply output
row m by s_m = rsqrt(mean(h_m^2) + eps), which they sum up from those blocks in their own
epilogue. s_m is one factor per x row, so it comes out of a product: x_m . W = s_m (u_m . W).
Nothing but the sums of squares crosses between programs, and those are complete when the
next product starts, so no counter is needed.

h is bit for bit the unfused add. The norm's output is rounded at another place: u is rounded
to the activation dtype before the product, where the unfused norm rounds u * s; both are one
rounding of the same value scaled, so the folded products agree with the unfused ones to that
dtype's precision, not bit for bit.

The GDN output norm folds the same way into the out projection after it
(`HeadNormedRows`): its factor is one per row and value head, rsqrt(mean over the head of
o^2 + eps), and a head's columns are whole groups of the product's K, so the product takes
each group's factor with its scale. The recurrent kernel before it writes u = o * w * silu(z)
and the sums of o^2 over its block of each head's columns; the gated norm's launch goes.

This module is the reference (torch) and the carrier types; the GPU form is in
`groupwise_gemv_gluon` (the products) and `gdn_gates_triton` (the GDN gates, which read the
layer input too). Importable without Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Columns of a `NormedRows.squares` table: one per x row a folded product takes.
SQUARE_COLUMNS = 8
# Columns per block of the sums of squares where the reference folds a norm (the GPU kernels
# sum over their own blocks of output rows; a consumer takes any number of blocks).
REFERENCE_BLOCK = 64


class _FoldedRows:
    """What a folded norm's rows answer as the tensor they stand for would: the shape, device
    and dtype of their weighted rows."""

    __slots__ = ()
    weighted: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weighted.shape

    @property
    def device(self) -> torch.device:
        return self.weighted.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weighted.dtype


@dataclass(frozen=True, slots=True)
class NormedRows(_FoldedRows):
    """norm(h) for `rows` rows, held as the weighted rows u = h * (1 + w) [rows, N] and the
    sums of h^2 over blocks of h's columns, `squares` [blocks, SQUARE_COLUMNS] fp32 (row m
    in column m). Row m of the norm is u[m] * rsqrt(squares[:, m].sum() / N + eps)."""

    weighted: torch.Tensor
    squares: torch.Tensor
    eps: float

    def row_scale(self) -> torch.Tensor:
        """s_m = rsqrt(mean(h_m^2) + eps) of each row, fp32 [rows]."""
        rows, width = self.weighted.shape
        return torch.rsqrt(self.squares[:, :rows].sum(dim=0) / width + self.eps)

    def materialize(self) -> torch.Tensor:
        """The norm's output as a plain tensor, for a consumer that cannot take the factor
        out of its product."""
        return (self.weighted.float() * self.row_scale()[:, None]).to(self.weighted.dtype)


@dataclass(frozen=True, slots=True)
class HeadNormedRows(_FoldedRows):
    """The GDN output norm, silu(z) * w * o * rsqrt(mean(o^2) + eps) per row and value head of
    o [rows, heads, head_dim], held as u = o * w * silu(z), `weighted` [rows, heads *
    head_dim], and the sums of o^2 over blocks of each head's columns, `squares` [rows, heads,
    blocks] fp32."""

    weighted: torch.Tensor
    squares: torch.Tensor
    head_dim: int
    eps: float

    def head_scale(self) -> torch.Tensor:
        """rsqrt(mean(o^2) + eps) of each row and head, fp32 [rows, heads]."""
        return torch.rsqrt(self.squares.sum(dim=-1) / self.head_dim + self.eps)

    def materialize(self) -> torch.Tensor:
        rows, heads = self.squares.shape[:2]
        values = self.weighted.float().view(rows, heads, self.head_dim)
        scaled = values * self.head_scale()[:, :, None]
        return scaled.view(rows, heads * self.head_dim).to(self.weighted.dtype)


FOLDED_ROWS = (NormedRows, HeadNormedRows)


@dataclass(frozen=True, slots=True)
class NormAfter:
    """What a product is asked to fold in after itself: the residual stream its output is
    added to and the (1 + w) RMSNorm of that sum (`weight`, `eps`)."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def fold_norm(y: torch.Tensor, after: NormAfter, block: int) -> tuple[NormedRows, torch.Tensor]:
    """(norm(y + residual) as `NormedRows`, y + residual) for y [rows, N] with at most
    SQUARE_COLUMNS rows, the sums of squares over blocks of `block` columns; what a folded
    product's epilogue writes."""
    rows, width = y.shape
    if rows > SQUARE_COLUMNS:
        raise ValueError(f"a folded norm takes at most {SQUARE_COLUMNS} rows, got {rows}")
    total = (y.float() + after.residual.float()).to(y.dtype)
    h = total.float()
    weighted = (h * (1.0 + after.weight.float())).to(y.dtype)
    blocks = -(-width // block)
    padded = torch.zeros(rows, blocks * block, dtype=torch.float32, device=y.device)
    padded[:, :width] = h * h
    squares = torch.zeros(blocks, SQUARE_COLUMNS, dtype=torch.float32, device=y.device)
    squares[:, :rows] = padded.view(rows, blocks, block).sum(dim=-1).T
    return NormedRows(weighted, squares, after.eps), total


def fold_gated_norm(
    o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, block: int
) -> HeadNormedRows:
    """The GDN output norm of o [rows, heads, head_dim] with gate z (same shape) and weight
    [head_dim] as `HeadNormedRows`, the sums of squares over blocks of `block` columns of each
    head (block divides head_dim); what the folding recurrent kernel writes."""
    rows, heads, head_dim = o.shape
    if head_dim % block:
        raise ValueError(f"blocks of {block} columns do not tile a head of {head_dim}")
    values = o.float()
    gate = z.float()
    weighted = (values * weight.float() * (gate * torch.sigmoid(gate))).to(o.dtype)
    squares = values.pow(2).view(rows, heads, head_dim // block, block).sum(dim=-1)
    return HeadNormedRows(weighted.view(rows, heads * head_dim), squares, head_dim, eps)

"""`Shard`: which part of the model one rank holds, and the two collectives the model itself
issues (the all-reduce after each row-parallel block, the gather of vocab-parallel logits).

A model built with `Shard()` (one rank) is the plain single-process model: every split is the
whole range and both collectives return their input, so TP=1 issues no collective at all.

Layout per rank (world W, rank r):
- attention: query heads split evenly; a rank takes the KV heads its query heads read, so KV
  heads are split when W divides them and replicated when there are fewer KV heads than ranks;
- Gated DeltaNet: value heads split evenly, key heads follow them the same way (replicated
  when fewer than the ranks), state slots and conv windows hold only the local heads;
- MLP and shared expert: intermediate rows split (column-parallel up, row-parallel down);
- routed experts: with expert parallelism each rank holds E / W whole experts, otherwise every
  expert's intermediate rows are split like an MLP;
- embedding and head: vocabulary rows split (padded to a multiple of W with zero rows);
- norms, the router, the shared-expert gate and the MTP `fc` are replicated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ninfer.errors import ConfigError
from ninfer.quant.formats import EncodedTensor

if TYPE_CHECKING:
    from ninfer.models.qwen3_5 import Qwen3_5Config


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int = 0
    world: int = 1
    expert_parallel: bool = False
    group: Any = None  # torch.distributed ProcessGroup of the model's collectives

    # ---- collectives -------------------------------------------------------------------

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel block's partial outputs over the ranks (in place)."""
        if self.world > 1:
            torch.distributed.all_reduce(partial, group=self.group)
        return partial

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[N, V / W] logits of the local vocabulary rows -> [N, V] on rank 0, None elsewhere.
        An all-gather rather than a gather to rank 0: one collective kernel that a CUDA graph
        captures like the all-reduces (a gather is W point-to-point transfers)."""
        if self.world == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        torch.distributed.all_gather(parts, local, group=self.group)
        if self.rank != 0:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ---- ranges ------------------------------------------------------------------------

    def split(self, total: int, what: str) -> range:
        """This rank's even share of `total` items."""
        if total % self.world:
            raise ConfigError(f"{what} ({total}) is not divisible by tensor-parallel {self.world}")
        per = total // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def grouped_heads(self, num_heads: int, num_groups: int, what: str) -> tuple[range, range]:
        """(heads, groups) of this rank, where head h reads group h // (num_heads / num_groups)
        (query heads over KV heads, GDN value heads over key heads). The groups are split when
        the ranks divide them and replicated when there are fewer groups than ranks."""
        heads = self.split(num_heads, what)
        per_group = num_heads // num_groups
        local = len(heads)
        if local % per_group and per_group % local:
            raise ConfigError(
                f"{what}: {local} heads per rank cannot share {num_groups} groups evenly"
            )
        groups = range(heads.start // per_group, (heads.stop - 1) // per_group + 1)
        return heads, groups

    def vocab_rows(self, vocab_size: int) -> range:
        per = -(-vocab_size // self.world)
        return range(self.rank * per, (self.rank + 1) * per)

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds whole (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return range(num_experts)
        return self.split(num_experts, "num_experts")

    # ---- model shapes and weights ------------------------------------------------------

    def local_config(self, c: Qwen3_5Config) -> Qwen3_5Config:
        """The config with this rank's head counts and widths (vocab and experts stay global:
        the embedding and the router see every row)."""
        if self.world == 1:
            return c
        heads, kv = self.grouped_heads(c.num_heads, c.num_kv_heads, "num_attention_heads")
        values, keys = self.grouped_heads(
            c.linear_num_value_heads, c.linear_num_key_heads, "linear_num_value_heads"
        )
        moe_width = c.moe_intermediate_size
        if c.is_moe and not self.expert_parallel:
            moe_width = len(self.split(moe_width, "moe_intermediate_size"))
        return replace(
            c,
            num_heads=len(heads),
            num_kv_heads=len(kv),
            linear_num_value_heads=len(values),
            linear_num_key_heads=len(keys),
            intermediate_size=len(self.split(c.intermediate_size, "intermediate_size")),
            moe_intermediate_size=moe_width,
            shared_expert_intermediate_size=len(
                self.split(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")
            ),
        )

    def slice_parameter(self, name: str, full: torch.Tensor, c: Qwen3_5Config) -> torch.Tensor:
        """This rank's part of the parameter `name` (module naming, e.g.
        `layers.3.self_attn.q_proj.weight`) given the whole tensor."""
        if self.world == 1:
            return full
        match = _SHARDED.search(name)
        if match is None:
            return full
        kind = match.lastgroup
        if kind == "experts_gate_up":  # [E, 2I, H], gate rows then up rows
            if self.expert_parallel:
                return full[_span(self.experts(full.shape[0]))]
            gate, up = full.chunk(2, dim=1)
            rows = _span(self.split(gate.shape[1], name))
            return torch.cat([gate[:, rows], up[:, rows]], dim=1)
        if kind == "experts_down":  # [E, H, I]
            if self.expert_parallel:
                return full[_span(self.experts(full.shape[0]))]
            return full[:, :, _span(self.split(full.shape[2], name))]
        return self._selection(kind, name, tuple(full.shape), c).dense(full)

    def slice_encoded(
        self, name: str, encoded: EncodedTensor, c: Qwen3_5Config
    ) -> EncodedTensor | None:
        """This rank's part of the 2-D weight `name` kept encoded in a group-wise int format:
        the same rows and columns `slice_parameter` takes, cut from each plane. None where the
        columns do not fall on whole groups (or the weight is not one sliced by rows and
        columns): the caller then slices it dense."""
        if self.world == 1:
            return encoded
        match = _SHARDED.search(name)
        if match is None or len(encoded.shape) != 2:
            return None if match is not None else encoded
        kind = match.lastgroup
        if kind in ("experts_gate_up", "experts_down"):
            return None
        selection = self._selection(kind, name, tuple(encoded.shape), c)
        return selection.encoded(encoded)

    def _selection(
        self, kind: str, name: str, shape: tuple[int, ...], c: Qwen3_5Config
    ) -> _Selection:
        """The rows (first dimension) and columns (last) of a parameter of `shape` this rank
        keeps."""
        d, dv = c.head_dim, c.linear_value_head_dim
        if kind == "vocab":
            rows = self.vocab_rows(c.vocab_size)
            stop = max(rows.start, min(rows.stop, c.vocab_size))  # a block past the end: empty
            return _Selection(
                rows=slice(rows.start, stop), pad_rows=len(rows) - (stop - rows.start)
            )
        if kind in ("q_proj", "o_proj"):
            heads, _ = self.grouped_heads(c.num_heads, c.num_kv_heads, "num_attention_heads")
            if kind == "q_proj":  # per head [query | gate]
                return _Selection(rows=slice(heads.start * 2 * d, heads.stop * 2 * d))
            return _Selection(cols=slice(heads.start * d, heads.stop * d))
        if kind == "kv_proj":
            _, kv = self.grouped_heads(c.num_heads, c.num_kv_heads, "num_attention_heads")
            return _Selection(rows=slice(kv.start * d, kv.stop * d))
        values, keys = self.grouped_heads(
            c.linear_num_value_heads, c.linear_num_key_heads, "linear_num_value_heads"
        )
        if kind == "gdn_channels":  # [q | k | v], head-major in each part
            dk, key_dim = c.linear_key_head_dim, c.linear_num_key_heads * c.linear_key_head_dim
            index = torch.cat(
                [
                    torch.arange(keys.start * dk, keys.stop * dk),
                    key_dim + torch.arange(keys.start * dk, keys.stop * dk),
                    2 * key_dim + torch.arange(values.start * dv, values.stop * dv),
                ]
            )
            return _Selection(rows=index)
        if kind == "gdn_value_rows":
            return _Selection(rows=slice(values.start * dv, values.stop * dv))
        if kind == "gdn_heads":
            return _Selection(rows=slice(values.start, values.stop))
        if kind == "gdn_out":
            return _Selection(cols=slice(values.start * dv, values.stop * dv))
        if kind == "mlp_in":
            return _Selection(rows=_span(self.split(shape[0], name)))
        if kind == "mlp_out":
            return _Selection(cols=_span(self.split(shape[-1], name)))
        raise AssertionError(kind)


@dataclass(frozen=True, slots=True)
class _Selection:
    """Rows of the first dimension (a range, or an index) and columns of the last that a rank
    keeps, and zero rows appended (the vocabulary's padding)."""

    rows: slice | torch.Tensor | None = None
    cols: slice | None = None
    pad_rows: int = 0

    def _take_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return tensor
        if isinstance(self.rows, slice):
            return tensor[self.rows]
        return tensor.index_select(0, self.rows.to(tensor.device))

    def _pad(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.pad_rows:
            return tensor
        return torch.cat([tensor, tensor.new_zeros(self.pad_rows, *tensor.shape[1:])])

    def dense(self, full: torch.Tensor) -> torch.Tensor:
        part = self._take_rows(full)
        if self.cols is not None:
            part = part[..., self.cols]
        return self._pad(part)

    def encoded(self, encoded: EncodedTensor) -> EncodedTensor | None:
        """The same part of a [N, K] weight stored as row-major group-wise planes (each row's
        values packed along K, a scale per group): rows are rows of every plane; columns must
        start and end on whole groups, and are the matching columns of each plane. Zero rows
        decode to zeros (codes 0, scale 0)."""
        from ninfer.quant import get_format

        group = getattr(get_format(encoded.format), "group", None)
        _, k = encoded.shape
        cols = self.cols
        if group is None or (
            cols is not None and (k % group or cols.start % group or cols.stop % group)
        ):
            return None
        planes = {}
        for key, plane in encoded.planes.items():
            part = self._take_rows(plane)
            if cols is not None:
                per_column = k // plane.shape[1]  # values one column of this plane holds
                part = part[:, cols.start // per_column : cols.stop // per_column]
            # a copy: a view would keep the whole stored plane alive (the bench encodes its
            # random weights on the device, where `.to(device)` then copies nothing)
            planes[key] = self._pad(part).clone(memory_format=torch.contiguous_format)
        rows = len(next(iter(planes.values())))
        width = k if cols is None else cols.stop - cols.start
        return EncodedTensor(encoded.format, encoded.layout, (rows, width), planes)


def _span(r: range) -> slice:
    return slice(r.start, r.stop)


_SHARDED = re.compile(
    r"(?:^|\.)(?:"
    r"(?P<vocab>embed_tokens\.weight|lm_head\.weight)"
    r"|(?P<q_proj>self_attn\.q_proj\.weight)"
    r"|(?P<kv_proj>self_attn\.[kv]_proj\.weight)"
    r"|(?P<o_proj>self_attn\.o_proj\.weight)"
    r"|(?P<gdn_channels>linear_attn\.(?:in_proj_qkv|conv1d)\.weight)"
    r"|(?P<gdn_value_rows>linear_attn\.in_proj_z\.weight)"
    r"|(?P<gdn_heads>linear_attn\.(?:in_proj_[ab]\.weight|dt_bias|A_log))"
    r"|(?P<gdn_out>linear_attn\.out_proj\.weight)"
    r"|(?P<mlp_in>(?:mlp|shared_expert)\.(?:gate|up)_proj\.weight)"
    r"|(?P<mlp_out>(?:mlp|shared_expert)\.down_proj\.weight)"
    r"|(?P<experts_gate_up>experts\.gate_up_proj)"
    r"|(?P<experts_down>experts\.down_proj)"
    r")$"
)

"""Gated full attention: q_proj packs per head [query | gate]; q/k RMSNorm before partial
M-RoPE, then K/V into the pages (one call, `attention_prelude`); GQA over paged K/V; output
multiplied by sigmoid(gate) before o_proj. After loading, `fuse_projections` runs q_proj, k_proj
and v_proj as one linear (the names load the weights)."""

import torch
from torch import nn

from ninfer.kernels.dispatch import (
    attention_prelude,
    paged_attention_decode_gated,
    paged_attention_prefill,
    sigmoid_gate,
)
from ninfer.kernels.norm_fold import NormAfter, NormedRows
from ninfer.kernels.x_split import SplitRequest
from ninfer.models.context import ForwardContext
from ninfer.models.layers.linear import FusedLinear, fuse_into, linear_then_norm
from ninfer.models.layers.norms import RMSNorm


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        cache_index: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cache_index = cache_index  # which attention layer of ModelCache holds our K/V
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.qkv_proj: FusedLinear | None = None
        # the integer-GEMV codes o_proj wants beside its input (`request_x_splits`)
        self.o_split: SplitRequest | None = None

    def fuse_projections(self) -> list[str]:
        """Stack q_proj, k_proj and v_proj where their weights allow (`fuse_into`); returns
        the fused modules' names."""
        return ["qkv_proj"] if fuse_into(self, "qkv_proj", ("q_proj", "k_proj", "v_proj")) else []

    def forward(
        self,
        x: torch.Tensor | NormedRows,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        after: NormAfter | None = None,
    ) -> torch.Tensor | tuple[NormedRows, torch.Tensor]:
        """x may be a folded norm's rows; with `after` the norm after the layer is folded into
        o_proj (`linear.linear_then_norm`)."""
        tokens = x.shape[0]
        if self.qkv_proj is None:
            query_gate, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            query_gate, key, value = self.qkv_proj(x)
        query_gate = query_gate.view(tokens, self.num_heads, 2 * self.head_dim)
        query, gate = query_gate.chunk(2, -1)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        k_cache = ctx.cache.k[self.cache_index]
        v_cache = ctx.cache.v[self.cache_index]
        # attention reads K only from the pages, decode and prefill alike: the normed, rotated
        # key is written there and nowhere else
        query = attention_prelude(
            query,
            key,
            value,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,  # both norms are built with the one eps
            cos,
            sin,
            k_cache,
            v_cache,
            ctx.kv_write_slots,
        )
        scale = self.head_dim**-0.5
        if ctx.is_decode:
            # the output gate (and o_proj's codes) in the attention's own merge step
            gated = paged_attention_decode_gated(
                query,
                k_cache,
                v_cache,
                ctx.page_table,
                ctx.seq_lens,
                scale,
                gate,
                self.o_split,
                ctx.max_seq_len,
            )
            return linear_then_norm(self.o_proj, gated, after)
        out = paged_attention_prefill(
            query,
            k_cache,
            v_cache,
            ctx.page_table,
            ctx.query_start,
            ctx.context_lens,
            ctx.seq_lens,
            scale,
        )
        return linear_then_norm(self.o_proj, sigmoid_gate(out, gate, self.o_split), after)

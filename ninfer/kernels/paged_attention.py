"""Causal GQA attention over K/V stored in 64-token pages (torch reference).

Prefill: each sequence's new queries attend to its cached prefix plus the new chunk (whose K/V
were already written to the pages). Decode: one query per sequence over its whole sequence.
Attention itself is torch's scaled_dot_product_attention on the gathered K/V, so in bf16 it
rounds like the transformers reference (sdpa) does.
"""

import torch
import torch.nn.functional as F

from ninfer.engine.kv_pool import PAGE_SIZE


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence as [length, n_kv_heads, head_dim]."""
    num_pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
    tokens = cache[pages[:num_pages].long()].reshape(-1, *cache.shape[2:])
    return tokens[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float):
    """q [m, nh, d] at absolute positions first_pos.., k/v [n, nkv, d] at positions 0..n-1."""
    # [1, heads, tokens, d]: with a batch dim sdpa takes the same CPU kernel as transformers
    q, k, v = (x.to(q.dtype).transpose(0, 1)[None] for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if q.shape[2] == 1:  # a single query sees every key
        out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
    elif first_pos == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        query_pos = first_pos + torch.arange(q.shape[2], device=q.device)
        visible = torch.arange(k.shape[2], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa
        )
    return out[0].transpose(0, 1)


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [T, nh, d] (flat varlen); returns [T, nh, d] in q's dtype."""
    out = torch.empty_like(q)
    starts = query_start.tolist()
    for i, (context_len, seq_len) in enumerate(zip(context_lens.tolist(), seq_lens.tolist())):
        begin, end = starts[i], starts[i + 1]
        k = _gather(k_cache, page_table[i], seq_len)
        v = _gather(v_cache, page_table[i], seq_len)
        out[begin:end] = _attend(q[begin:end], k, v, context_len, scale)
    return out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [B, nh, d], one query per sequence at position seq_len - 1; returns [B, nh, d]."""
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k = _gather(k_cache, page_table[i], seq_len)
        v = _gather(v_cache, page_table[i], seq_len)
        out[i : i + 1] = _attend(q[i : i + 1], k, v, seq_len - 1, scale)
    return out

"""Causal GQA attention over K/V stored in 64-token pages (torch reference).

Prefill: each sequence's new queries attend to its cached prefix plus the new chunk (whose K/V
were already written to the pages). Decode: one query per sequence over its whole sequence.
Scores, softmax and the weighted sum run in fp32; the output is cast to the query dtype.
"""

import torch

from ninfer.engine.kv_pool import PAGE_SIZE


def _gather(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence as [length, n_kv_heads, head_dim], fp32."""
    num_pages = (length + PAGE_SIZE - 1) // PAGE_SIZE
    tokens = cache[pages[:num_pages].long()].reshape(-1, *cache.shape[2:])
    return tokens[:length].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float):
    """q [m, nh, d] at absolute positions first_pos.., k/v [n, nkv, d] at positions 0..n-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    query_pos = first_pos + torch.arange(q.shape[0], device=q.device)
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores.masked_fill_(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, v)


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
        out[begin:end] = _attend(q[begin:end], k, v, context_len, scale).to(q.dtype)
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
        out[i : i + 1] = _attend(q[i : i + 1], k, v, seq_len - 1, scale).to(q.dtype)
    return out

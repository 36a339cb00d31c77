"""KV write: scatter the new tokens' K/V into their 64-token pages (torch reference)."""

import torch


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_write_slots: torch.Tensor,
) -> None:
    """k, v: [T, n_kv_heads, head_dim]; caches: [num_pages, 64, n_kv_heads, head_dim];
    kv_write_slots: int64 [T], `page_id * 64 + offset`."""
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, kv_write_slots, k.to(k_cache.dtype))
    flat_v.index_copy_(0, kv_write_slots, v.to(v_cache.dtype))

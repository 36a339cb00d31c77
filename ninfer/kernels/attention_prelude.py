"""The attention layer's prelude between the q/k/v projection and attention (torch reference):
q_norm and k_norm (`rms_norm`), partial rotary on both (`rotary`), K and V into their pages
(`kv_write`), composed from those references with their roundings. The Triton form, one launch
instead of five, is in `attention_prelude_triton.py`.
"""

from __future__ import annotations

import torch

from ninfer.kernels.kv_write import write_kv
from ninfer.kernels.rms_norm import rms_norm
from ninfer.kernels.rotary import apply_rotary


def attention_prelude(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_write_slots: torch.Tensor,
) -> torch.Tensor:
    """query [T, H, D], key and value [T, Hkv, D] (views of the projections' output allowed);
    cos, sin [T, rot]; caches [num_pages, 64, Hkv, D]; kv_write_slots int64 [T]. Writes the
    normed, rotated key and the value into the caches and returns the normed, rotated query,
    a new [T, H, D] tensor. The key itself is not returned: attention reads it from the pages."""
    query = apply_rotary(rms_norm(query, q_weight, eps), cos, sin)
    key = apply_rotary(rms_norm(key, k_weight, eps), cos, sin)
    write_kv(key, value, k_cache, v_cache, kv_write_slots)
    return query

"""Gated DeltaNet prefill through fla-core's `chunk_gated_delta_rule` (Triton, chunks of 64).

fla takes a flat varlen batch as batch 1 plus `cu_seqlens` (our `query_start`), one initial
state per sequence and returns one final state per sequence; our states live in slots, so the
states of the batch's slots are gathered before the call and the final states written back.
q/k L2 normalisation (eps 1e-6 under the sqrt, as in our reference) and the dk^-0.5 scale are
fla's (`use_qk_l2norm_in_kernel`, default scale); value head j reads key head j // (Hv/Hk) in
both. Only fla's forward runs: its backward refuses Triton < 3.7.1 on Hopper (a miscompile in
the gated dq/dk kernel), which inference never calls.

fla autotunes each kernel once per head shape and dtype (keys never include T); `warm_up` pays
that at startup, and `kernel_cache.persist_triton_cache` keeps the results on disk.
Reference: `gdn_chunked.chunk_gated_delta_rule` (same signature).
"""

from __future__ import annotations

import importlib.util

import torch

from ninfer.kernels.kernel_cache import persist_triton_cache

HAS_FLA = importlib.util.find_spec("fla") is not None


def _fla_rule():
    persist_triton_cache()
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay), beta: [T, Hv]; states: fp32 or bf16
    [num_slots, Hv, dk, dv], the batch's slots read (as fp32) and updated in place.
    Returns o: [T, Hv, dv] in v's dtype."""
    slots = state_slots.long()
    out, final = _fla_rule()(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None].to(v.dtype),
        initial_state=states.index_select(0, slots).float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=query_start.long(),
    )
    states.index_copy_(0, slots, final.to(states.dtype))
    return out[0].to(v.dtype)


def warm_up(
    num_key_heads: int,
    num_value_heads: int,
    key_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Compile and autotune fla's kernels for one head shape (a throwaway two-sequence batch),
    so the first real prefill does not pay for it."""
    lens = [70, 3]
    tokens = sum(lens)
    q = torch.randn(tokens, num_key_heads, key_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, num_key_heads, key_dim, device=device, dtype=dtype)
    v = torch.randn(tokens, num_value_heads, value_dim, device=device, dtype=dtype)
    g = -torch.rand(tokens, num_value_heads, device=device)
    beta = torch.rand(tokens, num_value_heads, device=device, dtype=dtype)
    states = torch.zeros(len(lens), num_value_heads, key_dim, value_dim, device=device)
    slots = torch.arange(len(lens), dtype=torch.int32, device=device)
    query_start = torch.tensor([0, lens[0], tokens], dtype=torch.int32, device=device)
    chunk_gated_delta_rule(q, k, v, g, beta, states, slots, query_start)

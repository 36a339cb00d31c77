"""Gated delta rule in chunks of 64 tokens (torch reference; the prefill form).

Same maths as `gdn_recurrent.py`, rearranged per chunk. With G_t the cumulative log decay inside
the chunk, S0 the state entering it and w_s = beta_s * u_s, the recurrence unrolls to
    w_t = beta_t (v_t - exp(G_t) S0^T k_t) - sum_{s<t} beta_t exp(G_t - G_s) (k_t . k_s) w_s
a unit lower-triangular system solved at once, then
    o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t . k_s) w_s
    S_end = exp(G_last) S0 + sum_s exp(G_last - G_s) k_s w_s^T
All in fp32.
"""

import torch

from ninfer.kernels.gdn_recurrent import prepare_qk

CHUNK_SIZE = 64


def _chunk(q, k, v, g, beta, state):
    """One chunk, heads first: q, k [H, C, dk]; v [H, C, dv]; g, beta [H, C]; state [H, dk, dv]."""
    size = q.shape[1]
    cum = g.cumsum(dim=1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).tril(-1)
    system = strictly_lower + torch.eye(size, device=q.device)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ state))
    w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = cum.exp()[:, :, None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ w
    to_end = (cum[:, -1:] - cum).exp()[:, :, None]
    state = cum[:, -1].exp()[:, None, None] * state + (k * to_end).transpose(1, 2) @ w
    return out, state


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
    """Same signature and result as `recurrent_gated_delta_rule`."""
    out_dtype = v.dtype
    q, k = prepare_qk(q, k, v.shape[1])
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        state = states[slot].float()
        for begin in range(starts[i], starts[i + 1], CHUNK_SIZE):
            end = min(begin + CHUNK_SIZE, starts[i + 1])
            heads_first = [x[begin:end].transpose(0, 1) for x in (q, k, v, g, beta)]
            chunk_out, state = _chunk(*heads_first, state)
            out[begin:end] = chunk_out.transpose(0, 1)
        states[slot] = state
    return out.to(out_dtype)

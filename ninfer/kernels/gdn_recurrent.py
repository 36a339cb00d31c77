"""Gated delta rule, token by token (torch reference; the decode form and the ground truth for
the chunked form).

Per value head, with a state S [dk, dv] carried in a state slot (fp32, or bf16: read as fp32,
updated in fp32 over the call's tokens and rounded once when written back):
    S <- exp(g_t) * S;  u = v_t - S^T k_t;  S <- S + k_t (beta_t u)^T;  o_t = S^T q_t
q and k are L2-normalised inside (eps 1e-6 under the sqrt) and q is scaled by dk^-0.5.
Key heads are shared by blocks of Hv / Hk value heads (value head j reads key head j // r).
`recurrent_gated_delta_rule_from_x` takes g and beta from the layer input and the b|a weight
(`gdn_gates.gdn_gates_from_x`), the form whose Triton kernel computes the gates itself.
"""

import torch

from ninfer.kernels import gdn_gates


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_value_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32, normalised, scaled q and k expanded to the value heads: [T, Hv, dk] each."""
    ratio = num_value_heads // q.shape[1]
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    return q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay, fp32), beta: [T, Hv];
    states: fp32 or bf16 [num_slots, Hv, dk, dv], read and updated in place.
    Returns o: [T, Hv, dv] in v's dtype."""
    out_dtype = v.dtype
    q, k = prepare_qk(q, k, v.shape[1])
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    starts = query_start.tolist()
    for i, slot in enumerate(state_slots.tolist()):
        state = states[slot].float()
        for t in range(starts[i], starts[i + 1]):
            state = state * g[t].exp()[:, None, None]
            predicted = torch.einsum("hk,hkv->hv", k[t], state)
            delta = (v[t] - predicted) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], state)
        states[slot] = state
    return out.to(out_dtype)


def recurrent_gated_delta_rule_from_x(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    x: torch.Tensor,
    ba_weight: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    state_slots: torch.Tensor,
    query_start: torch.Tensor,
) -> torch.Tensor:
    """`recurrent_gated_delta_rule` with (g, beta) = `gdn_gates.gdn_gates_from_x(x, ba_weight,
    A_log, dt_bias)`: x [T, hidden], ba_weight [2Hv, hidden] (b rows over a rows)."""
    g, beta = gdn_gates.gdn_gates_from_x(x, ba_weight, A_log, dt_bias)
    return recurrent_gated_delta_rule(q, k, v, g, beta, states, state_slots, query_start)

"""The chunked gated delta rule (prefill) equals the token-by-token recurrence (decode), for
many sequences in shuffled state slots, across chunk boundaries, and when a sequence is fed in
pieces that carry the state. Error = max |a - b| / max |b|."""

import pytest
import torch

from ninfer.kernels.gdn_chunked import chunk_gated_delta_rule
from ninfer.kernels.gdn_recurrent import recurrent_gated_delta_rule


def random_inputs(query_lens, num_key_heads, num_value_heads, dk, dv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(tokens, num_key_heads, dk).to(dtype)
    k = randn(tokens, num_key_heads, dk).to(dtype)
    v = randn(tokens, num_value_heads, dv).to(dtype)
    g = -torch.rand(tokens, num_value_heads, generator=gen) * 1.5  # log decay, fp32, <= 0
    beta = torch.rand(tokens, num_value_heads, generator=gen).to(dtype)
    num_slots = len(query_lens) + 2
    states = randn(num_slots, num_value_heads, dk, dv) * 0.5
    slots = torch.randperm(num_slots, generator=gen)[: len(query_lens)].to(torch.int32)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, states, slots, starts


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("heads", [(1, 1), (2, 4), (1, 3)], ids=["mha", "gva2", "gva3"])
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
def test_chunked_equals_recurrent(heads, dtype, tol):
    query_lens = [1, 63, 64, 65, 150]
    q, k, v, g, beta, states, slots, starts = random_inputs(query_lens, *heads, 16, 12, dtype)
    chunk_states, recurrent_states = states.clone(), states.clone()
    out_chunked = chunk_gated_delta_rule(q, k, v, g, beta, chunk_states, slots, starts)
    out_recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_states, slots, starts)
    assert out_chunked.dtype == dtype and out_chunked.shape == v.shape
    assert rel(out_chunked, out_recurrent) <= tol
    assert rel(chunk_states, recurrent_states) <= 1e-5  # states are fp32 in both
    unused = [s for s in range(states.shape[0]) if s not in slots.tolist()]
    assert torch.equal(chunk_states[unused], states[unused])


def test_chunked_in_pieces_equals_one_pass():
    q, k, v, g, beta, states, slots, starts = random_inputs([130], 2, 4, 16, 12, torch.float32)
    whole_states, piece_states = states.clone(), states.clone()
    whole = chunk_gated_delta_rule(q, k, v, g, beta, whole_states, slots, starts)
    pieces = []
    for begin, end in [(0, 5), (5, 70), (70, 71), (71, 130)]:
        piece = [x[begin:end] for x in (q, k, v, g, beta)]
        span = torch.tensor([0, end - begin], dtype=torch.int32)
        pieces.append(chunk_gated_delta_rule(*piece, piece_states, slots, span))
    assert rel(torch.cat(pieces), whole) <= 1e-5
    assert rel(piece_states, whole_states) <= 1e-5


def test_recurrent_matches_the_delta_rule_written_out():
    q, k, v, g, beta, states, slots, starts = random_inputs([9], 1, 2, 8, 4, torch.float32)
    initial = states[slots[0]].clone()
    out = recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, starts)
    qn = q / q.norm(dim=-1, keepdim=True) * 8**-0.5
    kn = k / k.norm(dim=-1, keepdim=True)
    for h in range(2):
        S = initial[h]
        for t in range(9):
            # S_t = e^{g_t} (I - beta k k^T) S_{t-1} + beta k v^T ; o_t = S_t^T q_t
            kt, qt = kn[t, 0], qn[t, 0]
            S = torch.exp(g[t, h]) * (torch.eye(8) - beta[t, h] * torch.outer(kt, kt)) @ S
            S = S + beta[t, h] * torch.outer(kt, v[t, h])
            assert torch.allclose(out[t, h], S.T @ qt, atol=1e-5)
        assert torch.allclose(states[slots[0], h], S, atol=1e-5)

"""The fla-core wrapper for Gated DeltaNet prefill, on CPU: fla's chunk kernels need a GPU (the
interpreter cannot run them), so fla's own pure-torch recurrent reference stands in for
`chunk_gated_delta_rule` behind the same call (batch 1 + cu_seqlens, one initial and one final
state per sequence, in-kernel q/k L2 norm, value head j on key head j // ratio). That checks the
wrapper's layout and its gathering and scattering of state slots against our reference; the
real kernels are checked on the GPU (tests/gpu/test_triton_prefill_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import check_gdn_chunked

from ninfer.kernels import gdn_chunked_fla

fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")


def fla_call_on_cpu(
    q, k, v, g, beta, *, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens
):
    assert q.shape[0] == 1 and output_final_state and use_qk_l2norm_in_kernel
    ratio = v.shape[2] // q.shape[2]
    q, k = (
        (x.float() * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(
            ratio, dim=2
        )
        for x in (q, k)
    )
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        rows = slice(bounds[n], bounds[n + 1])
        out, final = fla_naive.naive_recurrent_gated_delta_rule(
            q[:, rows],
            k[:, rows],
            v[:, rows],
            beta[:, rows],
            g[:, rows],
            initial_state=initial_state[n : n + 1],
            output_final_state=True,
        )
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals)


@pytest.mark.parametrize(
    ("query_lens", "num_key_heads", "num_value_heads"),
    [([5, 70, 1], 2, 4), ([130], 1, 1), ([3, 3, 64, 2], 2, 6)],
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_wrapper_feeds_fla_our_slots_and_writes_final_states_back(
    monkeypatch, query_lens, num_key_heads, num_value_heads, state_dtype
):
    torch.manual_seed(sum(query_lens))
    monkeypatch.setattr(gdn_chunked_fla, "_fla_rule", lambda: fla_call_on_cpu)
    check_gdn_chunked(
        gdn_chunked_fla,
        query_lens,
        num_key_heads,
        num_value_heads,
        16,
        8,
        torch.float32,
        "cpu",
        1e-5 if state_dtype == torch.float32 else 1e-2,
        state_dtype,
    )

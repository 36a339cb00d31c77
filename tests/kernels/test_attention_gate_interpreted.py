"""Paged decode attention with the output gate in its merge kernel
(`paged_attention_triton.paged_attention_decode_gated`), under Triton's CPU interpreter: bit for
bit the attention followed by the output-gate kernel, over sequences of one to several pages
and GQA, with max_seq_len given or read from the device. fp16 here (tests/triton_interpreter.py
says why)."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.x_split import SplitRequest, attached

require_interpreter()


def attention_case(seq_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float16):
    pages_each = [(n + PAGE_SIZE - 1) // PAGE_SIZE for n in seq_lens]
    num_pages = sum(pages_each) + 2
    k_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_pages, PAGE_SIZE, num_kv_heads, head_dim).to(dtype)
    order = torch.randperm(num_pages).tolist()
    page_table = torch.full((len(seq_lens), max(pages_each)), -1, dtype=torch.int32)
    for i, count in enumerate(pages_each):
        page_table[i, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    query_gate = torch.randn(len(seq_lens), num_heads, 2 * head_dim).to(dtype)
    q, gate = query_gate.chunk(2, dim=-1)  # the gate strided, as inside q_proj's output
    return q.contiguous(), k_cache, v_cache, page_table, lens, head_dim**-0.5, gate


@pytest.mark.parametrize("early", [False, True], ids=["after-wait", "before-wait"])
@pytest.mark.parametrize("max_seq_len", [None, "given"])
def test_the_gate_in_the_merge_is_the_two_kernels_bit_for_bit(max_seq_len, early, monkeypatch):
    """With READS_BEFORE_WAIT the split kernel's first page and the merge's gate are read
    before the wait: the same bits."""
    torch.manual_seed(0)
    attention = load_kernel_module("paged_attention_triton")
    monkeypatch.setattr(attention, "READS_BEFORE_WAIT", early)
    output_gate = load_kernel_module("output_gate_triton")
    seq_lens = [1, 70, 200]
    q, k_cache, v_cache, page_table, lens, scale, gate = attention_case(seq_lens, 8, 2, 64)
    limit = max(seq_lens) if max_seq_len else None
    args = (q, k_cache, v_cache, page_table, lens, scale)
    fused = attention.paged_attention_decode_gated(*args, gate, None, limit)
    attn = attention.paged_attention_decode(*args, limit)
    separate = output_gate.sigmoid_gate(attn, gate)
    assert fused.shape == (3, 8 * 64) and fused.dtype == q.dtype
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("fmt", ["q4_g64_fp16", "q8_g32_fp16"])
def test_one_sequence_carries_o_proj_codes_as_the_gate_kernel_writes_them(fmt):
    torch.manual_seed(1)
    attention = load_kernel_module("paged_attention_triton")
    output_gate = load_kernel_module("output_gate_triton")
    request = SplitRequest.for_format(fmt)
    case = attention_case([150], 4, 2, 128)
    args, gate = case[:6], case[6]
    fused = attention.paged_attention_decode_gated(*args, gate, request)
    separate = output_gate.sigmoid_gate(attention.paged_attention_decode(*args), gate, request)
    assert torch.equal(fused, separate)
    width = fused.shape[1]
    mine = attached(fused, request.bits, request.group, width // request.group)
    theirs = attached(separate, request.bits, request.group, width // request.group)
    assert mine is not None and theirs is not None
    assert torch.equal(mine.codes, theirs.codes) and torch.equal(mine.steps, theirs.steps)
    if request.bits == 4:  # q8 has no correction term
        assert torch.equal(mine.corr, theirs.corr)


def test_a_gate_of_another_shape_is_refused():
    attention = load_kernel_module("paged_attention_triton")
    q, k_cache, v_cache, page_table, lens, scale, gate = attention_case([5], 4, 2, 64)
    with pytest.raises(ValueError, match="gate"):
        attention.paged_attention_decode_gated(
            q, k_cache, v_cache, page_table, lens, scale, gate[:, :2]
        )

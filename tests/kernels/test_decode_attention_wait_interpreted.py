"""What paged decode attention reads before its PDL wait (`paged_attention_triton.
READS_BEFORE_WAIT`), under Triton's CPU interpreter. In a decode step the attention prelude, the
kernel just before the split kernel, writes the newest token's K/V (at seq_len - 1) into its
page. So the split kernel may read pages wholly before that token before its wait, never the
newest token's page. Here the wait is a hook that writes the newest token's K/V when the
program that holds its page waits, so that a page read before the wait sees the stale values
the cache held. fp16 here (tests/triton_interpreter.py says why)."""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import load_kernel_module, require_interpreter

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.paged_attention import paged_attention_decode as reference

require_interpreter()

HEADS, HEAD_DIM = 4, 32


def cache_for(seq_len: int):
    """One sequence on scattered pages (one KV head): q, caches, page table, lengths."""
    pages = math.ceil(seq_len / PAGE_SIZE)
    k_cache = torch.randn(pages + 2, PAGE_SIZE, 1, HEAD_DIM).half()
    v_cache = torch.randn(pages + 2, PAGE_SIZE, 1, HEAD_DIM).half()
    page_table = torch.tensor([torch.randperm(pages + 2)[:pages].tolist()], dtype=torch.int32)
    q = torch.randn(1, HEADS, HEAD_DIM).half()
    return q, k_cache, v_cache, page_table, torch.tensor([seq_len], dtype=torch.int32)


@pytest.mark.parametrize("early", [False, True], ids=["after-wait", "before-wait"])
@pytest.mark.parametrize(
    ("seq_len", "pages_per_split"),
    [(1, 1), (40, 1), (64, 1), (65, 1), (130, 1), (192, 1), (193, 2), (300, 2), (300, 3)],
)
def test_the_newest_tokens_page_is_read_after_the_wait(
    early, seq_len, pages_per_split, monkeypatch
):
    torch.manual_seed(seq_len + pages_per_split)
    attention = load_kernel_module("paged_attention_triton")
    monkeypatch.setattr(attention, "READS_BEFORE_WAIT", early)
    pages = math.ceil(seq_len / PAGE_SIZE)
    splits = math.ceil(pages / pages_per_split)
    monkeypatch.setattr(attention, "choose_splits", lambda *_: (pages_per_split, splits))
    q, k_cache, v_cache, page_table, lens = cache_for(seq_len)
    scale = HEAD_DIM**-0.5
    expected = reference(q, k_cache, v_cache, page_table, lens, scale)
    newest = (page_table[0, (seq_len - 1) // PAGE_SIZE].item(), (seq_len - 1) % PAGE_SIZE)
    fresh_k, fresh_v = k_cache[newest].clone(), v_cache[newest].clone()
    k_cache[newest], v_cache[newest] = fresh_k + 3.0, -fresh_v  # what a step ago left there
    waits = []

    def wait(pdl):
        # the interpreter runs the split programs in order, the newest token's page in the last
        waits.append(pdl)
        if len(waits) == splits:
            k_cache[newest], v_cache[newest] = fresh_k, fresh_v

    monkeypatch.setattr(attention, "await_inputs", wait)
    out = attention.paged_attention_decode(q, k_cache, v_cache, page_table, lens, scale, seq_len)
    assert len(waits) == splits + HEADS  # the split's programs, then the merge's
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)

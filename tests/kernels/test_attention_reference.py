"""Paged attention over scattered 64-token pages equals dense causal GQA attention on the same
K/V laid out contiguously: prefill of a new chunk over a cached prefix, and batched decode."""

import torch

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.kernels.kv_write import write_kv
from ninfer.kernels.paged_attention import paged_attention_decode, paged_attention_prefill

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16


def dense_attention(q, k, v, first_pos):
    """q [m, nh, d] at positions first_pos.., k/v [n, nkv, d]: softmax(q k^T / sqrt(d)) v."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("mhd,nhd->hmn", q, k) / HEAD_DIM**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= first_pos + torch.arange(q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v)


def paged_setup(seq_lens, seed=0):
    """Per sequence: K/V [n, nkv, d] written onto shuffled pages of a shared pool."""
    gen = torch.Generator().manual_seed(seed)
    pages_each = [-(-n // PAGE_SIZE) for n in seq_lens]
    num_pages = sum(pages_each) + 2
    k_cache = torch.zeros(num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    order = torch.randperm(num_pages, generator=gen).tolist()
    page_table = torch.full((len(seq_lens), max(pages_each)), -1, dtype=torch.int32)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        pages, order = order[: pages_each[i]], order[pages_each[i] :]
        page_table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        slots = torch.tensor([pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(n)])
        write_kv(k, v, k_cache, v_cache, slots)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, page_table, keys, values


def test_write_kv_puts_each_token_at_its_page_and_offset():
    k_cache, v_cache, page_table, keys, values = paged_setup([70])
    for t in (0, 63, 64, 69):
        page = page_table[0, t // PAGE_SIZE]
        assert torch.equal(k_cache[page, t % PAGE_SIZE], keys[0][t])
        assert torch.equal(v_cache[page, t % PAGE_SIZE], values[0][t])


def test_prefill_over_cached_prefix_equals_dense_attention():
    seq_lens, context_lens = [150, 7, 64], [100, 0, 63]
    k_cache, v_cache, page_table, keys, values = paged_setup(seq_lens)
    query_lens = [s - c for s, c in zip(seq_lens, context_lens)]
    q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_attention_prefill(
        q,
        k_cache,
        v_cache,
        page_table,
        starts,
        torch.tensor(context_lens, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32),
        HEAD_DIM**-0.5,
    )
    for i, context_len in enumerate(context_lens):
        piece = slice(starts[i].item(), starts[i + 1].item())
        expected = dense_attention(q[piece], keys[i], values[i], context_len)
        assert torch.allclose(out[piece], expected, atol=1e-5)


def test_batched_decode_equals_dense_attention():
    seq_lens = [1, 64, 65, 200]
    k_cache, v_cache, page_table, keys, values = paged_setup(seq_lens, seed=1)
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_attention_decode(q, k_cache, v_cache, page_table, lens, HEAD_DIM**-0.5)
    for i, n in enumerate(seq_lens):
        expected = dense_attention(q[i : i + 1], keys[i], values[i], n - 1)
        assert torch.allclose(out[i : i + 1], expected, atol=1e-5)

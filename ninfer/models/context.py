"""`ForwardContext`: the metadata of one flat varlen batch, read by the layers that need it
(attention reads pages, GDN reads state slots), so model code stays free of batching logic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache


@dataclass(slots=True)
class ForwardContext:
    is_decode: bool  # every sequence contributes exactly one token
    query_start: torch.Tensor  # int32 [B+1], offsets of each sequence's new tokens
    context_lens: torch.Tensor  # int32 [B], tokens already in the cache
    seq_lens: torch.Tensor  # int32 [B], context_lens + new tokens
    page_table: torch.Tensor  # int32 [B, max_pages], -1 past the end
    kv_write_slots: torch.Tensor  # int64 [T], page_id * 64 + offset of each new token
    state_slots: torch.Tensor  # int32 [B], GDN state / conv window slot
    cache: ModelCache
    max_query_len: int
    max_seq_len: int


def make_context(
    cache: ModelCache,
    *,
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    page_lists: Sequence[Sequence[int]],
    state_slots: Sequence[int],
    device: torch.device | str = "cpu",
) -> ForwardContext:
    """Build a context from per-sequence host lists. Each sequence's pages must cover
    `context_len + query_len` tokens; the new tokens are written right after the context."""
    num_seqs = len(query_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    max_pages = max(1, max(len(p) for p in page_lists))
    page_table = torch.full((num_seqs, max_pages), -1, dtype=torch.int32)
    write_slots: list[int] = []
    for i, (pages, start, end) in enumerate(zip(page_lists, context_lens, seq_lens, strict=True)):
        if len(pages) * PAGE_SIZE < end:
            raise ValueError(f"sequence {i} needs {end} tokens of pages, has {len(pages)} pages")
        page_table[i, : len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
        write_slots += [
            pages[t // PAGE_SIZE] * PAGE_SIZE + t % PAGE_SIZE for t in range(start, end)
        ]
    query_start = [0]
    for q in query_lens:
        query_start.append(query_start[-1] + q)

    def int32(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.int32, device=device)

    return ForwardContext(
        is_decode=all(q == 1 for q in query_lens),
        query_start=int32(query_start),
        context_lens=int32(context_lens),
        seq_lens=int32(seq_lens),
        page_table=page_table.to(device),
        kv_write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
        state_slots=int32(state_slots),
        cache=cache,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )

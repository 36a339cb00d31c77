"""Prefix reuse: how a prefix is named and what a hit must bring. No cache exists yet; these are
the parts the cache will be built on, in use and tested today.

A prefix is named by the hash chain of its full 64-token pages: page i's hash is xxh64 over page
i-1's hash (8 bytes, little-endian; nothing for page 0) and page i's token ids (4 bytes each,
little-endian), so one hash names the whole prefix up to the end of its page. A `Sequence` extends
its chain as its pages fill in the cache, prompt and output alike (`Sequence.advance`). A lookup
still compares token ids before it trusts a hash.

`PrefixMatch` is what admission gets from a lookup (`Scheduler.match_prefix`) and what
`Usage.cached_tokens` reports. On a hybrid model a GDN layer's recurrent state cannot be rebuilt
from K/V, so a hit needs a complete state checkpoint (`kv_pool.StateCheckpoint`) taken after
exactly the hit's number of tokens, and must leave at least one prompt token to compute (its
logits give the first output token).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ninfer.engine.kv_pool import PAGE_SIZE, StateCheckpoint


def hash_page(parent: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full page given its parent's hash (None for the first page)."""
    if len(token_ids) != PAGE_SIZE:
        raise ValueError(f"a page hash covers {PAGE_SIZE} tokens, got {len(token_ids)}")
    digest = xxhash.xxh64()
    if parent is not None:
        digest.update(struct.pack("<Q", parent))
    digest.update(struct.pack(f"<{PAGE_SIZE}I", *token_ids))
    return digest.intdigest()


def page_hashes(token_ids: Sequence[int]) -> list[int]:
    """The hash chain of every full page of `token_ids` (a partial last page has none)."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - PAGE_SIZE + 1, PAGE_SIZE):
        hashes.append(
            hash_page(hashes[-1] if hashes else None, token_ids[start : start + PAGE_SIZE])
        )
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The first `cached_tokens` tokens of a prompt found in the cache, with the state
    checkpoint taken at exactly that position. The empty match (the default) means the prompt
    is computed from its first token."""

    cached_tokens: int = 0
    checkpoint: StateCheckpoint | None = None

    def __post_init__(self) -> None:
        if self.cached_tokens < 0:
            raise ValueError(f"cached_tokens is {self.cached_tokens}")
        if self.cached_tokens and self.checkpoint is None:
            raise ValueError("a prefix hit needs the state checkpoint at its position")
        if self.checkpoint is not None and self.checkpoint.num_tokens != self.cached_tokens:
            raise ValueError(
                f"a hit of {self.cached_tokens} tokens needs a checkpoint at exactly that "
                f"position, not at {self.checkpoint.num_tokens}"
            )

    def check(self, prompt_len: int) -> None:
        """A hit leaves at least one prompt token to compute."""
        if self.cached_tokens >= prompt_len:
            raise ValueError(
                f"a hit of {self.cached_tokens} tokens leaves nothing of a {prompt_len}-token "
                "prompt to compute"
            )

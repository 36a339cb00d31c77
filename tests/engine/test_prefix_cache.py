"""Prefix-reuse seams: the hash chain of full pages that names a prefix (built on each sequence
as its pages fill, prompt and output), the rules a prefix match must keep, and the cached-token
count that admission reports today (none: nothing is kept across requests yet)."""

from __future__ import annotations

import struct

import pytest
import torch
import xxhash
from test_core import GREEDY, Recorder, prompt, run_to_end, submit

from ninfer.engine.kv_pool import StateCheckpoint
from ninfer.engine.prefix_cache import PrefixMatch, hash_page, page_hashes
from ninfer.engine.request import GenerationRequest, SamplingParams


def ids(length: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 150000 for i in range(length)]


def test_page_hash_is_xxh64_of_parent_hash_and_little_endian_token_ids():
    first, second = ids(64, 1), ids(64, 2)
    root = xxhash.xxh64_intdigest(struct.pack("<64I", *first))
    assert hash_page(None, first) == root
    expected = xxhash.xxh64_intdigest(struct.pack("<Q", root) + struct.pack("<64I", *second))
    assert hash_page(root, second) == expected
    assert page_hashes(first + second) == [root, expected]


def test_chain_names_the_whole_prefix_and_skips_a_partial_page():
    tokens = ids(200, 3)
    chain = page_hashes(tokens)
    assert len(chain) == 3  # 200 tokens: three full pages, the last 8 tokens unhashed
    assert page_hashes(tokens[:192] + ids(30, 4)) == chain  # the tail does not count
    changed = list(tokens)
    changed[5] += 1  # one token of the first page: every later hash changes too
    assert all(a != b for a, b in zip(page_hashes(changed), chain))
    same_page_elsewhere = page_hashes(ids(64, 9) + tokens[64:128])
    assert same_page_elsewhere[1] != chain[1]  # equal page content under another parent


def test_a_page_hash_covers_exactly_one_page():
    with pytest.raises(ValueError):
        hash_page(None, ids(63, 1))


def test_sequence_hashes_its_pages_as_they_fill_through_prefill_chunks_and_decode(make_core):
    core = make_core(prefill_chunk=48)
    recorder = Recorder()
    params = SamplingParams.greedy(max_tokens=60, ignore_eos=True)
    seq = submit(core, recorder, GenerationRequest(prompt(100, 21), params, request_id="a"))
    seen = []
    while core.step():
        core.check_integrity()  # the chain always covers exactly the full pages in the cache
        seen.append(len(seq.page_hashes))
    assert seen[:3] == [0, 1, 1]  # 48 then 96 then 100 prompt tokens cached
    # the last output token is never fed back: 100 + 60 - 1 tokens are in the cache
    assert seq.num_cached == 159
    all_ids = seq.prompt_ids + seq.output_ids
    assert seq.page_hashes == page_hashes(all_ids[: seq.num_cached])
    assert len(seq.page_hashes) == 2


def test_usage_reports_no_cached_tokens_for_a_repeated_prompt(make_core):
    core = make_core()
    recorder = Recorder()
    same = prompt(130, 22)
    for request_id in ("first", "again"):
        submit(core, recorder, GenerationRequest(same, GREEDY, request_id=request_id))
        run_to_end(core)  # nothing is retained: every page and slot is free again
    usages = [e.usage for e in recorder.events if e.finished]
    assert [u.prompt_tokens for u in usages] == [130, 130]
    assert [u.cached_tokens for u in usages] == [0, 0]
    assert recorder.completions["first"].token_ids == recorder.completions["again"].token_ids


def checkpoint_at(num_tokens: int) -> StateCheckpoint:
    return StateCheckpoint(num_tokens, [torch.zeros(2, 4, 4)], [torch.zeros(8, 3)])


def test_a_hit_needs_a_checkpoint_at_exactly_its_position():
    assert PrefixMatch(70, checkpoint_at(70)).cached_tokens == 70
    with pytest.raises(ValueError, match="checkpoint"):
        PrefixMatch(64)
    with pytest.raises(ValueError, match="exactly"):
        PrefixMatch(70, checkpoint_at(64))
    with pytest.raises(ValueError, match="exactly"):
        PrefixMatch(0, checkpoint_at(64))


def test_a_hit_leaves_at_least_one_prompt_token_to_compute():
    PrefixMatch(70, checkpoint_at(70)).check(prompt_len=71)
    with pytest.raises(ValueError, match="nothing"):
        PrefixMatch(70, checkpoint_at(70)).check(prompt_len=70)
    PrefixMatch().check(prompt_len=1)

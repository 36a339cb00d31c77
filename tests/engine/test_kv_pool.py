"""The KV page and state-slot pools: every page / slot is owned once or free, never both,
owned + free = total, and a slot is handed out zeroed."""

import pytest
import torch

from ninfer.engine.kv_pool import CacheSpec, ModelCache, PageAllocator, PoolExhausted

SPEC = CacheSpec(
    num_attention_layers=2,
    num_kv_heads=2,
    head_dim=8,
    num_gdn_layers=3,
    gdn_heads=4,
    gdn_key_dim=8,
    gdn_value_dim=8,
    conv_dim=40,
    conv_kernel=4,
)


def test_model_cache_shapes_follow_the_spec():
    cache = ModelCache(SPEC, num_pages=5, num_slots=3, dtype=torch.bfloat16)
    assert len(cache.k) == len(cache.v) == 2
    assert cache.k[0].shape == (5, 64, 2, 8) and cache.k[0].dtype == torch.bfloat16
    assert len(cache.gdn_state) == len(cache.conv_window) == 3
    assert cache.gdn_state[0].shape == (3, 4, 8, 8) and cache.gdn_state[0].dtype == torch.float32
    assert cache.conv_window[0].shape == (3, 40, 3) and cache.conv_window[0].dtype == torch.bfloat16
    assert SPEC.page_bytes(torch.bfloat16) == 2 * 2 * 64 * 2 * 8 * 2


def test_pages_are_owned_once_and_return_to_the_free_list():
    pages = PageAllocator(6)
    a = pages.allocate("a", 2)
    b = pages.allocate("b", 3)
    assert not set(a) & set(b)
    assert [pages.owner(p) for p in a] == ["a", "a"]
    pages.check_integrity()
    with pytest.raises(PoolExhausted):
        pages.allocate("c", 2)
    pages.free(a)
    assert pages.num_free == 3
    with pytest.raises(ValueError):
        pages.free(a)
    pages.check_integrity()


def test_check_integrity_catches_a_page_both_owned_and_free():
    pages = PageAllocator(4)
    page = pages.allocate("a", 1)[0]
    pages._free.append(page)  # corrupt the pool the way a double free would
    with pytest.raises(AssertionError):
        pages.check_integrity()


def test_state_slot_is_zeroed_when_handed_out():
    cache = ModelCache(SPEC, num_pages=2, num_slots=2)
    slot = cache.slots.allocate("a")
    cache.gdn_state[1][slot].fill_(3.0)
    cache.conv_window[2][slot].fill_(5.0)
    cache.slots.free(slot)
    again = cache.slots.allocate("b")
    assert again == slot
    assert cache.gdn_state[1][again].abs().sum() == 0
    assert cache.conv_window[2][again].abs().sum() == 0
    cache.check_integrity()
    cache.slots.allocate("c")
    with pytest.raises(PoolExhausted):
        cache.slots.allocate("d")

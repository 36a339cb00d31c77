"""The KV page and state-slot pools: every page / slot is owned once or free, never both,
owned + free = total, and a slot is handed out zeroed."""

import pytest
import torch

from ninfer.engine.kv_pool import (
    CacheSpec,
    ModelCache,
    PageAllocator,
    PoolExhausted,
    StateSlotAllocator,
)

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


def test_state_slots_keep_the_same_invariant_as_pages():
    slots = StateSlotAllocator(3)
    slot = slots.allocate("a")
    slots.free(slot)
    with pytest.raises(ValueError, match="state slot"):
        slots.free(slot)
    slots.check_integrity()
    slot = slots.allocate("b")
    slots._free.append(slot)  # a double free that skipped the check
    with pytest.raises(AssertionError, match="state slot"):
        slots.check_integrity()


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


def filled_cache(dtype: torch.dtype = torch.bfloat16) -> ModelCache:
    """A cache whose every slot holds distinct random state and conv windows."""
    cache = ModelCache(SPEC, num_pages=2, num_slots=4, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for tensor in (*cache.gdn_state, *cache.conv_window):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))
    return cache


def slot_rows(cache: ModelCache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for t in (*cache.gdn_state, *cache.conv_window)]


def test_copy_slot_copies_every_gdn_layer_bit_for_bit_and_nothing_else():
    cache = filled_cache()
    source, others = slot_rows(cache, 1), [slot_rows(cache, s) for s in (0, 1, 3)]
    cache.copy_slot(1, 2)
    assert all(torch.equal(a, b) for a, b in zip(slot_rows(cache, 2), source))
    for slot, before in zip((0, 1, 3), others):
        assert all(torch.equal(a, b) for a, b in zip(slot_rows(cache, slot), before))


def test_checkpoint_is_a_host_copy_that_restores_exactly_into_any_slot():
    cache = filled_cache()
    saved_rows = slot_rows(cache, 0)
    checkpoint = cache.save_slot(0, num_tokens=130)
    assert checkpoint.num_tokens == 130
    assert all(t.device.type == "cpu" for t in (*checkpoint.gdn_state, *checkpoint.conv_window))
    assert checkpoint.conv_window[0].dtype == torch.bfloat16
    assert checkpoint.nbytes == SPEC.slot_bytes(torch.bfloat16)
    for tensor in (*cache.gdn_state, *cache.conv_window):
        tensor[0].fill_(7.0)  # the slot moves on; the checkpoint must not
    cache.restore_slot(checkpoint, 3)
    assert all(torch.equal(a, b) for a, b in zip(slot_rows(cache, 3), saved_rows))


def test_a_checkpoint_from_other_pools_is_refused():
    checkpoint = filled_cache(torch.float32).save_slot(0, num_tokens=1)
    with pytest.raises(ValueError, match="does not fit"):
        filled_cache(torch.bfloat16).restore_slot(checkpoint, 0)


def test_a_restored_checkpoint_continues_exactly_like_the_uninterrupted_sequence(make_core):
    """The model's next tokens from a slot restored from a checkpoint (or forked from the live
    slot) have the same logits, bit for bit, as the sequence that never stopped."""
    from ninfer.models.context import make_context

    core = make_core()
    model, cache = core.runner.model, core.cache
    page = cache.pages.allocate("prefix", 1)
    live, forked, restored = (cache.slots.allocate(name) for name in ("live", "fork", "back"))
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, 256, (20,), generator=gen)
    follow = torch.randint(0, 256, (3,), generator=gen)

    def run(slot: int, start: int, tokens: torch.Tensor) -> torch.Tensor:
        # all three continuations write the same K/V into the shared page at the same places
        ctx = make_context(
            cache,
            context_lens=[start],
            query_lens=[len(tokens)],
            page_lists=[page],
            state_slots=[slot],
        )
        positions = torch.arange(start, start + len(tokens))
        return model.compute_logits(model(tokens, positions, ctx))

    run(live, 0, prompt_ids)
    checkpoint = cache.save_slot(live, num_tokens=20)
    cache.copy_slot(live, forked)
    outputs = {}
    for name, slot in (("live", live), ("fork", forked)):
        outputs[name] = [run(slot, 20 + i, follow[i : i + 1]) for i in range(3)]
    cache.restore_slot(checkpoint, restored)
    outputs["back"] = [run(restored, 20 + i, follow[i : i + 1]) for i in range(3)]
    for name in ("fork", "back"):
        assert all(torch.equal(a, b) for a, b in zip(outputs[name], outputs["live"])), name
    cache.check_integrity()


def test_bf16_state_slots_take_half_the_state_bytes():
    cache = ModelCache(SPEC, num_pages=2, num_slots=3, state_dtype=torch.bfloat16)
    assert all(state.dtype == torch.bfloat16 for state in cache.gdn_state)
    state_bytes = 3 * 4 * 8 * 8  # layers x heads x dk x dv
    window_bytes = 3 * 40 * 3 * 4  # fp32 conv windows
    assert SPEC.slot_bytes(torch.float32) == 4 * state_bytes + window_bytes
    assert SPEC.slot_bytes(torch.float32, torch.bfloat16) == 2 * state_bytes + window_bytes


def test_the_auto_pool_leaves_room_for_every_state_slot(make_core, monkeypatch):
    """An `auto` K/V pool is sized after the state slots are set aside (one per lane), so that
    a long `max_context` does not take the memory the slots are then allocated from."""
    from ninfer.engine import engine
    from ninfer.engine.config import EngineConfig

    model = make_core().runner.model
    spec = model.cache_spec()
    for state_dtype in ("float32", "bfloat16"):
        config = EngineConfig(max_concurrency=5, gdn_state_dtype=state_dtype)
        slot = spec.slot_bytes(model.dtype, getattr(torch, state_dtype))
        assert engine.cache_reserve_bytes(config, model, graphs=False) == 5 * slot
    monkeypatch.setattr(engine, "graph_reserve_bytes", lambda config, model: 1000)
    with_graphs = engine.cache_reserve_bytes(config, model, graphs=True)  # the scratch slot too
    assert with_graphs == 6 * spec.slot_bytes(model.dtype, torch.bfloat16) + 1000
    seen = []
    pool_pages = engine.pool_pages
    monkeypatch.setattr(
        engine, "pool_pages", lambda *a, **k: seen.append(k["reserve_bytes"]) or pool_pages(*a)
    )
    make_core(max_concurrency=5, kv_capacity="auto")  # build_core sets the slots aside
    assert seen == [5 * spec.slot_bytes(model.dtype)]
    monkeypatch.setattr(engine, "pool_pages", pool_pages)
    free = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 2 * free))
    config = EngineConfig(max_context=1 << 20, max_concurrency=4, kv_headroom_bytes=0)
    page = spec.page_bytes(model.dtype)
    reserve = engine.cache_reserve_bytes(config, model, graphs=False)
    pages = engine.pool_pages(config, page, torch.device("cuda"), reserve_bytes=reserve)
    assert pages * page + 4 * spec.slot_bytes(model.dtype) <= free


def test_an_engine_with_bf16_states_stays_near_the_fp32_one(make_core):
    """`gdn_state_dtype="bfloat16"`: the slots hold bf16 and the logits of a prefill and ten
    decode steps stay near the fp32-state run's (2e-5 of their norm on this model)."""
    from ninfer.models.context import make_context

    logits = {}
    for state_dtype in ("float32", "bfloat16"):
        core = make_core(gdn_state_dtype=state_dtype)
        model, cache = core.runner.model, core.cache
        assert cache.gdn_state[0].dtype == getattr(torch, state_dtype)
        pages = cache.pages.allocate("r", 1)
        slot = cache.slots.allocate("r")
        tokens = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(3))
        steps = []
        for start, chunk in (
            (0, tokens[:20]),
            *((20 + i, tokens[20 + i : 21 + i]) for i in range(10)),
        ):
            ctx = make_context(
                cache, context_lens=[start], query_lens=[len(chunk)], page_lists=[pages],
                state_slots=[slot],
            )  # fmt: skip
            positions = torch.arange(start, start + len(chunk))
            steps.append(model.compute_logits(model(chunk, positions, ctx))[-1])
        logits[state_dtype] = torch.stack(steps)
    exact, rounded = logits["float32"], logits["bfloat16"]
    assert not torch.equal(exact, rounded)  # the states were rounded
    assert (rounded - exact).norm() < 1e-3 * exact.norm()


def test_a_pool_too_big_for_the_host_is_a_config_error_naming_its_size(make_core, monkeypatch):
    """A `max_context` whose K/V pool cannot fit in the host's memory stops the start with a
    ConfigError giving the sizes, before anything is allocated (an overcommitting host would
    rather kill the process than fail the allocation)."""
    from ninfer.engine import engine
    from ninfer.errors import ConfigError

    monkeypatch.setattr(engine, "host_available_bytes", lambda: 50 * 2**20)
    with pytest.raises(ConfigError, match=r"K/V pool of 640000 tokens .* lower max_context"):
        make_core(max_context=640_000, kv_capacity=640_000)
    monkeypatch.setattr(engine, "host_available_bytes", lambda: None)

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(engine, "ModelCache", refuse)
    with pytest.raises(ConfigError, match="do not fit in memory"):
        make_core()


def test_the_host_memory_check_reads_the_containers_limit(tmp_path, monkeypatch):
    """MemAvailable, lowered to what a cgroup v2 limit leaves (a container sees the host's
    MemAvailable); no limit or no file leaves the other."""
    from ninfer.engine import engine

    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    cgroup.mkdir()
    meminfo.write_text("MemTotal:       64000000 kB\nMemAvailable:   32000000 kB\n")
    monkeypatch.setattr(engine, "MEMINFO", meminfo)
    monkeypatch.setattr(engine, "CGROUP", cgroup)
    assert engine.host_available_bytes() == 32_000_000 * 1024
    (cgroup / "memory.max").write_text("8000000000\n")
    (cgroup / "memory.current").write_text("3000000000\n")
    assert engine.host_available_bytes() == 5_000_000_000
    (cgroup / "memory.max").write_text("max\n")
    assert engine.host_available_bytes() == 32_000_000 * 1024
    meminfo.unlink()
    (cgroup / "memory.max").write_text("8000000000\n")
    assert engine.host_available_bytes() == 5_000_000_000

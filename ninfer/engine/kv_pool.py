"""The preallocated memory pools: K/V pages of full-attention layers and recurrent-state slots of
Gated-DeltaNet layers, with the allocators that hand them to sequences.

Invariants (checked by `check_integrity`): every page / slot is either free or owned by exactly
one owner, never both and never twice, and owned + free = total. A slot's GDN state and conv
window are zeroed when the slot is handed out, so a fresh sequence starts from an empty state.

A slot's state is also what a prefix hit restores (prefix_cache.py): `ModelCache` copies one
slot into another and into / out of a `StateCheckpoint`, bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

PAGE_SIZE = 64


class PoolExhausted(RuntimeError):
    """Asked for more pages or slots than are free; callers check `num_free` first."""


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """Shapes of the per-layer caches a model needs (from `model.cache_spec()`)."""

    num_attention_layers: int  # full-attention layers, the MTP layer included
    num_kv_heads: int
    head_dim: int
    num_gdn_layers: int
    gdn_heads: int  # value heads Hv
    gdn_key_dim: int  # dk
    gdn_value_dim: int  # dv
    conv_dim: int  # channels of the GDN causal conv (2 * Hk * dk + Hv * dv)
    conv_kernel: int  # K; a slot keeps the last K - 1 conv inputs

    def page_bytes(self, kv_dtype: torch.dtype) -> int:
        """Bytes one page takes across all attention layers (K and V)."""
        per_layer = 2 * PAGE_SIZE * self.num_kv_heads * self.head_dim * kv_dtype.itemsize
        return self.num_attention_layers * per_layer

    def slot_bytes(self, conv_dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> int:
        """Bytes one state slot takes across all GDN layers (recurrent state + conv window)."""
        state = self.gdn_heads * self.gdn_key_dim * self.gdn_value_dim * state_dtype.itemsize
        window = self.conv_dim * (self.conv_kernel - 1) * conv_dtype.itemsize
        return self.num_gdn_layers * (state + window)


@dataclass(slots=True)
class StateCheckpoint:
    """One slot's recurrent state and conv window in every GDN layer, copied out of the pools
    after a sequence's first `num_tokens` tokens (pinned host memory when the pools are on
    CUDA). It owns its tensors: later writes to the slot do not reach it."""

    num_tokens: int
    gdn_state: list[torch.Tensor]
    conv_window: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.gdn_state, *self.conv_window))


class OwnerTable:
    """The owner of each of `size` items (pages or slots) and the free list; the one keeper of
    the pools' invariant. `kind` names an item in errors ("page", "state slot")."""

    def __init__(self, size: int, kind: str) -> None:
        self.kind = kind
        self._owner: list[Hashable | None] = [None] * size
        # popped from the end, so low ids go first
        self._free: list[int] = list(range(size - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def owner(self, item: int) -> Hashable | None:
        return self._owner[item]

    def _take(self, owner: Hashable, count: int) -> list[int]:
        """`count` free items for `owner`; the caller checked `num_free`."""
        items = [self._free.pop() for _ in range(count)]
        for item in items:
            self._owner[item] = owner
        return items

    def _release(self, items: Sequence[int]) -> None:
        for item in items:
            if self._owner[item] is None:
                raise ValueError(f"{self.kind} {item} is already free")
            self._owner[item] = None
            self._free.append(item)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"a {self.kind} is on the free list twice")
        owned = {i for i, o in enumerate(self._owner) if o is not None}
        if owned & free:
            raise AssertionError(f"{self.kind}s both owned and free: {sorted(owned & free)}")
        if len(owned) + len(free) != len(self._owner):
            raise AssertionError(
                f"owned {len(owned)} + free {len(free)} != total {len(self._owner)} {self.kind}s"
            )


class PageAllocator(OwnerTable):
    """Hands out 64-token KV pages; remembers the owner of each page."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages, "page")

    def allocate(self, owner: Hashable, count: int) -> list[int]:
        if count > self.num_free:
            raise PoolExhausted(f"need {count} KV pages, {self.num_free} free")
        return self._take(owner, count)

    def free(self, pages: Sequence[int]) -> None:
        self._release(pages)


class StateSlotAllocator(OwnerTable):
    """Hands out GDN state slots (recurrent state + conv window of every GDN layer).

    `tensors` are the per-layer pools indexed by slot on dim 0; a slot is zeroed in all of them
    when handed out.
    """

    def __init__(self, num_slots: int, tensors: Sequence[torch.Tensor] = ()) -> None:
        super().__init__(num_slots, "state slot")
        self._tensors = list(tensors)

    def allocate(self, owner: Hashable) -> int:
        if not self.num_free:
            raise PoolExhausted("no free state slot")
        (slot,) = self._take(owner, 1)
        for tensor in self._tensors:
            tensor[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._release([slot])


class ModelCache:
    """All cache tensors of one model plus the allocators over them.

    - `k[i]`, `v[i]`: `[num_pages, 64, n_kv_heads, head_dim]` for attention layer i (in layer
      order; the MTP layer is last), dtype `kv_dtype`.
    - `gdn_state[j]`: `[num_slots, Hv, dk, dv]` for GDN layer j (in layer order), dtype
      `state_dtype` (fp32 by default; bf16 halves the slots' memory and the decode kernel's
      state traffic, rounding the state once per step).
    - `conv_window[j]`: `[num_slots, conv_dim, K - 1]`, the last K - 1 conv inputs, model dtype.

    With `scratch=True` every pool has one more row than its allocator hands out: page
    `scratch_page` (= num_pages) and slot `scratch_slot` (= num_slots), where the padded rows
    of a CUDA-graph batch write their K/V and state. No sequence ever owns or reads them.
    """

    def __init__(
        self,
        spec: CacheSpec,
        num_pages: int,
        num_slots: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype | None = None,
        state_dtype: torch.dtype = torch.float32,
        scratch: bool = False,
    ) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.scratch_page = num_pages if scratch else None
        self.scratch_slot = num_slots if scratch else None
        extra = 1 if scratch else 0
        kv_dtype = kv_dtype or dtype
        page_shape = (num_pages + extra, PAGE_SIZE, spec.num_kv_heads, spec.head_dim)
        self.k = [
            torch.zeros(page_shape, dtype=kv_dtype, device=device)
            for _ in range(spec.num_attention_layers)
        ]
        self.v = [
            torch.zeros(page_shape, dtype=kv_dtype, device=device)
            for _ in range(spec.num_attention_layers)
        ]
        state_shape = (num_slots + extra, spec.gdn_heads, spec.gdn_key_dim, spec.gdn_value_dim)
        window_shape = (num_slots + extra, spec.conv_dim, spec.conv_kernel - 1)
        self.gdn_state = [
            torch.zeros(state_shape, dtype=state_dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]
        self.conv_window = [
            torch.zeros(window_shape, dtype=dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]
        self.pages = PageAllocator(num_pages)
        self.slots = StateSlotAllocator(num_slots, [*self.gdn_state, *self.conv_window])

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` the GDN state and conv window of slot `src` (a device-side fork)."""
        for tensor in (*self.gdn_state, *self.conv_window):
            tensor[dst].copy_(tensor[src])

    def save_slot(self, slot: int, num_tokens: int) -> StateCheckpoint:
        """Copy slot `slot`, which holds the state after `num_tokens` tokens, to the host."""
        pin = self.gdn_state[0].is_cuda if self.gdn_state else False

        def host_copy(tensor: torch.Tensor) -> torch.Tensor:
            row = tensor[slot]
            out = torch.empty(row.shape, dtype=row.dtype, device="cpu", pin_memory=pin)
            return out.copy_(row)

        return StateCheckpoint(
            num_tokens,
            [host_copy(t) for t in self.gdn_state],
            [host_copy(t) for t in self.conv_window],
        )

    def restore_slot(self, checkpoint: StateCheckpoint, slot: int) -> None:
        """Overwrite slot `slot` with a checkpoint taken from pools of the same spec."""
        pairs = [
            *zip(self.gdn_state, checkpoint.gdn_state, strict=True),
            *zip(self.conv_window, checkpoint.conv_window, strict=True),
        ]
        for pool, saved in pairs:
            if pool.shape[1:] != saved.shape or pool.dtype != saved.dtype:
                raise ValueError(
                    f"checkpoint row {tuple(saved.shape)} {saved.dtype} does not fit pool rows "
                    f"{tuple(pool.shape[1:])} {pool.dtype}"
                )
        for pool, saved in pairs:
            pool[slot].copy_(saved)

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.slots.check_integrity()

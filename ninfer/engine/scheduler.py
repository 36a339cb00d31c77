"""Admission and step planning: which waiting requests start, and what the next step runs.

Admission is FIFO. A request starts when a lane (one of `max_concurrency`) and the pages for
its prompt plus its whole output are free; the pages are taken at once, so an admitted request
always finishes. When the head of the queue does not fit, a later request may start (backfill)
only if that cannot delay the head: either the head still fits, once the running requests it
waits for are done, next to the newcomer, or the newcomer is sure to be done by then
(judged by worst-case step counts).

Each step is one of two units: a prefill chunk (up to `prefill_chunk` prompt tokens, or
`idle_prefill_chunk` while no request is decoding, packed from the prefilling requests in
admission order) or a decode round (one token for every
decode-ready request). They alternate while both kinds of work exist, so a long prompt cannot
stall running decodes and decodes cannot starve a prompt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.engine.prefix_cache import PrefixMatch
from ninfer.engine.sequence import Sequence, Status


class AdmissionFailed(Exception):
    """Starting `seq` failed: a bug or a device failure, not a shortage (`_fits` found room)."""

    def __init__(self, seq: Sequence, cause: Exception) -> None:
        super().__init__(f"starting request {seq.request_id} failed: {cause!r}")
        self.seq = seq


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: `query_lens[i]` new tokens of `seqs[i]`; `sampled[i]` says whether the
    step ends with a new token for it (always in decode, at the last chunk in prefill)."""

    is_decode: bool
    seqs: list[Sequence]
    query_lens: list[int]
    sampled: list[bool]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class Scheduler:
    def __init__(
        self,
        cache: ModelCache,
        *,
        max_concurrency: int,
        prefill_chunk: int,
        idle_prefill_chunk: int | None = None,
    ) -> None:
        if cache.num_slots < max_concurrency:
            raise ValueError(f"{cache.num_slots} state slots for {max_concurrency} lanes")
        self.cache = cache
        self.max_concurrency = max_concurrency
        self.prefill_chunk = prefill_chunk
        # when nothing decodes, no stream waits on the chunk: take larger ones
        self.idle_prefill_chunk = max(prefill_chunk, idle_prefill_chunk or 0)
        self.waiting: deque[Sequence] = deque()
        self.failed_admissions: list[AdmissionFailed] = []  # for the caller to end
        self.running: list[Sequence] = []
        self._last_was_decode = False

    # ---- queue -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.pages_needed > self.cache.num_pages:
            raise ValueError(
                f"request needs {seq.pages_needed} pages, the pool has {self.cache.num_pages}"
            )
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, seq: Sequence) -> None:
        """Give back everything `seq` holds and forget it (finish, abort or error)."""
        if seq.status is Status.RUNNING:
            self.cache.pages.free(seq.pages)
            self.cache.slots.free(seq.state_slot)
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.pages = []
        seq.state_slot = -1
        seq.status = Status.FINISHED

    # ---- admission ---------------------------------------------------------------------

    def _fits(self, seq: Sequence) -> bool:
        return (
            len(self.running) < self.max_concurrency
            and self.cache.slots.num_free > 0
            and self.cache.pages.num_free >= seq.pages_needed
        )

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The one place a prefix cache plugs into admission: the longest cached prefix of the
        prompt that ends at a state checkpoint. Nothing is kept across requests yet, so every
        prompt is computed from its first token and reports no cached tokens.

        A hit will share the prefix's full pages read-only, copy its partial last page into a
        page of the sequence before the sequence writes there, restore the checkpoint into
        the sequence's slot, and start prefill at `cached_tokens`."""
        return PrefixMatch()

    def _start(self, seq: Sequence, now: float) -> None:
        """Move `seq` from waiting to running with its pages and slot; where that fails, it
        stays waiting and holds nothing (`AdmissionFailed`), so it can be ended."""
        try:
            match = self.match_prefix(seq)
            match.check(seq.prompt_len)
            pages = self.cache.pages.allocate(seq.request_id, seq.pages_needed)
            try:
                slot = self.cache.slots.allocate(seq.request_id)
            except BaseException:
                self.cache.pages.free(pages)
                raise
        except Exception as exc:
            raise AdmissionFailed(seq, exc) from exc
        self.waiting.remove(seq)
        seq.pages, seq.state_slot = pages, slot
        seq.advance(match.cached_tokens)
        seq.cached_tokens = match.cached_tokens
        seq.status = Status.RUNNING
        seq.admitted_at = now
        self.running.append(seq)

    def _head_outlook(self, head: Sequence) -> tuple[int, int, int]:
        """(steps, free pages, free lanes) at the earliest point where `head` is sure to fit
        if nothing else starts: running requests release in order of their worst-case end."""
        free_pages = self.cache.pages.num_free
        free_lanes = self.max_concurrency - len(self.running)
        steps = 0
        ends = sorted(self.running, key=lambda s: s.worst_case_steps(self.prefill_chunk))
        for seq in ends:
            if free_pages >= head.pages_needed and free_lanes > 0:
                break
            steps = seq.worst_case_steps(self.prefill_chunk)
            free_pages += len(seq.pages)
            free_lanes += 1
        return steps, free_pages, free_lanes

    def _can_backfill(self, head: Sequence, seq: Sequence) -> bool:
        steps, free_pages, free_lanes = self._head_outlook(head)
        if free_pages - seq.pages_needed >= head.pages_needed and free_lanes > 1:
            return True
        return seq.worst_case_steps(self.prefill_chunk) <= steps

    def admit(self, now: float) -> list[Sequence]:
        """Start the waiting requests that fit, in order (and later ones that cannot delay the
        first); returns those started. One whose start fails stops admission for this step
        and is left, still waiting, in `failed_admissions` for the caller to end."""
        started: list[Sequence] = []
        try:
            while self.waiting and self._fits(self.waiting[0]):
                seq = self.waiting[0]
                self._start(seq, now)
                started.append(seq)
            if not self.waiting or not self.running:
                return started
            head = self.waiting[0]
            for seq in list(self.waiting)[1:]:
                if self._fits(seq) and self._can_backfill(head, seq):
                    self._start(seq, now)
                    started.append(seq)
        except AdmissionFailed as failed:
            self.failed_admissions.append(failed)
        return started

    # ---- planning ----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch | None:
        """Plan the next unit over the running requests (None when nothing is running); call
        `admit` first."""
        prefilling = [s for s in self.running if s.in_prefill]
        decoding = [s for s in self.running if not s.in_prefill]
        if prefilling and (not decoding or self._last_was_decode):
            self._last_was_decode = False
            budget = self.prefill_chunk if decoding else self.idle_prefill_chunk
            return self._prefill_chunk(prefilling, budget)
        if decoding:
            self._last_was_decode = True
            return ScheduledBatch(True, decoding, [1] * len(decoding), [True] * len(decoding))
        return None

    def _prefill_chunk(self, prefilling: list[Sequence], budget: int) -> ScheduledBatch:
        batch = ScheduledBatch(False, [], [], [])
        for seq in prefilling:
            if budget == 0:
                break
            take = min(seq.prompt_len - seq.num_cached, budget)
            budget -= take
            batch.seqs.append(seq)
            batch.query_lens.append(take)
            batch.sampled.append(seq.num_cached + take == seq.prompt_len)
        return batch

    @staticmethod
    def advance(batch: ScheduledBatch) -> None:
        """Record that the batch's tokens are now in the cache."""
        for seq, n in zip(batch.seqs, batch.query_lens):
            seq.advance(n)

    # ---- invariants --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pools are consistent, every running request owns exactly its pages and slot and has
        hashed each full page in the cache, and nothing else owns anything."""
        self.cache.check_integrity()
        owned_pages = 0
        for seq in self.running:
            assert seq.status is Status.RUNNING, seq.request_id
            for page in seq.pages:
                assert self.cache.pages.owner(page) == seq.request_id, (page, seq.request_id)
            assert self.cache.slots.owner(seq.state_slot) == seq.request_id, seq.request_id
            assert len(seq.page_hashes) == seq.num_cached // PAGE_SIZE, seq.request_id
            owned_pages += len(seq.pages)
        for seq in self.waiting:
            assert seq.status is Status.WAITING and not seq.pages and seq.state_slot < 0
        assert owned_pages + self.cache.pages.num_free == self.cache.num_pages, "page leaked"
        used_slots = self.cache.num_slots - self.cache.slots.num_free
        assert used_slots == len(self.running), "state slot leaked"
        assert len(self.running) <= self.max_concurrency

"""`Sequence`: the engine thread's state of one request, from submit to finish."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ninfer.engine.kv_pool import PAGE_SIZE
from ninfer.engine.prefix_cache import hash_page
from ninfer.engine.request import FinishReason, GenerationRequest, Timings, TokenEvent


class Status(enum.Enum):
    WAITING = "waiting"  # in the pending queue, owns nothing
    RUNNING = "running"  # owns a lane, its pages and a state slot
    FINISHED = "finished"  # released everything


@dataclass(slots=True)
class Sequence:
    """Prompt and output ids plus everything the engine holds for them.

    The K/V of the first `num_cached` tokens is in the cache. While `num_cached` is below the
    prompt length the sequence is prefilling; after, it is decode-ready: its last output token
    is the next input. `page_hashes` is the hash chain (prefix_cache.py) of the full pages among
    those tokens; `cached_tokens` of the prompt came from a prefix match at admission.
    """

    request: GenerationRequest
    max_tokens: int  # effective output limit
    seed: int
    stop_token_ids: frozenset[int]
    sink: Callable[[TokenEvent], None]
    decoder: Any = None  # chat OutputDecoder when the request detokenizes
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    cached_tokens: int = 0
    page_hashes: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    state_slot: int = -1
    status: Status = Status.WAITING
    abort_requested: bool = False
    owner: object = None  # who submitted it (`EngineCore.add`), for an abort of only it
    reasoning_tokens: int = 0
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: FinishReason | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prompt_len

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of tokens [start, end) of prompt + output."""
        prompt = self.request.prompt_ids
        if end <= len(prompt):
            return prompt[start:end]
        return (prompt + self.output_ids)[start:end]

    def advance(self, num_tokens: int) -> None:
        """`num_tokens` more tokens are in the cache; hash each page they fill."""
        self.num_cached += num_tokens
        while (len(self.page_hashes) + 1) * PAGE_SIZE <= self.num_cached:
            start = len(self.page_hashes) * PAGE_SIZE
            parent = self.page_hashes[-1] if self.page_hashes else None
            self.page_hashes.append(hash_page(parent, self.token_ids(start, start + PAGE_SIZE)))

    @property
    def pages_needed(self) -> int:
        """Pages that hold prompt + the whole output: reserved at admission, so an admitted
        request never runs out of cache."""
        return -(-(self.prompt_len + self.max_tokens) // PAGE_SIZE)

    def worst_case_steps(self, prefill_chunk: int) -> int:
        """Most engine steps this sequence can still take part in before it finishes."""
        prefill_left = self.prompt_len - min(self.num_cached, self.prompt_len)
        return -(-prefill_left // prefill_chunk) + self.max_tokens - len(self.output_ids)

    def timings(self) -> Timings:
        end = self.finished_at or time.perf_counter()
        admitted = self.admitted_at or end
        first = self.first_token_at or end
        return Timings(
            queue=admitted - self.submitted_at,
            prefill=(first - admitted) if self.admitted_at else 0.0,
            ttft=(first - self.submitted_at) if self.first_token_at else 0.0,
            decode=(end - first) if self.first_token_at else 0.0,
            total=end - self.submitted_at,
        )

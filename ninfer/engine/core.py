"""`EngineCore`: the single-threaded step loop. Each `step()` applies pending aborts and queue
deadlines, lets the scheduler admit and plan one unit, runs it, and turns the sampled tokens
into `TokenEvent`s (text through the chat layer's output decoder, stops, usage, timings).
`Engine` drives it from its thread; tests drive it directly, step by step."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection

import torch

from ninfer.engine.config import EngineConfig
from ninfer.engine.kv_pool import ModelCache
from ninfer.engine.request import (
    FinishReason,
    GenerationRequest,
    TokenEvent,
    Usage,
    check_request,
)
from ninfer.engine.runner import LaunchedStep, ModelRunner
from ninfer.engine.sampler import Sampler
from ninfer.engine.scheduler import ScheduledBatch, Scheduler
from ninfer.engine.sequence import Sequence, Status
from ninfer.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidRequestError,
    QueueTimeout,
)

EventSink = Callable[[TokenEvent], None]

log = logging.getLogger("ninfer.engine")


class EngineCore:
    """Owns the scheduler, the runner and every live `Sequence`; not thread-safe."""

    def __init__(
        self,
        model,
        cache: ModelCache,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_ids: Collection[int] = (),
        frontend=None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.frontend = frontend  # ninfer.chat.ChatFrontend, None for ids-only models
        self.sampler = Sampler(vocab_size, cache.num_slots, cache_device(cache))
        self.runner = ModelRunner(model, cache, self.sampler)
        self.scheduler = Scheduler(
            cache,
            max_concurrency=config.max_concurrency,
            prefill_chunk=config.prefill_chunk,
            idle_prefill_chunk=config.idle_chunk,
        )
        self.sequences: dict[str, Sequence] = {}
        # a decode step launched but not yet read back (overlap: see `step`)
        self._in_flight: LaunchedStep | None = None

    # ---- requests ----------------------------------------------------------------------

    def effective_max_tokens(self, request: GenerationRequest) -> int:
        """The output limit after defaults; raises `ContextLengthExceeded` when prompt plus
        output cannot fit `max_context`."""
        prompt_len = len(request.prompt_ids)
        room = self.config.max_context - prompt_len
        asked = request.params.max_tokens
        if asked is not None:
            if asked > room:
                raise ContextLengthExceeded(prompt_len, asked, self.config.max_context)
            return asked
        if room < 1:
            raise ContextLengthExceeded(prompt_len, None, self.config.max_context)
        default = self.config.default_max_tokens
        return room if default is None else min(default, room)

    def validate(self, request: GenerationRequest) -> int:
        """Checks that need no engine state (safe from any thread); returns max_tokens."""
        check_request(request)
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        # one pass over a prompt that may be long: integers (not bools) inside the vocabulary
        bad = [t for t in request.prompt_ids if type(t) is not int or not 0 <= t < self.vocab_size]
        if bad:
            if type(bad[0]) is not int:
                raise InvalidRequestError(
                    "prompt_ids must be a list of integer token ids", "prompt_ids"
                )
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
            )
        request.params.validate(self.vocab_size)
        return self.effective_max_tokens(request)

    def add(
        self,
        request: GenerationRequest,
        sink: EventSink,
        submitted_at: float | None = None,
        owner: object = None,
    ) -> Sequence:
        """Admit `request`; `submitted_at` (perf_counter seconds, default now) is when its
        caller handed it over, from which its queue time, ttft and pending deadline count;
        `owner` (any object, e.g. the submission's handle) lets `abort` end only it."""
        if request.request_id in self.sequences:
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        max_tokens = self.validate(request)
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        decoder = None
        if request.detokenize and self.frontend is not None:
            decoder = self.frontend.decoder(
                request.starts_in_reasoning,
                stop=params.stop,
                reasoning_stop=params.reasoning_stop,
                stop_token_ids=stop_ids,
                split_reasoning=request.split_reasoning,
            )
        seq = Sequence(
            request=request,
            max_tokens=max_tokens,
            seed=params.seed if params.seed is not None else secrets.randbits(63),
            stop_token_ids=frozenset(stop_ids),
            sink=sink,
            decoder=decoder,
        )
        if submitted_at is not None:
            seq.submitted_at = submitted_at
        seq.owner = owner
        self.scheduler.add(seq)
        self.sequences[seq.request_id] = seq
        return seq

    def abort(self, request_id: str, owner: object = None) -> None:
        """Mark for cancellation; it takes effect at the next step boundary. With `owner`,
        only while the request running under the id is the one `add` was given it with."""
        seq = self.sequences.get(request_id)
        if seq is not None and (owner is None or seq.owner is owner):
            seq.abort_requested = True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._in_flight is not None

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> bool:
        """Run one unit of work; False when there was nothing to run.

        Decode steps overlap the host with the device (`EngineConfig.overlap`): a decode step
        is launched and left in flight; the next call launches the following decode step,
        its input ids taken from the device output of the one in flight, and only then waits
        for and reads back that one. So the host's scheduling, input staging, launches and
        event delivery of one step run while the device computes the step before it. A
        request that the step in flight ends (a stop token or string, an abort) has one more
        row in the step after it, computed and dropped; one that ends by length is left out
        of it."""
        now = time.perf_counter()
        for seq in list(self.sequences.values()):
            if seq.abort_requested:
                self._finish(seq, "abort")
        self._expire_waiting(now)
        for seq in self.scheduler.admit(now):
            self.sampler.reset_lane(seq.state_slot)
        while self.scheduler.failed_admissions:
            failed = self.scheduler.failed_admissions.pop()
            log.error("%s", failed)
            self._finish(failed.seq, "error", error=EngineError(str(failed)))
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            ahead = self._launch_ahead(in_flight)
            try:
                self._complete(in_flight)
            except Exception as exc:  # the step ahead fed on it: it fails with it
                if ahead is not None:
                    self._fail_batch(ahead.batch, exc)
                raise
            if ahead is not None:  # its fed tokens are recorded now: the pages can be hashed
                self._advance(ahead.batch)
                self._in_flight = ahead
            return True
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        launched = self._launch(batch)
        self._advance(batch)
        if batch.is_decode and self._overlaps():
            self._in_flight = launched
        else:
            self._complete(launched)
        return True

    def _overlaps(self) -> bool:
        return self.config.overlap and getattr(self.runner, "steps_ahead", False)

    def _launch_ahead(self, in_flight: LaunchedStep) -> LaunchedStep | None:
        """Launch the decode step after `in_flight` before reading it back, when nothing but
        those requests' next tokens is to be done (no request in prefill; a request waiting
        for a lane that `in_flight` frees is admitted one step later)."""
        if not (self._overlaps() and in_flight.batch.is_decode):
            return None
        running = self.scheduler.running
        if not running or any(seq.in_prefill for seq in running):
            return None
        # a request whose in-flight token is its last ends there
        seqs = [seq for seq in running if len(seq.output_ids) + 1 < seq.max_tokens]
        if not seqs:
            return None
        batch = ScheduledBatch(True, seqs, [1] * len(seqs), [True] * len(seqs))
        return self._launch(batch, after=in_flight)

    def _launch(self, batch: ScheduledBatch, after: LaunchedStep | None = None) -> LaunchedStep:
        try:
            return self.runner.launch(batch, after=after, done=0 if after is None else 1)
        except Exception as exc:  # a failed step fails its requests, not the engine
            self._fail_batch(batch, exc)
            if after is not None:
                self._fail_batch(after.batch, exc)
            raise

    def _complete(self, launched: LaunchedStep) -> None:
        """Wait for a launched step, then record and deliver its tokens."""
        try:
            result = self.runner.collect(launched)
            self._emit(launched.batch, result.token_ids, result.logprobs, time.perf_counter())
        except Exception as exc:
            self._fail_batch(launched.batch, exc)
            raise

    def _fail_batch(self, batch: ScheduledBatch, exc: Exception) -> None:
        for seq in batch.seqs:
            self._finish(seq, "error", error=EngineError(f"step failed: {exc!r}"))

    def _advance(self, batch: ScheduledBatch) -> None:
        """The batch's tokens are in the cache (for the requests still running)."""
        for seq, n in zip(batch.seqs, batch.query_lens):
            if seq.status is Status.RUNNING:
                seq.advance(n)

    def _expire_waiting(self, now: float) -> None:
        timeout = self.config.pending_timeout
        if timeout is None:
            return
        for seq in list(self.scheduler.waiting):
            waited = now - seq.submitted_at
            if waited > timeout:
                self._finish(seq, "error", error=QueueTimeout(waited))

    def _emit(self, batch: ScheduledBatch, token_ids: list[int], logprobs, now: float) -> None:
        sampled = [seq for seq, s in zip(batch.seqs, batch.sampled) if s]
        for seq, token_id, logprob in zip(sampled, token_ids, logprobs):
            if seq.status is Status.FINISHED:  # ended while its step was in flight
                continue
            if not seq.output_ids:
                seq.first_token_at = now
            seq.output_ids.append(token_id)
            event = TokenEvent(seq.request_id, [token_id])
            if logprob is not None:
                event.logprobs = [logprob]
            stop: str | int | None = None
            if seq.decoder is not None:
                step = seq.decoder.push(token_id)
                event.reasoning, event.content = step.reasoning, step.content
                seq.reasoning_tokens = seq.decoder.reasoning_tokens
                if step.stopped:
                    stop = step.stop
            elif token_id in seq.stop_token_ids:
                stop = token_id
            if stop is not None:
                self._finish(seq, "stop", stop_reason=stop, event=event)
            elif len(seq.output_ids) >= seq.max_tokens:
                self._finish(seq, "length", event=event)
            else:
                self._deliver(seq, event)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        stop_reason: str | int | None = None,
        event: TokenEvent | None = None,
        error: Exception | None = None,
    ) -> None:
        """Release everything `seq` holds and send its last event."""
        if seq.status is Status.FINISHED:
            return
        self.scheduler.release(seq)
        del self.sequences[seq.request_id]
        seq.finished_at = time.perf_counter()
        seq.finish_reason = reason
        event = event or TokenEvent(seq.request_id)
        if seq.decoder is not None and reason != "stop":
            tail = seq.decoder.finish()
            event.reasoning += tail.reasoning
            event.content += tail.content
        event.finish_reason = reason
        event.stop_reason = stop_reason
        event.error = error
        event.usage = Usage(
            prompt_tokens=seq.prompt_len,
            completion_tokens=len(seq.output_ids),
            reasoning_tokens=seq.reasoning_tokens,
            cached_tokens=seq.cached_tokens,
        )
        event.timings = seq.timings()
        self._deliver(seq, event)

    @staticmethod
    def _deliver(seq: Sequence, event: TokenEvent) -> None:
        """A failing consumer must not disturb the other requests of the step."""
        try:
            seq.sink(event)
        except Exception:
            log.exception("event consumer of %s failed", seq.request_id)

    def fail_all(self, error: Exception) -> None:
        """End every live request with `error` (engine shutdown or a fatal failure)."""
        for seq in list(self.sequences.values()):
            self._finish(seq, "error", error=error)
        self._in_flight = None  # nothing is left to read back

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        live = {s.request_id for s in self.scheduler.running} | {
            s.request_id for s in self.scheduler.waiting
        }
        assert live == set(self.sequences), "a sequence is tracked but not scheduled"


def cache_device(cache: ModelCache) -> torch.device:
    tensors = cache.k or cache.gdn_state
    return tensors[0].device

"""The public engine: `Engine` (a thread that owns the model and steps `EngineCore`, fed through
a queue), `RequestHandle` (a request's event stream) and `AsyncEngine` (the same for asyncio).

Callers on any thread submit; only the engine thread touches the model, the pools and the
scheduler. Limits are checked in the caller's thread, so `submit` raises `QueueFull`,
`ContextLengthExceeded` or `InvalidRequestError` at once.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ninfer.engine.config import EngineConfig
from ninfer.engine.core import EngineCore, EventSink
from ninfer.engine.kv_pool import PAGE_SIZE, ModelCache
from ninfer.engine.request import (
    FinishReason,
    GenerationRequest,
    SamplingParams,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from ninfer.errors import (
    ArtifactError,
    ConfigError,
    EngineClosed,
    EngineError,
    InvalidRequestError,
    NinferError,
    QueueFull,
)

if TYPE_CHECKING:
    from ninfer.chat.frontend import ChatFrontend
    from ninfer.chat.tokenizer import Tokenizer

log = logging.getLogger("ninfer.engine")

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
# Steps failing in a row before every live request is ended with the error (a failed step ends
# its own batch's requests; one that fails again has not run a batch, so nothing else would).
STEP_FAILURES_TO_END_ALL = 2


def shipped_model_path() -> Path:
    """The demo model shipped in ninfer/assets/ (used when no model is given)."""
    found = sorted(ASSETS_DIR.glob("*.ninfer")) if ASSETS_DIR.is_dir() else []
    if not found:
        raise NinferError(
            f"no model given and no shipped model in {ASSETS_DIR}; pass a .ninfer file"
        )
    return found[0]


@dataclass(slots=True)
class Completion:
    """A finished request, all events folded together."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def text(self) -> str:
        return self.content

    def add(self, event: TokenEvent) -> None:
        self.token_ids += event.token_ids
        self.content += event.content
        self.reasoning += event.reasoning
        if event.logprobs is not None:
            self.logprobs = (self.logprobs or []) + event.logprobs
        if event.finished:
            self.finish_reason = event.finish_reason
            self.stop_reason = event.stop_reason
            self.usage = event.usage
            self.timings = event.timings


class RequestHandle:
    """Iterate for the request's `TokenEvent`s (the last one has `finish_reason`); a failed
    request raises its typed error from the iteration. `abort()` cancels at the next step, and
    so does leaving the iteration early."""

    def __init__(self, engine: Engine, request_id: str) -> None:
        self._engine = engine
        self.request_id = request_id
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.finished = False
        self._completion = Completion(self.request_id)  # every event consumed so far, folded
        self._error: BaseException | None = None

    def _put(self, event: TokenEvent) -> None:
        self._events.put(event)

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._error is not None:  # the request failed: so does every later look at it
            raise self._error
        try:
            while not self.finished:
                event = self._events.get()
                self._completion.add(event)
                if event.finished:
                    self.finished = True
                    if event.error is not None:
                        self._error = event.error
                        raise event.error
                yield event
        finally:  # left early (`break`, an exception in the loop body): the request stops
            self.abort()

    def abort(self) -> None:
        if not self.finished:  # this submission, not a later one under the same id
            self._engine._abort(self.request_id, self)

    def result(self) -> Completion:
        """Wait for the end and return everything generated, the events already iterated
        included (again on later calls; the handle has one consumer at a time)."""
        for _ in self:
            pass
        return self._completion


# Engines not closed by their owner are closed at interpreter exit: a daemon engine thread
# still inside a step while the interpreter tears down aborted the process.
_OPEN_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_OPEN_ENGINES):
        engine.close()


class Engine:
    """Generates tokens for many requests at once on one device.

    `Engine(path, config)` loads a `.ninfer` artifact (the shipped model when `path` is None);
    keyword arguments override fields of `config`. Use as a context manager, or `close()`.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> None:
        config = _with_overrides(config, overrides)
        path = Path(model) if model is not None else shipped_model_path()
        core = load_core(path, config)
        self._start(core)

    @classmethod
    def from_model(
        cls,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        *,
        frontend: Any = None,
        eos_token_ids: Sequence[int] = (),
        **overrides: Any,
    ) -> Engine:
        """An engine over an already loaded model (`ninfer.models.registry.load_model`)."""
        config = _with_overrides(config, overrides)
        engine = cls.__new__(cls)
        engine._start(build_core(model, config, frontend=frontend, eos_token_ids=eos_token_ids))
        return engine

    def _start(self, core: EngineCore) -> None:
        self.core = core
        self.config = core.config
        self.frontend = core.frontend
        self._worker = _EngineThread(core)
        _OPEN_ENGINES.add(self)

    # ---- public API ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The chat layer's tokenizer (None for an artifact without one)."""
        return None if self.frontend is None else self.frontend.tokenizer

    def submit(self, request: GenerationRequest, sink: EventSink | None = None) -> RequestHandle:
        """Queue a request. Events go to the returned handle, or to `sink` (called on the
        engine thread; it must not block) when given."""
        self.core.validate(request)
        handle = RequestHandle(self, request.request_id)
        deliver = handle._put if sink is None else sink
        limit = self.config.max_concurrency + self.config.max_pending_requests
        worker = self._worker
        with worker.lock:
            if worker.closed:
                raise EngineClosed("the engine is closed")
            if worker.live >= limit:
                raise QueueFull(self.config.max_pending_requests)
            worker.live += 1
            # queued under the lock: a `close` racing this call queues its command after
            # this one, so the engine thread ends this request too
            submitted = time.perf_counter()  # the queue time counts from here
            worker.inbox.put(("add", (request, worker.counted(deliver), submitted, handle)))
        return handle

    def abort(self, request_id: str) -> None:
        """Cancel the request running or queued under `request_id` at the next step (nothing
        if none is). A request submitted again under the same id right after starts once the
        aborted one has ended."""
        self._abort(request_id, None)

    def _abort(self, request_id: str, handle: RequestHandle | None) -> None:
        """Abort `request_id`, or only the submission `handle` made (a handle's abort)."""
        self._worker.inbox.put(("abort", (request_id, handle)))

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | None = None,
    ) -> Completion | list[Completion]:
        """Complete one prompt (text or token ids) or a list of them, run together (more than
        the queue holds are fed in as earlier ones finish). Text is tokenized as is, with no
        chat template, and the completion is the text as generated (no reasoning split, no
        whitespace trimmed); see `chat` for conversations."""
        if not isinstance(prompts, (str, list, tuple)):
            raise InvalidRequestError(
                f"prompts must be text, token ids or a list of them, got {type(prompts).__name__}"
            )
        single = isinstance(prompts, str) or all(isinstance(t, int) for t in prompts)
        batch = [prompts] if single else list(prompts)
        handles: list[RequestHandle] = []
        results: dict[int, Completion] = {}
        try:
            for prompt in batch:
                request = GenerationRequest(
                    self._ids(prompt), params or SamplingParams(), split_reasoning=False
                )
                while True:
                    try:
                        handles.append(self.submit(request))
                        break
                    except QueueFull:
                        waiting = [i for i in range(len(handles)) if i not in results]
                        if not waiting:  # the queue is full of other callers' requests
                            raise
                        results[waiting[0]] = handles[waiting[0]].result()
            for i, handle in enumerate(handles):
                if i not in results:
                    results[i] = handle.result()
        except BaseException:
            for handle in handles:  # a failed batch leaves none of its requests running
                handle.abort()
            raise
        completions = [results[i] for i in range(len(handles))]
        return completions[0] if single else completions

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ) -> Completion:
        """Render `messages` with the model's chat template and complete them: `content` is
        the answer, `reasoning` the thinking text."""
        return self.submit(
            self.chat_request(messages, params, tools, enable_thinking, reasoning_effort)
        ).result()

    def chat_request(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        tools: list[dict[str, Any]] | None = None,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ) -> GenerationRequest:
        """The `GenerationRequest` for a conversation (template, thinking mode, presets)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError("messages must be a list of message dicts", "messages")
        if self.frontend is None:
            raise NinferError("the model has no tokenizer; send token ids instead")
        prompt = self.frontend.render(
            messages,
            tools=tools,
            enable_thinking=enable_thinking,
            reasoning_effort=reasoning_effort,
        )
        return GenerationRequest(
            prompt.token_ids,
            params or self.default_params(prompt.enable_thinking),
            starts_in_reasoning=prompt.starts_in_reasoning,
        )

    def default_params(self, thinking: bool = True) -> SamplingParams:
        """The model's sampling preset for the thinking mode (neutral without one)."""
        if self.frontend is None:
            return SamplingParams()
        from ninfer.chat.presets import resolve_sampling

        preset = resolve_sampling(self.frontend.sampling_preset(thinking))
        return SamplingParams(
            temperature=preset.temperature,
            top_p=preset.top_p,
            top_k=preset.top_k,
            min_p=preset.min_p,
            presence_penalty=preset.presence_penalty,
            frequency_penalty=preset.frequency_penalty,
            seed=preset.seed,
        )

    def close(self) -> None:
        """Stop the engine thread; requests still running end with `EngineClosed`."""
        self._worker.close()

    def __del__(self) -> None:
        worker = getattr(self, "_worker", None)  # None: the constructor failed
        if worker is not None:
            worker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------

    def _ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise NinferError("the model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"a prompt must be text or token ids, got {type(prompt).__name__}", "prompts"
            )
        return list(prompt)


class _EngineThread:
    """An engine's thread and what it shares with the engine's callers: the inbox of commands,
    the requests waiting for an aborted id, the count of live requests and the closed flag.
    It holds no reference to the `Engine` in front of it, so an engine dropped without
    `close()` is collected, and closes its thread then (`Engine.__del__`); the thread, the
    model and the pools no longer outlive it until the interpreter exits."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # adds whose id an aborted request still holds (`add`), retried after each step
        self.deferred: list[tuple[GenerationRequest, EventSink, float, object]] = []
        self.lock = threading.Lock()
        self.live = 0
        self.closed = False
        self.thread = threading.Thread(target=self.run, name="ninfer-engine", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.inbox.put(("close", None))
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def counted(self, deliver: EventSink) -> EventSink:
        def sink(event: TokenEvent) -> None:
            if event.finished:
                with self.lock:
                    self.live -= 1
            deliver(event)

        return sink

    def run(self) -> None:
        core = self.core
        failures = 0  # steps failed in a row
        try:
            while True:
                command = self.inbox.get() if not core.has_work else self.poll()
                while command is not None:
                    if not self.take(command):
                        return
                    # no command stays referenced while the thread waits: it would hold its
                    # request's handle, and through it the engine
                    command = self.poll()
                try:
                    core.step()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    log.exception("engine step failed; its requests were ended with an error")
                    if failures >= STEP_FAILURES_TO_END_ALL:
                        # a failure the step could not pin on a batch would recur forever
                        # with its requests waiting: they are ended instead
                        log.error("%d engine steps failed in a row: ending every request", failures)
                        core.fail_all(EngineError(f"the engine step failed: {exc!r}"))
                        failures = 0
                self.add_deferred()
        except BaseException as exc:  # a bug in the loop itself: fail everything, refuse more
            log.exception("engine thread died")
            with self.lock:
                self.closed = True
            error = EngineClosed(f"the engine thread died: {exc!r}")
            core.fail_all(error)
            self.end_queued(error)
            raise

    def take(self, command: tuple[str, Any]) -> bool:
        """Carry out one command; False for `close` (the thread then ends)."""
        kind, payload = command
        if kind == "close":
            closed = EngineClosed("the engine was closed")
            self.core.fail_all(closed)
            self.end_queued(closed)
            self.core.runner.close()
            return False
        if kind == "add":
            self.add(*payload)
        elif kind == "abort":
            self.abort_now(*payload)
        return True

    def end_queued(self, error: Exception) -> None:
        """End the requests still in the inbox, or waiting for an aborted request's id (the
        engine takes no more: `closed` is set)."""
        pending, self.deferred = self.deferred, []
        while (command := self.poll()) is not None:
            if command[0] == "add":
                pending.append(command[1])
        for request, sink, *_ in pending:
            sink(TokenEvent(request.request_id, finish_reason="error", error=error))

    def poll(self) -> tuple[str, Any] | None:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def add(
        self, request: GenerationRequest, sink: EventSink, submitted_at: float, owner: object
    ) -> None:
        running = self.core.sequences.get(request.request_id)
        if self.deferred or (running is not None and running.abort_requested):
            # its id is taken until the aborted request ends, at the next step (and what
            # came after a deferred request waits behind it, so admission keeps their order)
            self.deferred.append((request, sink, submitted_at, owner))
            return
        try:
            self.core.add(request, sink, submitted_at, owner)
        except NinferError as exc:  # e.g. a duplicate request id
            sink(TokenEvent(request.request_id, finish_reason="error", error=exc))

    def add_deferred(self) -> None:
        """Add the requests that waited for an aborted request's id, in the order given."""
        deferred, self.deferred = self.deferred, []
        for index, payload in enumerate(deferred):
            try:
                self.add(*payload)
            except BaseException:  # the loop dies: `end_queued` ends this one and the rest
                self.deferred.extend(deferred[index:])
                raise

    def abort_now(self, request_id: str, owner: RequestHandle | None) -> None:
        """Mark the running request for abort, and end at once a deferred one it names."""
        self.core.abort(request_id, owner)
        kept = []
        for payload in self.deferred:
            request, sink, _, submitter = payload
            if request.request_id == request_id and owner in (None, submitter):
                sink(TokenEvent(request_id, finish_reason="abort"))
            else:
                kept.append(payload)
        self.deferred = kept


class AsyncRequestStream:
    """Async iterator over one request's events; cancels the request when the consumer stops
    early (a closed client connection, a cancelled task)."""

    def __init__(self, engine: Engine, request: GenerationRequest) -> None:
        loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            try:
                loop.call_soon_threadsafe(self._events.put_nowait, event)
            except RuntimeError:  # the loop is closed; nobody is listening any more
                pass

        self.request_id = request.request_id
        self._engine = engine
        self._handle = engine.submit(request, sink=sink)
        self.finished = False

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenEvent]:
        try:
            while not self.finished:
                event = await self._events.get()
                if event.finished:
                    self.finished = True
                    if event.error is not None:
                        raise event.error
                yield event
        finally:
            self.abort()

    def abort(self) -> None:
        if not self.finished:  # this submission, not a later one under the same id
            self._engine._abort(self.request_id, self._handle)

    async def result(self) -> Completion:
        completion = Completion(self.request_id)
        async for event in self:
            completion.add(event)
        return completion


class AsyncEngine:
    """asyncio front of an `Engine`: `async for event in engine.generate(request)`.

    `submit` raises the typed admission errors at once; `generate` raises them at the first
    iteration. Leaving the loop early cancels the request.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        config: EngineConfig | None = None,
        *,
        engine: Engine | None = None,
        **overrides: Any,
    ) -> None:
        self.engine = engine if engine is not None else Engine(model, config, **overrides)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def frontend(self) -> ChatFrontend | None:
        return self.engine.frontend

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def chat_request(
        self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any
    ) -> GenerationRequest:
        """See `Engine.chat_request`."""
        return self.engine.chat_request(messages, *args, **kwargs)

    def default_params(self, thinking: bool = True) -> SamplingParams:
        return self.engine.default_params(thinking)

    def submit(self, request: GenerationRequest) -> AsyncRequestStream:
        """Queue `request` (from inside a running event loop) and return its event stream."""
        return AsyncRequestStream(self.engine, request)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        async for event in self.submit(request):
            yield event

    async def complete(self, request: GenerationRequest) -> Completion:
        return await self.submit(request).result()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def close(self) -> None:
        self.engine.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# ---- loading -------------------------------------------------------------------------------


def _with_overrides(config: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    if config is None:
        return EngineConfig(**overrides)
    if not overrides:
        return config
    return replace(config, **overrides)


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    return device_and_dtype(config.device, config.dtype)


DTYPES = ("bfloat16", "float16", "float32")


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a command asked for (None: cuda when present, else cpu; bfloat16
    on cuda, float32 on cpu), or a ConfigError naming what is wrong with them."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except (RuntimeError, ValueError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: give cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for but no CUDA device is available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name}: there are {torch.cuda.device_count()} CUDA devices")
    dtype = dtype or ("bfloat16" if resolved.type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r}: give {', '.join(DTYPES)}")
    return resolved, getattr(torch, dtype)


def load_core(path: Path, config: EngineConfig) -> EngineCore:
    """Open the artifact, load the model, its tokenizer and chat template, size the pools."""
    from ninfer.artifact import Artifact
    from ninfer.models.registry import load_model

    if not path.is_file():
        raise NinferError(f"model file not found: {path}")
    if config.tensor_parallel > 1:
        from ninfer.parallel.launch import load_parallel_core

        return load_parallel_core(path, config)
    device, dtype = resolve_device(config)
    artifact = Artifact.open(path)
    model = load_model(artifact, artifact.config(), device=device, dtype=dtype)
    frontend, eos = load_frontend(artifact)
    return build_core(model, config, frontend=frontend, eos_token_ids=eos)


def load_frontend(artifact: Any) -> tuple[Any, tuple[int, ...]]:
    """The artifact's chat frontend (None without a tokenizer) and its stop token ids."""
    frontend = None
    if artifact.resource("tokenizer") is not None:
        from ninfer.chat.frontend import ChatFrontend

        try:
            frontend = ChatFrontend.from_artifact(artifact)
        except NinferError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception for a bad tokenizer.json
            raise ArtifactError(
                f"the model's tokenizer files cannot be read: {type(exc).__name__}: {exc}"
            ) from None
    eos = frontend.stop_token_ids if frontend is not None else artifact_eos_ids(artifact)
    return frontend, tuple(eos)


def artifact_eos_ids(artifact: Any) -> tuple[int, ...]:
    """Stop ids of an artifact without a tokenizer: generation_config, else config.json."""
    raw = artifact.resource("generation_config")
    value = json.loads(raw).get("eos_token_id") if raw else None
    if value is None:
        config = artifact.config()
        value = config.get("eos_token_id", (config.get("text_config") or {}).get("eos_token_id"))
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def build_core(
    model: torch.nn.Module,
    config: EngineConfig,
    *,
    frontend: Any = None,
    eos_token_ids: Sequence[int] = (),
    num_pages: int | None = None,
) -> EngineCore:
    """The core over a loaded model; `num_pages` (default: `pool_pages`) sizes the K/V pool."""
    from ninfer.engine.graphs import capture_sizes

    spec = model.cache_spec()
    device, dtype = model.device, model.dtype
    graphs = uses_cuda_graphs(config, model)
    if num_pages is None:
        reserve = cache_reserve_bytes(config, model, graphs)
        num_pages = pool_pages(config, spec.page_bytes(dtype), device, reserve_bytes=reserve)
    cache = model_cache(config, model, num_pages, graphs)
    log.info("KV pool: %d pages of %d tokens", num_pages, PAGE_SIZE)
    core = EngineCore(
        model,
        cache,
        config,
        vocab_size=model.config.vocab_size,
        eos_token_ids=eos_token_ids,
        frontend=frontend,
    )
    if device.type == "cuda":
        warm_up_kernels(model)
    if graphs:
        core.runner.capture_graphs(config.max_context, capture_sizes(config.max_concurrency))
    return core


def warm_up_kernels(model: torch.nn.Module) -> list[tuple[int, int, int, int]]:
    """Pay the GDN prefill kernels' one-time autotuning for each of the model's head shapes
    (key heads, value heads, dk, dv) now rather than in the first request; returns the shapes
    warmed (none where the prefill does not run fla's kernels, e.g. on CPU)."""
    from ninfer.kernels.dispatch import warm_up_chunk_gated_delta_rule
    from ninfer.models.layers.gated_deltanet import GatedDeltaNet

    shapes = {
        (m.num_key_heads, m.num_value_heads, m.key_head_dim, m.value_head_dim)
        for m in model.modules()
        if isinstance(m, GatedDeltaNet)
    }
    return [
        shape
        for shape in sorted(shapes)
        if warm_up_chunk_gated_delta_rule(*shape, model.dtype, model.device)
    ]


def uses_cuda_graphs(config: EngineConfig, model: torch.nn.Module) -> bool:
    """Decode runs from CUDA graphs when asked, on CUDA in half precision (with tensor
    parallelism on every rank, the model's collectives captured with it)."""
    from ninfer.engine.graphs import GRAPH_DTYPES

    return config.cuda_graph and model.device.type == "cuda" and model.dtype in GRAPH_DTYPES


def model_cache(
    config: EngineConfig, model: torch.nn.Module, num_pages: int, graphs: bool
) -> ModelCache:
    """The model's K/V pages and a state slot per lane (a scratch page and slot with graphs).
    A `ConfigError` that names the sizes, rather than the allocator's error (or, on a host
    that overcommits, the kernel's OOM killer), where they do not fit in memory."""
    spec = model.cache_spec()
    state_dtype = getattr(torch, config.gdn_state_dtype)
    kv_bytes, slot_bytes = cache_bytes(config, model, num_pages, graphs)
    if model.device.type == "cpu":
        check_host_cache(num_pages, kv_bytes, slot_bytes, host_available_bytes())
    try:
        return ModelCache(
            spec,
            num_pages,
            config.max_concurrency,
            device=model.device,
            dtype=model.dtype,
            state_dtype=state_dtype,
            scratch=graphs,
        )
    except RuntimeError as error:  # torch.OutOfMemoryError, or the CPU allocator's message
        if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error):
            raise
        raise ConfigError(_cache_too_big(num_pages, kv_bytes, slot_bytes, None, "memory")) from None


def cache_bytes(
    config: EngineConfig, model: torch.nn.Module, num_pages: int, graphs: bool
) -> tuple[int, int]:
    """(K/V pool bytes, state slot bytes) that `model_cache` allocates for `num_pages` pages
    (a scratch page and slot more with graphs)."""
    spec = model.cache_spec()
    state_dtype = getattr(torch, config.gdn_state_dtype)
    extra = 1 if graphs else 0
    kv_bytes = (num_pages + extra) * spec.page_bytes(model.dtype)
    slot_bytes = (config.max_concurrency + extra) * spec.slot_bytes(model.dtype, state_dtype)
    return kv_bytes, slot_bytes


def check_host_cache(
    num_pages: int, kv_bytes: int, slot_bytes: int, available: int | None, ranks: int = 1
) -> None:
    """A `ConfigError` naming the sizes where `ranks` processes on this host, each allocating
    that K/V pool and those state slots, would not fit in `available` bytes (None: unknown,
    no check)."""
    if available is not None and ranks * (kv_bytes + slot_bytes) > available:
        raise ConfigError(
            _cache_too_big(num_pages, kv_bytes, slot_bytes, available, "free memory", ranks)
        )


def _cache_too_big(
    num_pages: int,
    kv_bytes: int,
    slot_bytes: int,
    available: int | None,
    where: str,
    ranks: int = 1,
) -> str:
    have = f"the {available / 2**30:.1f} GiB of {where}" if available is not None else where
    whose = ""
    if ranks > 1:
        together = ranks * (kv_bytes + slot_bytes)
        whose = f" of each of the {ranks} ranks on this host ({together / 2**30:.1f} GiB together)"
    return (
        f"the K/V pool of {num_pages * PAGE_SIZE} tokens ({kv_bytes / 2**30:.1f} GiB) and the "
        f"state slots ({slot_bytes / 2**30:.1f} GiB){whose} do not fit in {have}; lower "
        "max_context, kv_capacity or max_concurrency"
    )


MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: a container's memory.max and memory.current


def host_available_bytes() -> int | None:
    """The memory this process may still take (Linux): the kernel's MemAvailable, or less
    where the process's cgroup (a container) caps it; None where neither can be read."""
    available = None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((CGROUP / "memory.current").read_text())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def cache_reserve_bytes(config: EngineConfig, model: torch.nn.Module, graphs: bool) -> int:
    """What to set aside before an `auto` K/V pool is sized: the state slots (one per lane,
    plus the graphs' scratch slot) and, with graphs, their memory pool."""
    _, slot_bytes = cache_bytes(config, model, 0, graphs)
    return slot_bytes + (graph_reserve_bytes(config, model) if graphs else 0)


def graph_reserve_bytes(config: EngineConfig, model: torch.nn.Module) -> int:
    """What the decode graphs' memory pool may take, set aside before the K/V pool is sized."""
    from ninfer.engine.graphs import graph_memory_bytes
    from ninfer.models.layers.moe import GroupwiseExperts

    encoded = any(isinstance(m, GroupwiseExperts) for m in model.modules())
    return graph_memory_bytes(
        model.config, config.max_concurrency, config.max_context, encoded_experts=encoded
    )


def pool_pages(
    config: EngineConfig, page_bytes: int, device: torch.device, reserve_bytes: int = 0
) -> int:
    """Pages of the shared K/V pool: `kv_capacity` tokens rounded up to pages, or for `auto`
    the most that fit in free device memory after a headroom and `reserve_bytes` (the state
    slots and the CUDA graphs' pool, `cache_reserve_bytes`); never more than every lane at
    `max_context` could use."""
    per_request = -(-config.max_context // PAGE_SIZE)
    most_useful = per_request * config.max_concurrency
    if config.kv_capacity != "auto":
        return min(-(-config.kv_capacity // PAGE_SIZE), most_useful)
    if device.type != "cuda" or page_bytes == 0:
        return most_useful
    free, _ = torch.cuda.mem_get_info(device)
    fit = (free - config.kv_headroom_bytes - reserve_bytes) // page_bytes
    if fit < per_request:
        raise ConfigError(
            f"only {max(fit, 0) * PAGE_SIZE} tokens of K/V fit in free GPU memory next to "
            f"{reserve_bytes / 2**30:.1f} GiB of state slots and graph pool; one request of "
            f"max_context {config.max_context} needs {per_request * PAGE_SIZE} (fewer lanes or "
            "a bf16 GDN state leave more)"
        )
    return min(fit, most_useful)

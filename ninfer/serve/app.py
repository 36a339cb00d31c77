"""The FastAPI application: routes, the auth/CORS gate, body limits, and the request lifecycle
(prepare -> wait for the first output -> JSON body or SSE), with logging, metrics and abort on
client disconnect. Protocol details live in the adapter modules."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ninfer.serve import anthropic, openai_chat, responses
from ninfer.serve.auth import OPEN_PATHS, authorized
from ninfer.serve.errors import (
    PROMPT_PARAMS,
    ApiError,
    bad_json,
    cancel_not_supported,
    client_disconnected,
    compaction_not_supported,
    invalid_api_key,
    model_not_found,
    request_too_large,
    response_not_found,
    route_error,
    to_api_error,
)
from ninfer.serve.metrics import CONTENT_TYPE, Metrics
from ninfer.serve.output import Completion, TextDelta
from ninfer.serve.request import ChatRequest, ModelInfo
from ninfer.serve.request_log import RequestLog
from ninfer.serve.response_store import ResponseStore
from ninfer.serve.service import Generation, GenerationService

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CORS_HEADERS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-allow-headers", b"Authorization, Content-Type, x-api-key"),
    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
]
# How long a browser may reuse a preflight's answer, in seconds.
CORS_MAX_AGE = b"600"


def preflight_headers(scope: dict) -> list[tuple[bytes, bytes]]:
    """A preflight's answer allows the headers it asks for: the SDKs' browser builds send
    their own (`x-stainless-*`, `anthropic-version`, ...), and a browser blocks a request any
    of whose headers the answer leaves out."""
    asked = dict(scope["headers"]).get(b"access-control-request-headers")
    headers = [*CORS_HEADERS, (b"access-control-max-age", CORS_MAX_AGE)]
    if asked:
        headers[1] = (b"access-control-allow-headers", asked)
    return headers


@dataclass(slots=True)
class ServerState:
    service: GenerationService
    info: ModelInfo
    store: ResponseStore = field(default_factory=ResponseStore)
    log: RequestLog = field(default_factory=lambda: RequestLog(None))
    metrics: Metrics | None = None
    api_key: str | None = None
    cors: bool = False
    max_request_bytes: int = 384 << 20

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = Metrics(self.info.model_id)


def error_response(err: ApiError, path: str) -> JSONResponse:
    return JSONResponse(err.body_for(path), status_code=err.status)


class Gate:
    """ASGI middleware in front of every route: CORS preflight and headers, then the API key.
    Pure ASGI (not BaseHTTPMiddleware) so streaming and disconnect signals pass untouched."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cors = self.state.cors
        if cors and scope["method"] == "OPTIONS":
            start = {"type": "http.response.start", "status": 204}
            await send({**start, "headers": preflight_headers(scope)})
            await send({"type": "http.response.body", "body": b""})
            return
        send_out = send
        if cors:

            async def send_out(message: dict) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *CORS_HEADERS]}
                await send(message)

        path = scope["path"]
        if path not in OPEN_PATHS:
            headers = {
                k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
            }
            if not authorized(self.state.api_key, headers):
                response = error_response(invalid_api_key(), path)
                await response(scope, receive, send_out)
                return
        await self.app(scope, receive, send_out)


def allowed_methods(app: FastAPI, scope: dict) -> list[str]:
    """The methods of the routes whose path matches the request's (Starlette's own 405 names
    those of the first such route only: `/v1/responses/{id}` has a GET and a DELETE)."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


# json.loads turns an unpaired "\ud800" escape into a string that is not Unicode text, which
# the tokenizer then refuses deep inside a request; strict JSON parsers reject it up front.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _structure_fault(value: Any, max_depth: int, strings: bool) -> str | None:
    """What makes a decoded body unfit, found level by level (a few list comprehensions per
    level: a 3.4 MB body of 100k messages takes about 0.1 s here): arrays and objects nested
    deeper than `max_depth`, or (with `strings`) a string holding half a surrogate pair."""
    level, depth = [value], 0
    while level:
        if strings:
            for item in level:
                if isinstance(item, str):
                    try:
                        item.encode("utf-8")
                    except UnicodeEncodeError:
                        return "a \\u escape is half of a surrogate pair"
        containers = [item for item in level if isinstance(item, (dict, list))]
        if not containers:
            return None
        depth += 1
        if depth > max_depth:
            return f"nested more than {max_depth} deep"
        level = [
            child
            for item in containers
            for child in (
                ([*item, *item.values()] if strings else item.values())
                if type(item) is dict
                else item
            )
        ]
    return None


T = TypeVar("T")

# Bodies larger than this are decoded, and their fields parsed, in a worker thread: a
# conversation of megabytes took a fraction of a second of the event loop there, during which
# every other stream waited. Smaller ones, nearly all requests, skip the thread's hand-over.
OFF_LOOP_BYTES = 64 * 1024


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON (decoded in a worker thread past `OFF_LOOP_BYTES`)."""
    return await parse_json(request, limit, lambda body: body)


async def parse_json(request: Request, limit: int, parse: Callable[[Any], T]) -> T:
    """`parse` of the body as JSON; past `OFF_LOOP_BYTES` the decoding and `parse` run in a
    worker thread (so `parse` must not touch state the event loop changes)."""
    raw = await read_body(request, limit)
    if len(raw) <= OFF_LOOP_BYTES:
        return parse(decode_json(raw))
    return await asyncio.to_thread(lambda: parse(decode_json(raw)))


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; the size limit is enforced as they arrive (and before reading any of
    a body whose Content-Length already says it is too large)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise request_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise request_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# Deepest nesting of arrays and objects a body may have. The decoder's own limit is Python's
# recursion limit less the frames already on the stack, which differ between the event loop
# and a worker thread (`OFF_LOOP_BYTES`); code that recurses over a request later (a template's
# tojson, the response store's dumps on the loop) needs a margin below it either way.
MAX_JSON_DEPTH = 512


def decode_json(raw: bytes) -> Any:
    """The JSON of a body, or the 400 saying why it is not JSON."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_json(str(exc)) from None
    except RecursionError:
        raise bad_json("nested too deeply") from None
    fault = _structure_fault(body, MAX_JSON_DEPTH, SURROGATE_ESCAPE.search(raw) is not None)
    if fault is not None:
        raise bad_json(fault)
    return body


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable) -> Any:
    """Await `work`; when the client leaves first, cancel it (which aborts the engine request)
    and raise the 499 error."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    done: set = set()
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise client_disconnected()
    return task.result()


class RequestTrace:
    """Log records and metrics of one request from `request_start` to its end."""

    def __init__(
        self, state: ServerState, generation: Generation, request: Request, request_id: int
    ) -> None:
        self.state = state
        self.generation = generation
        self.request_id = request_id
        self.started = time.perf_counter()
        self.prepare_s = 0.0
        self.closed = False
        chat = generation.request
        params = generation.engine_request.params
        state.log.request_start(
            self.request_id,
            protocol=chat.protocol,
            client=request.headers.get("user-agent"),
            stream=chat.stream,
            prompt_tokens=generation.prompt_tokens,
            max_tokens=params.max_tokens,
            max_tokens_defaulted=chat.max_tokens_defaulted,
            thinking=generation.prompt.enable_thinking,
            reasoning_effort=generation.prompt.reasoning_effort,
            preserve_thinking=chat.preserve_thinking,
            tools=len(chat.tools),
            tool_choice=chat.tool_choice,
            sampling={
                k: v
                for k, v in asdict(params).items()
                if k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                         "frequency_penalty", "seed")
            },
        )  # fmt: skip
        state.metrics.waiting.labels(state.info.model_id).inc()
        self._stage = "waiting"

    def first_output(self) -> None:
        if self._stage == "waiting":
            m = self.state.metrics
            m.waiting.labels(self.state.info.model_id).dec()
            m.running.labels(self.state.info.model_id).inc()
            self._stage = "running"

    def _leave(self) -> None:
        m = self.state.metrics
        gauge = m.waiting if self._stage == "waiting" else m.running
        gauge.labels(self.state.info.model_id).dec()
        self._stage = "done"
        self.closed = True

    def complete(self, completion: Completion) -> None:
        if self.closed:
            return
        self._leave()
        self.state.log.request_done(
            self.request_id,
            finish_reason=completion.finish_reason,
            usage=completion.usage,
            timings=completion.timings,
            prepare_s=self.prepare_s,
        )
        self.state.metrics.finished(completion.finish_reason, completion.usage, completion.timings)

    def fail(self, err: ApiError) -> None:
        if self.closed:
            return
        self._leave()
        self.state.log.request_error(self.request_id, err)
        self.state.metrics.rejected(err.status, err.code)


async def _prepend(first: TextDelta | Completion, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _collect(first: TextDelta | Completion, rest: AsyncIterator) -> Completion:
    item = first
    while not isinstance(item, Completion):
        item = await anext(rest)
    await rest.aclose()
    return item


async def _traced_frames(trace: RequestTrace, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for frame in frames:
            yield frame
    finally:
        if not trace.closed:  # the client went away mid-stream
            trace.fail(client_disconnected())
        await frames.aclose()


def create_app(
    state: ServerState,
    *,
    background: Sequence[Callable[[], Awaitable]] = (),
    on_shutdown: Callable[[], Awaitable] | None = None,
) -> FastAPI:
    """The app. `background` coroutines run while it serves; `on_shutdown` runs at exit."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(make()) for make in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(
        title="ninfer", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.ninfer = state
    info = state.info

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        response = error_response(route_error(exc.status_code, message), request.url.path)
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Allow names every route's methods at this path
            response.headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)

    def rejected(err: ApiError, request: Request, protocol: str) -> JSONResponse:
        state.log.request_rejected(err, protocol=protocol)
        state.metrics.rejected(err.status, err.code)
        return error_response(err, request.url.path)

    async def generate(
        request: Request,
        chat: ChatRequest,
        *,
        body: Callable[[Completion], dict],
        sse: Callable[..., AsyncIterator[bytes]],
    ) -> Response:
        """The shared lifecycle. `sse(outputs, generation, on_complete, on_error)` renders the
        stream of one protocol; `body(completion)` its JSON answer."""
        started = time.perf_counter()
        request_id = state.log.next_id()
        engine_id = f"{chat.protocol}-{state.log.instance_id}-{request_id}"
        prompt_param = PROMPT_PARAMS.get(chat.protocol, "messages")
        try:
            # the template and the tokenizer off the event loop: a long conversation takes
            # seconds to render, and the other requests' streams would wait meanwhile
            prompt = await asyncio.to_thread(state.service.render, chat)
            generation = state.service.prepare(chat, engine_id, prompt)
        except Exception as exc:
            return rejected(to_api_error(exc, prompt_param), request, chat.protocol)
        trace = RequestTrace(state, generation, request, request_id)
        trace.prepare_s = time.perf_counter() - started
        outputs = state.service.outputs(generation)
        try:
            first = await unless_disconnected(request, anext(outputs))
            trace.first_output()
            if not chat.stream:
                completion = await unless_disconnected(request, _collect(first, outputs))
                answer = body(completion)
                trace.complete(completion)
                return JSONResponse(answer)
        except Exception as exc:
            err = to_api_error(exc, prompt_param)
            trace.fail(err)
            await outputs.aclose()
            return error_response(err, request.url.path)
        frames = sse(_prepend(first, outputs), generation, trace.complete, trace.fail)
        return StreamingResponse(
            _traced_frames(trace, frames), media_type="text/event-stream", headers=SSE_HEADERS
        )

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return openai_chat.model_list(info)

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> Response:
        if model_id != info.model_id:
            return error_response(model_not_found(model_id), request.url.path)
        return JSONResponse(openai_chat.model_card(info))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            chat = await parse_json(
                request,
                state.max_request_bytes,
                lambda body: openai_chat.parse_chat_request(body, info),
            )
        except ApiError as err:
            return rejected(err, request, "chat")
        completion_id = openai_chat.new_completion_id()
        created = int(time.time())

        def sse(outputs, generation, on_complete, on_error):
            return openai_chat.chat_sse(
                outputs,
                completion_id=completion_id,
                model=chat.model,
                include_usage=chat.include_usage,
                on_complete=on_complete,
                on_error=on_error,
            )

        return await generate(
            request,
            chat,
            body=lambda c: openai_chat.chat_completion_body(
                c, completion_id=completion_id, model=chat.model, created=created
            ),
            sse=sse,
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            chat = await parse_json(
                request,
                state.max_request_bytes,
                lambda body: anthropic.parse_messages_request(body, info),
            )
        except ApiError as err:
            return rejected(err, request, "anthropic")
        message_id = anthropic.new_message_id()

        def sse(outputs, generation, on_complete, on_error):
            return anthropic.messages_sse(
                outputs,
                message_id=message_id,
                model=chat.model,
                input_tokens=generation.prompt_tokens,
                on_complete=on_complete,
                on_error=on_error,
            )

        return await generate(
            request,
            chat,
            body=lambda c: anthropic.message_body(c, message_id=message_id, model=chat.model),
            sse=sse,
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:

            def parse(body: Any):
                if isinstance(body, dict) and "max_tokens" not in body:
                    body = {**body, "max_tokens": 1}
                return anthropic.parse_messages_request(body, info)

            chat = await parse_json(request, state.max_request_bytes, parse)
            count = await asyncio.to_thread(state.service.count_tokens, chat)
            return JSONResponse({"input_tokens": count})
        except ApiError as err:
            return rejected(err, request, "anthropic")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        try:
            # decoded off the loop when large; parsed on it, since it reads the response store
            call = responses.parse_responses_request(
                await read_json(request, state.max_request_bytes), info, state.store
            )
        except ApiError as err:
            return rejected(err, request, "responses")

        def body(completion: Completion) -> dict:
            answer = responses.finished_body(call, completion)
            responses.store_response(state.store, call, answer)
            return answer

        def sse(outputs, generation, on_complete, on_error):
            return responses.responses_sse(
                outputs, call, state.store, on_complete=on_complete, on_error=on_error
            )

        return await generate(request, call.chat, body=body, sse=sse)

    @app.post("/v1/responses/input_tokens")
    async def response_input_tokens(request: Request) -> Response:
        try:
            chat = await parse_json(
                request,
                state.max_request_bytes,
                lambda body: responses.parse_input_tokens_request(body, info),
            )
            count = await asyncio.to_thread(state.service.count_tokens, chat)
        except ApiError as err:
            return rejected(err, request, "responses")
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    @app.post("/v1/responses/compact")
    async def compact_response(request: Request) -> Response:
        return error_response(compaction_not_supported(), request.url.path)

    def stored_or_404(response_id: str):
        record = state.store.get(response_id)
        if record is None:
            raise response_not_found(
                f"response '{response_id}' was not found (never stored, deleted or evicted)"
            )
        return record

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        try:
            return JSONResponse(stored_or_404(response_id).response)
        except ApiError as err:
            return error_response(err, request.url.path)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> Response:
        if not state.store.delete(response_id):
            return error_response(
                response_not_found(f"response '{response_id}' was not found"), request.url.path
            )
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request) -> Response:
        try:
            record = stored_or_404(response_id)
            return JSONResponse(responses.input_items_page(record, dict(request.query_params)))
        except ApiError as err:
            return error_response(err, request.url.path)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        try:
            stored_or_404(response_id)
            raise cancel_not_supported()
        except ApiError as err:
            return error_response(err, request.url.path)

    app.add_middleware(Gate, state=state)
    return app

"""Builds and runs the server from `ServeSettings`: the engine, the generation service, the app,
uvicorn, and the periodic stats line."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from ninfer.chat.presets import SamplingFields
from ninfer.serve.settings import ServeSettings

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ninfer.engine.config import EngineConfig
    from ninfer.engine.engine import AsyncEngine
    from ninfer.serve.app import ServerState

log = logging.getLogger("ninfer.serve")


def engine_config(settings: ServeSettings) -> EngineConfig:
    from ninfer.engine.config import EngineConfig

    return EngineConfig(
        max_context=settings.max_context,
        max_concurrency=settings.max_concurrency,
        max_pending_requests=settings.max_pending_requests,
        pending_timeout=settings.pending_timeout_ms / 1000.0,
        kv_capacity=settings.kv_capacity,
        prefill_chunk=settings.prefill_chunk,
        idle_prefill_chunk=settings.idle_prefill_chunk,
        default_max_tokens=settings.default_max_tokens,
        device=settings.device,
        dtype=settings.dtype,
        gdn_state_dtype=settings.gdn_state_dtype,
        tensor_parallel=settings.tensor_parallel,
        expert_parallel=settings.expert_parallel,
        cuda_graph=not settings.no_cuda_graph,
        overlap=not settings.no_overlap,
    )


def build_state(
    settings: ServeSettings, engine: AsyncEngine, model_path: Path, argv: list[str]
) -> ServerState:
    """The app state over a started `AsyncEngine`."""
    from ninfer.errors import NinferError
    from ninfer.serve.app import ServerState
    from ninfer.serve.request import ModelInfo
    from ninfer.serve.request_log import RequestLog
    from ninfer.serve.response_store import ResponseStore
    from ninfer.serve.service import GenerationService

    frontend = engine.frontend
    if frontend is None or not frontend.has_template:
        raise NinferError(f"{model_path} has no tokenizer or chat template; it cannot be served")
    flags = SamplingFields(
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        presence_penalty=settings.presence_penalty,
        frequency_penalty=settings.frequency_penalty,
        seed=settings.seed,
    )
    service = GenerationService(
        engine,
        frontend,
        max_context=settings.max_context,
        sampling_flags=flags,
        greedy=settings.greedy,
    )
    info = ModelInfo(
        model_id=settings.model_id or model_path.stem,
        template=frontend.template(),
        default_max_tokens=settings.default_max_tokens,
        thinking_default=not settings.no_thinking,
        preserve_thinking_default=settings.preserve_thinking,
        created=int(model_path.stat().st_mtime),
    )
    request_log = RequestLog(settings.request_log_jsonl)
    state = ServerState(
        service=service,
        info=info,
        store=ResponseStore(
            settings.response_store_max_records, settings.response_store_max_mib << 20
        ),
        log=request_log,
        api_key=settings.resolved_api_key(),
        cors=settings.cors,
        max_request_bytes=settings.max_request_mib << 20,
    )
    config = engine.config
    request_log.server_start(
        argv,
        model=str(model_path),
        model_id=info.model_id,
        host=settings.host,
        port=settings.port,
        engine={
            "max_context": config.max_context,
            "max_concurrency": config.max_concurrency,
            "max_pending_requests": config.max_pending_requests,
            "pending_timeout_s": config.pending_timeout,
            "kv_capacity": config.kv_capacity,
            "prefill_chunk": config.prefill_chunk,
            "idle_prefill_chunk": config.idle_prefill_chunk,
        },
        sampling_overrides={k: v for k, v in asdict(flags).items() if v is not None},
        greedy=settings.greedy,
        thinking_default=info.thinking_default,
        preserve_thinking_default=info.preserve_thinking_default,
    )
    return state


async def _log_stats(state, interval_s: float) -> None:
    """A throughput line on stderr (and in the request log) every interval."""
    registry = state.metrics.registry
    labels = {"model_name": state.info.model_id}

    def sample(name: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    last_prompt = last_gen = 0.0
    last = time.perf_counter()
    while True:
        await asyncio.sleep(interval_s)
        now = time.perf_counter()
        prompt = sample("ninfer:prompt_tokens_total")
        gen = sample("ninfer:generation_tokens_total")
        running = sample("ninfer:num_requests_running")
        waiting = sample("ninfer:num_requests_waiting")
        span = now - last
        if prompt != last_prompt or gen != last_gen or running or waiting:
            record = {
                "prompt_tokens_per_s": (prompt - last_prompt) / span,
                "generation_tokens_per_s": (gen - last_gen) / span,
                "running": int(running),
                "waiting": int(waiting),
            }
            state.log.write("throughput", **record)
            print(
                "ninfer serve: {prompt_tokens_per_s:.1f} prompt tok/s, "
                "{generation_tokens_per_s:.1f} gen tok/s, running {running}, "
                "waiting {waiting}".format(**record),
                file=sys.stderr,
            )
        last_prompt, last_gen, last = prompt, gen, now


def build_app(settings: ServeSettings, argv: list[str]) -> tuple[FastAPI, ServerState, AsyncEngine]:
    """(app, state, engine): the engine is started; closing it is the caller's job (the app
    closes it at shutdown)."""
    from ninfer.engine.engine import AsyncEngine, shipped_model_path
    from ninfer.serve.app import create_app

    model_path = Path(settings.model) if settings.model is not None else shipped_model_path()
    engine = AsyncEngine(model_path, engine_config(settings))
    try:
        state = build_state(settings, engine, model_path, argv)
    except BaseException:
        engine.close()
        raise
    background = []
    if settings.log_stats_interval_ms > 0:
        interval = settings.log_stats_interval_ms / 1000.0
        background.append(lambda: _log_stats(state, interval))
    app = create_app(state, background=background, on_shutdown=engine.aclose)
    return app, state, engine


def serve(settings: ServeSettings, argv: list[str]) -> int:
    import uvicorn

    app, state, engine = build_app(settings, argv)
    if not settings.is_loopback:
        print(
            f"ninfer serve: listening on {settings.host}, reachable beyond this machine"
            + ("" if state.api_key else " and with no API key"),
            file=sys.stderr,
        )
    print(
        f"ninfer serve: {state.info.model_id} on http://{settings.host}:{settings.port}",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level="warning", access_log=False
    )
    try:
        uvicorn.Server(config).run()
    finally:
        state.log.close()
        engine.close()
    return 0

"""Shared pieces of the server tests: a scripted engine that plays back fixed output for every
request (so protocol tests need no model), model info for the tiny frontend, and SSE readers
that parse streams the way the SDKs do."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from ninfer.chat import ChatFrontend
from ninfer.engine.request import GenerationRequest, Timings, TokenEvent, Usage
from ninfer.serve.request import ModelInfo

MODEL_ID = "tiny-test"
EFFORTS = ("low", "medium", "xhigh")


@dataclass
class ScriptedEngine:
    """Answers every request with `script`: (channel, text) pieces, one token each, then
    `finish` (with `stop_reason`, the stop string or token id that ended it, and
    `finish_error`, as the engine reports a request that failed after submit). `error` is raised on submit; `requests` and `aborted` record what happened."""

    script: list[tuple[str, str]] = field(default_factory=lambda: [("content", "Hello!")])
    finish: str = "stop"
    stop_reason: str | int | None = None
    finish_error: Exception | None = None
    error: Exception | None = None
    requests: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def submit(self, request: GenerationRequest):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        return self._play(request)

    async def _play(self, request: GenerationRequest):
        finished = False
        reasoning_tokens = 0
        try:
            for i, (channel, text) in enumerate(self.script):
                reasoning_tokens += channel == "reasoning"
                yield TokenEvent(
                    request.request_id,
                    [i + 1],
                    reasoning=text if channel == "reasoning" else "",
                    content=text if channel == "content" else "",
                )
                await asyncio.sleep(0)
            finished = True
            yield TokenEvent(
                request.request_id,
                [],
                finish_reason=self.finish,
                stop_reason=self.stop_reason,
                error=self.finish_error,
                usage=Usage(len(request.prompt_ids), len(self.script), reasoning_tokens, 0),
                timings=Timings(0.0, 0.01, 0.01, 0.02, 0.03),
            )
        finally:
            if not finished:
                self.aborted.append(request.request_id)


def model_info(frontend: ChatFrontend, **overrides) -> ModelInfo:
    return ModelInfo(model_id=MODEL_ID, template=frontend.template(), **overrides)


def data_frames(text: str) -> list[str]:
    """The `data:` payloads of a Chat Completions stream, in order."""
    assert text.endswith("\n\n")
    frames = [f for f in text.split("\n\n") if f]
    out = []
    for frame in frames:
        assert frame.startswith("data: "), frame
        out.append(frame[len("data: ") :])
    return out


def chat_chunks(text: str) -> list[dict]:
    frames = data_frames(text)
    assert frames[-1] == "[DONE]" and frames.count("[DONE]") == 1
    return [json.loads(f) for f in frames[:-1]]


def typed_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) pairs of an `event:` + `data:` stream (Anthropic, Responses)."""
    assert text.endswith("\n\n")
    out = []
    for frame in (f for f in text.split("\n\n") if f):
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
        name = lines[0][len("event: ") :]
        data = json.loads(lines[1][len("data: ") :])
        assert data["type"] == name
        out.append((name, data))
    return out

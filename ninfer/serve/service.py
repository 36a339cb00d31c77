"""The generation service: a `ChatRequest` becomes a prompt (chat layer), a `GenerationRequest`
(engine) and a protocol-neutral output stream. Every protocol adapter goes through here, so the
prompt, sampling precedence and limits are the same for Chat, Responses and Anthropic."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from ninfer.chat.frontend import ChatFrontend, ChatPrompt
from ninfer.chat.presets import SamplingFields, resolve_sampling
from ninfer.chat.template import ChatTemplateError, ChatTemplateOptionError
from ninfer.engine.request import GenerationRequest, SamplingParams, TokenEvent
from ninfer.errors import ContextLengthExceeded, InvalidRequestError
from ninfer.serve.errors import invalid
from ninfer.serve.output import Completion, TextDelta, output_stream
from ninfer.serve.request import ChatRequest

# top_p = 0 is a valid request value (keep only the most likely token); the engine's sampler
# takes top_p in (0, 1], where the smallest positive value has the same effect.
_TOP_P_FLOOR = 1e-9


class AsyncSubmitter(Protocol):
    """What the service needs from `ninfer.engine.AsyncEngine`: `submit` raises the typed
    admission errors (`QueueFull`, `ContextLengthExceeded`, ...) at once and returns the event
    stream, which aborts the request when its consumer stops early."""

    def submit(self, request: GenerationRequest) -> AsyncIterable[TokenEvent]: ...


@dataclass(slots=True)
class Generation:
    """One submitted request: its prompt, engine request and engine event stream."""

    request: ChatRequest
    prompt: ChatPrompt
    engine_request: GenerationRequest
    events: AsyncIterable[TokenEvent]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)


class GenerationService:
    def __init__(
        self,
        engine: AsyncSubmitter,
        frontend: ChatFrontend,
        *,
        max_context: int,
        sampling_flags: SamplingFields | None = None,
        greedy: bool = False,
    ) -> None:
        self.engine = engine
        self.frontend = frontend
        self.max_context = max_context
        self.sampling_flags = sampling_flags
        self.greedy = greedy

    def render(self, request: ChatRequest) -> ChatPrompt:
        """The prompt the model sees; template refusals become 400s."""
        try:
            return self.frontend.render(
                request.template_messages(),
                tools=request.template_tools(),
                enable_thinking=request.enable_thinking,
                reasoning_effort=request.reasoning_effort,
                preserve_thinking=request.preserve_thinking,
                continue_final=request.continue_final,
            )
        except ChatTemplateOptionError as exc:
            raise invalid(str(exc), exc.code, exc.param) from None
        except ChatTemplateError as exc:
            raise invalid(f"the chat template rejected the conversation: {exc}") from None
        except InvalidRequestError as exc:  # what the request's text makes impossible
            raise invalid(str(exc), param=exc.param) from None

    def count_tokens(self, request: ChatRequest) -> int:
        return len(self.render(request).token_ids)

    def sampling_params(
        self, request: ChatRequest, thinking: bool, prompt_len: int
    ) -> SamplingParams:
        preset = self.frontend.sampling_preset(thinking)
        fields = resolve_sampling(preset, self.sampling_flags, request.sampling, self.greedy)
        room = self.max_context - prompt_len
        if room < 1:
            raise ContextLengthExceeded(prompt_len, None, self.max_context)
        # A limit past the context window ends with finish reason "length" when the window
        # fills, as a defaulted one does; only a prompt that leaves no room is an error.
        max_tokens = None if request.max_tokens_defaulted else min(request.max_tokens, room)
        return SamplingParams(
            temperature=fields.temperature,
            top_p=max(fields.top_p, _TOP_P_FLOOR),
            top_k=fields.top_k,
            min_p=fields.min_p,
            presence_penalty=fields.presence_penalty,
            frequency_penalty=fields.frequency_penalty,
            seed=fields.seed,
            logit_bias=request.logit_bias,
            max_tokens=max_tokens,
            stop=tuple(request.stop),
        )

    def prepare(self, request: ChatRequest, request_id: str, prompt: ChatPrompt) -> Generation:
        """Resolve sampling for `request`, whose `render` is `prompt`, and submit; admission
        errors are raised here, before any response is sent."""
        params = self.sampling_params(request, prompt.enable_thinking, len(prompt.token_ids))
        engine_request = GenerationRequest(
            prompt_ids=prompt.token_ids,
            params=params,
            request_id=request_id,
            starts_in_reasoning=prompt.starts_in_reasoning,
        )
        events = self.engine.submit(engine_request)
        return Generation(request, prompt, engine_request, events)

    async def outputs(self, generation: Generation) -> AsyncIterator[TextDelta | Completion]:
        """The output stream; closing it (or cancelling its consumer) aborts the request."""
        events = aiter(generation.events)
        try:
            async for item in output_stream(
                events,
                tools_active=generation.request.tools_active,
                tool_name_max=generation.request.tool_name_max,
            ):
                yield item
        finally:
            aclose: Any = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

"""The messages that cross the engine boundary: what a caller asks for (`SamplingParams`,
`GenerationRequest`) and what comes back (`TokenEvent` with `Usage` and `Timings`).

Plain dataclasses with no torch import, so the server and the CLI can build them cheaply."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from ninfer.errors import InvalidRequestError

FinishReason = Literal["stop", "length", "abort", "error"]

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature=0` is greedy decoding. `top_k=0`, `top_p=1` and `min_p=0` turn those filters
    off. Penalties follow OpenAI: presence subtracts a constant from every token already
    generated, frequency subtracts in proportion to its count (prompt tokens do not count).
    `logit_bias` adds to the raw logits of the given token ids. `seed` makes sampling
    reproducible: the same seed, prompt and parameters give the same tokens, whatever else is
    running. `logprobs=None` returns none, `0` the sampled token's, `n` also the top n.
    `max_tokens=None` lets the request run to the end of its context window.
    `stop` strings end the content channel, `reasoning_stop` strings the reasoning channel; a
    matched string is withheld from the output. `stop_token_ids` add to the model's end-of-turn
    ids, which `ignore_eos` switches off.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | list[str] = ()
    reasoning_stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    @classmethod
    def greedy(cls, **overrides: object) -> SamplingParams:
        """Deterministic argmax decoding."""
        return cls(temperature=0.0, **overrides)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError` naming the first field out of range."""

        def bad(
            name: str, value: object, rule: str, param: str | None = None
        ) -> InvalidRequestError:
            return InvalidRequestError(f"{name} = {value!r} is invalid: {rule}", param or name)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise bad(name, getattr(self, name), "must be a number")
        for name in ("top_k", "max_tokens", "logprobs", "seed"):
            value = getattr(self, name)
            if not is_int(value) and (value is not None or name == "top_k"):
                raise bad(name, value, "must be an integer")
        for name in ("stop", "reasoning_stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                rule = "must be a list (a string would be its characters)"
                raise bad(name, getattr(self, name), rule)
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise bad("logit_bias", self.logit_bias, "must be a dict of token id -> bias")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "must be true or false")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "must be >= 0 (0 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > 2.0:
                raise bad(name, value, "must be in [-2, 2]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64
        ):  # its 64 bits key the sampling: a wider one would repeat a narrower one's
            raise bad("seed", self.seed, "must be a 64-bit integer, signed or unsigned")
        for name, values in (("stop", self.stop), ("reasoning_stop", self.reasoning_stop)):
            if any(not isinstance(s, str) or not s for s in values):
                raise bad(name, list(values), "stop strings must be non-empty strings")
        for field_name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", (self.logit_bias or {}).keys()),
        ):
            for token_id in ids:
                if not is_int(token_id) or token_id < 0:
                    raise bad("token id", token_id, "must be a non-negative integer", field_name)
                if vocab_size is not None and token_id >= vocab_size:
                    rule = f"must be < the vocabulary size {vocab_size}"
                    raise bad("token id", token_id, rule, field_name)
        for token_id, value in (self.logit_bias or {}).items():
            if not _is_number(value) or not math.isfinite(value) or abs(value) > 100.0:
                raise bad(f"logit_bias[{token_id}]", value, "must be in [-100, 100]", "logit_bias")


def is_int(value: object) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_request(request: object) -> None:
    """`InvalidRequestError` unless `request` is a `GenerationRequest` whose fields have their
    types: a string id (the engine keys its state by it), prompt ids in a list (each an
    integer: `EngineCore.validate` checks that in its pass over them), `SamplingParams` (whose
    own checks `SamplingParams.validate` makes)."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError(
            f"request_id = {request.request_id!r} is invalid: must be a non-empty string",
            "request_id",
        )
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError("prompt_ids must be a list of integer token ids", "prompt_ids")
    if not isinstance(request.params, SamplingParams):
        raise InvalidRequestError(
            f"params must be SamplingParams, got {type(request.params).__name__}", "params"
        )


_request_counter = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_request_counter)}"


@dataclass(slots=True)
class GenerationRequest:
    """One generation: prompt token ids plus sampling and stop rules.

    `starts_in_reasoning` tells the output decoder that the prompt left a `<think>` block open,
    so the first generated text belongs to the reasoning channel. `detokenize=False` skips the
    text layer (events carry token ids only). `split_reasoning=False` makes the text plain, as
    generated: no reasoning channel and no whitespace trimmed (a completion of raw text).
    """

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    starts_in_reasoning: bool = False
    detokenize: bool = True
    split_reasoning: bool = True


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """Log-probability of one generated token under the model, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Timings:
    """Seconds spent in each phase of one request.

    `queue`: submit to admission; `prefill`: admission to the first token; `ttft`: submit to the
    first token; `decode`: first token to the last; `total`: submit to finish.
    """

    queue: float = 0.0
    prefill: float = 0.0
    ttft: float = 0.0
    decode: float = 0.0
    total: float = 0.0


@dataclass(slots=True)
class TokenEvent:
    """What one engine step produced for one request.

    `token_ids` are the new ids; `reasoning` and `content` the new text on each channel (empty
    when the request does not detokenize). The last event of a request has `finish_reason`,
    `usage` and `timings`; `stop_reason` is the stop string or token id that ended it, and
    `error` the typed exception when `finish_reason == "error"` (request handles raise it).
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: Exception | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

"""HTTP errors: the one place where typed errors become a status, a code and a wire body.

Two body shapes exist: OpenAI (`{"error": {message, type, param, code}}`) for Chat, Responses and
everything else, and Anthropic (`{"type": "error", "error": {type, message}}`) for `/v1/messages*`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ninfer import errors as core_errors

CLIENT_DISCONNECTED = 499

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


@dataclass(slots=True)
class ApiError(Exception):
    """An error with its HTTP status and OpenAI-style code; `param` names the offending field."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    type: str | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def openai_type(self) -> str:
        if self.type:
            return self.type
        if self.status == 500:
            return "internal_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    @property
    def anthropic_type(self) -> str:
        if self.status >= 500:
            return "api_error"
        return _ANTHROPIC_TYPES.get(self.status, "invalid_request_error")

    def openai_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def body_for(self, path: str) -> dict:
        return self.anthropic_body() if is_anthropic_path(path) else self.openai_body()


def invalid(message: str, code: str | None = None, param: str | None = None) -> ApiError:
    """A 400 validation error."""
    return ApiError(400, message, code=code, param=param)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def bad_json(detail: str) -> ApiError:
    return ApiError(400, f"request body is not valid JSON: {detail}")


def request_too_large(limit_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"request body exceeds the limit of {limit_bytes} bytes",
        code="request_too_large",
    )


def invalid_api_key() -> ApiError:
    return ApiError(401, "missing or invalid API key", code="invalid_api_key")


def model_not_found(model: str, served: str | None = None) -> ApiError:
    message = f"the model '{model}' does not exist"
    if served is not None:
        message += f" (this server serves '{served}')"
    return ApiError(404, message, code="model_not_found", param="model")


def route_error(status: int, message: str) -> ApiError:
    """A routing failure (unknown path, wrong method) with the status the router chose."""
    return ApiError(status, message, code="not_found" if status == 404 else None)


def response_not_found(message: str, param: str | None = None) -> ApiError:
    """A Responses id the store does not hold (never stored, deleted or evicted)."""
    return ApiError(404, message, code="response_not_found", param=param)


def compaction_not_supported() -> ApiError:
    return ApiError(400, "response compaction is not supported", code="compaction_not_supported")


def cancel_not_supported() -> ApiError:
    return ApiError(
        400,
        "only background responses can be cancelled, and this server runs none",
        code="background_not_supported",
    )


def no_result() -> ApiError:
    """The engine's event stream ended without a final event."""
    return ApiError(503, "the engine ended the request without a result", "service_unavailable")


def generation_failed(detail: object) -> ApiError:
    """A request ended with an error that is not an exception to re-raise."""
    return ApiError(500, f"generation failed: {detail or 'engine error'}", "internal_error")


def client_disconnected() -> ApiError:
    return ApiError(
        CLIENT_DISCONNECTED, "client disconnected before completion", code="client_disconnected"
    )


def to_api_error(exc: BaseException, prompt_param: str = "messages") -> ApiError:
    """Map any exception raised while serving a request to its ApiError; `prompt_param` is the
    protocol's field that holds the prompt (Responses: `input`)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, core_errors.ContextLengthExceeded):
        return ApiError(400, str(exc), code="context_length_exceeded", param=prompt_param)
    if isinstance(exc, core_errors.QueueFull):
        return ApiError(429, str(exc) or "no free active or pending slot", code="server_overloaded")
    if isinstance(exc, core_errors.QueueTimeout):
        return ApiError(503, str(exc) or "pending deadline expired", code="request_queue_timeout")
    if isinstance(exc, core_errors.EngineClosed):
        return ApiError(503, str(exc) or "the engine is not running", code="service_unavailable")
    if isinstance(exc, core_errors.NinferError):
        return ApiError(400, str(exc), param=getattr(exc, "param", None))
    return ApiError(500, f"internal error ({type(exc).__name__})", code="internal_error")


# The field that holds the prompt, by protocol, where it is not `messages`.
PROMPT_PARAMS = {"responses": "input"}


def sse_error_event(err: ApiError, *, anthropic: bool) -> bytes:
    """The frame that reports an error after a stream has started (Chat or Anthropic)."""
    if anthropic:
        return b"event: error\ndata: " + _dumps(err.anthropic_body()) + b"\n\n"
    return b"data: " + _dumps(err.openai_body()) + b"\n\n"


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

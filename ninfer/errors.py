"""Typed errors shared across ninfer. Each names what the user got wrong; the CLI prints the
message on one line and the server maps the class to an HTTP status in one place."""


class NinferError(Exception):
    """Base class for errors caused by input (files, flags, requests), not by a bug."""


class ArtifactError(NinferError):
    """A `.ninfer` file (or one of its parts) is malformed, truncated or fails verification."""


class ConversionError(NinferError):
    """A checkpoint cannot be converted: unknown recipe, unsupported model_type, missing tensor."""


class UnsupportedModelError(NinferError):
    """The artifact's architecture / model_type has no model class."""


class ModelConfigError(NinferError):
    """A model's config (a checkpoint's config.json, or the copy an artifact stores) lacks a
    field the model needs, or disagrees with the shapes of the model's tensors."""


class InvalidRequestError(NinferError):
    """A generation request is malformed: empty prompt, out-of-range sampling value, bad token id.
    `param` names the request field at fault, where one is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidRequestError):
    """Prompt plus the output limit does not fit the per-request context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_context: int) -> None:
        """max_tokens None: no limit was asked for, and the prompt leaves no room for one
        generated token."""
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_context = max_context
        if max_tokens is None:
            message = (
                f"prompt ({prompt_tokens} tokens) leaves no room for a generated token in the "
                f"context window of {max_context} tokens"
            )
        else:
            message = (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_tokens + max_tokens} tokens exceeds the context window of "
                f"{max_context} tokens"
            )
        super().__init__(message)


class QueueFull(NinferError):
    """Every active lane is busy and the pending queue holds its maximum number of requests."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        super().__init__(f"server overloaded: all lanes busy and {max_pending} requests pending")


class QueueTimeout(NinferError):
    """A request waited in the pending queue past its deadline without being admitted."""

    def __init__(self, waited_s: float) -> None:
        self.waited_s = waited_s
        super().__init__(f"request not admitted within {waited_s:.1f} s of waiting")


class EngineClosed(NinferError):
    """The engine was shut down (or its thread failed) before the request could run."""


class ConfigError(NinferError):
    """An engine or command setting is out of range or inconsistent with another."""


class EngineError(RuntimeError):
    """The engine failed while running a request (a bug or a device failure, not bad input)."""

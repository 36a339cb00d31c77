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

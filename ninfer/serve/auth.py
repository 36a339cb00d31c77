"""API-key check: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

OPEN_PATHS = frozenset({"/health"})


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    keys = []
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
    if headers.get("x-api-key"):
        keys.append(headers["x-api-key"])
    return keys


def authorized(expected: str | None, headers: Mapping[str, str]) -> bool:
    """True when no key is configured or either header carries it."""
    if expected is None:
        return True
    want = expected.encode()
    # Every presented key is compared, so timing does not reveal which header matched.
    matches = [hmac.compare_digest(key.encode(), want) for key in presented_keys(headers)]
    return any(matches)

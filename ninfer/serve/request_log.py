"""The request log: one JSON object per line (`--request-log-jsonl`), appended and flushed as
events happen. It records identity, sampling, sizes, timings and outcomes, never generated text,
and the API key never appears (argv is redacted before it is written)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import threading
import time
from dataclasses import asdict
from typing import Any

from ninfer.engine.request import Usage
from ninfer.serve.errors import ApiError

SCHEMA = "ninfer_request_log"
SCHEMA_VERSION = 1
REDACTED = "<redacted>"
_SECRET_FLAGS = ("--api-key",)


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the value of every secret flag replaced, in `--flag VALUE` and `--flag=VALUE`
    forms."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = arg.partition("=")
        if name in _SECRET_FLAGS:
            if eq:
                out.append(f"{name}={REDACTED}")
            else:
                out.append(arg)
                hide_next = True
            continue
        out.append(arg)
    return out


class RequestLog:
    """Writes nothing when `path` is None; ids are monotonic within one server instance."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = path
        self.instance_id = secrets.token_hex(8)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path is not None else None  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "event": event,
            "timestamp_unix_ms": int(time.time() * 1000),
            "server_instance_id": self.instance_id,
            **fields,
        }
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def server_start(self, argv: list[str], **fields: Any) -> None:
        self.write("server_start", argv=redact_argv(argv), **fields)

    def request_start(self, request_id: int, **fields: Any) -> None:
        self.write("request_start", request_id=request_id, **fields)

    def request_rejected(
        self, err: ApiError, *, protocol: str, phase: str = "prepare", request_id: int | None = None
    ) -> None:
        self.write(
            "request_rejected",
            request_id=request_id,
            protocol=protocol,
            phase=phase,
            status=err.status,
            type=err.openai_type,
            code=err.code,
            param=err.param,
            message=err.message,
        )

    def request_done(
        self,
        request_id: int,
        *,
        finish_reason: str,
        usage: Usage,
        timings: dict[str, float],
        prepare_s: float,
    ) -> None:
        self.write(
            "request_done",
            request_id=request_id,
            finish_reason=finish_reason,
            usage=asdict(usage),
            timings_seconds={"prepare": prepare_s, **timings},
        )

    def request_error(self, request_id: int, err: ApiError) -> None:
        self.write(
            "request_error",
            request_id=request_id,
            status=err.status,
            code=err.code,
            message=err.message,
        )

"""`ServeSettings`: every `ninfer serve` setting with its default, checked once at startup.
No heavy imports, so the CLI can build it without loading the server stack."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from ninfer.errors import ConfigError


@dataclass(slots=True)
class ServeSettings:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_key_file: str | None = None
    cors: bool = False
    max_request_mib: int = 384
    model_id: str | None = None
    max_context: int = 8192
    kv_capacity: int | str = "auto"
    prefill_chunk: int = 1024
    idle_prefill_chunk: int | None = None  # None: 4 x prefill_chunk
    max_concurrency: int = 8
    max_pending_requests: int = 16
    pending_timeout_ms: int = 30000
    default_max_tokens: int = 8192
    no_thinking: bool = False
    preserve_thinking: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False
    response_store_max_records: int = 1024
    response_store_max_mib: int = 256
    request_log_jsonl: str | None = None
    log_stats_interval_ms: int = 5000
    device: str | None = None
    dtype: str | None = None
    gdn_state_dtype: str = "float32"
    tensor_parallel: int = 1
    expert_parallel: bool = False
    no_cuda_graph: bool = False
    no_overlap: bool = False

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(1 <= self.port <= 65535, f"port {self.port} must be in 1..65535")
        need(self.max_request_mib >= 1, "max-request-mib must be >= 1")
        need(self.model_id is None or bool(self.model_id.strip()), "model-id must not be empty")
        need(self.default_max_tokens >= 1, "default-max-tokens must be >= 1")
        need(self.pending_timeout_ms >= 1, "pending-timeout-ms must be >= 1")
        need(self.response_store_max_records >= 1, "response-store-max-records must be >= 1")
        need(self.response_store_max_mib >= 1, "response-store-max-mib must be >= 1")
        need(self.log_stats_interval_ms >= 0, "log-stats-interval-ms must be >= 0")
        for name, lo, hi in (
            ("temperature", 0.0, 2.0),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
        ):
            value = getattr(self, name)
            need(value is None or lo <= value <= hi, f"{name} = {value} must be in [{lo}, {hi}]")
        need(self.top_k is None or self.top_k >= 0, "top-k must be >= 0")
        need(self.seed is None or self.seed >= 0, "seed must be >= 0")
        if isinstance(self.kv_capacity, str) and self.kv_capacity != "auto":
            try:
                self.kv_capacity = int(self.kv_capacity)
            except ValueError:
                raise ConfigError("kv-capacity must be a token count or 'auto'") from None
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("give --api-key or --api-key-file, not both")
        if self.request_log_jsonl is not None:
            log_path = Path(self.request_log_jsonl)
            need(
                log_path.parent.is_dir(), f"request log directory {log_path.parent} does not exist"
            )
            need(
                self.model is None or log_path.resolve() != Path(self.model).resolve(),
                "the request log must not be the model file",
            )

    def resolved_api_key(self) -> str | None:
        if self.api_key_file is None:
            return self.api_key
        try:
            key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read api key file {self.api_key_file}: {exc}") from None
        if not key:
            raise ConfigError(f"api key file {self.api_key_file} is empty")
        return key

    @property
    def is_loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

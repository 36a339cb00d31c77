"""Prometheus metrics for `/metrics`, named after vLLM's (`ninfer:` instead of `vllm:`) so
existing dashboards need only the prefix changed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ninfer.engine.request import Usage

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class Metrics:
    """One registry per server, so tests can build many apps in one process."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.request_success = Counter(
            "ninfer:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.request_rejected = Counter(
            "ninfer:request_rejected",
            "Requests refused or failed, by HTTP status and error code.",
            [*labels, "status", "code"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "ninfer:prompt_tokens",
            "Prompt tokens of finished requests.",
            labels,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "ninfer:generation_tokens",
            "Generated tokens of finished requests.",
            labels,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "ninfer:time_to_first_token_seconds",
            "Submit to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "ninfer:inter_token_latency_seconds",
            "Mean time between output tokens of a request.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "ninfer:e2e_request_latency_seconds",
            "Submit to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.running = Gauge(
            "ninfer:num_requests_running",
            "Requests generating right now.",
            labels,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "ninfer:num_requests_waiting",
            "Requests accepted but not yet producing output.",
            labels,
            registry=self.registry,
        )

    def finished(self, finish_reason: str, usage: Usage, timings: dict[str, float]) -> None:
        m = self.model_name
        self.request_success.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(usage.prompt_tokens)
        self.generation_tokens.labels(m).inc(usage.completion_tokens)
        if "ttft" in timings:
            self.ttft.labels(m).observe(timings["ttft"])
        if "total" in timings:
            self.e2e.labels(m).observe(timings["total"])
        if usage.completion_tokens > 1 and "decode" in timings:
            self.inter_token.labels(m).observe(timings["decode"] / (usage.completion_tokens - 1))

    def rejected(self, status: int, code: str | None) -> None:
        self.request_rejected.labels(self.model_name, str(status), code or "").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

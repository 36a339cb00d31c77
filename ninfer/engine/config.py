"""`EngineConfig`: the settings fixed when an engine starts (limits, pools, device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer.engine.request import is_int
from ninfer.errors import ConfigError

MAX_CONCURRENCY = 64
GDN_STATE_DTYPES = ("float32", "bfloat16")


# `idle_prefill_chunk` by default: this many times `prefill_chunk`
IDLE_CHUNK_FACTOR = 4


@dataclass(slots=True)
class EngineConfig:
    """Startup settings of an `Engine`.

    `max_context`: prompt + output ceiling of one request. `max_concurrency`: requests that run
    at once (lanes, 1..64). `max_pending_requests`: requests that may wait for a lane; one more
    is refused with `QueueFull`. `pending_timeout`: seconds a request may wait before it fails
    with `QueueTimeout` (None waits forever). `kv_capacity`: tokens of attention K/V shared by all
    requests, or "auto" for the largest pool that fits next to the weights (on CPU, enough for
    every lane at `max_context`). `prefill_chunk`: prompt tokens processed per step while some
    request is decoding (prefill chunks and decode rounds alternate, so this bounds the pause a
    prefill puts into running streams). `idle_prefill_chunk`: prompt tokens per step when no
    request is decoding, so a lone long prompt runs in fewer, larger steps (None: 4 x
    `prefill_chunk`, so a smaller `prefill_chunk` given to bound activation memory also bounds
    this; anything below `prefill_chunk` means `prefill_chunk`).
    `default_max_tokens`: output limit of a request that sets none (None: up to `max_context`).
    `kv_headroom_bytes`: GPU memory an `auto` K/V pool leaves free.
    `dtype`/`device`: None picks bfloat16 on CUDA, float32 on CPU. `tensor_parallel`: ranks
    the model is split over (one process each; docs/parallel.md), `expert_parallel`: split the
    MoE experts whole across those ranks instead of slicing each one. `cuda_graph`: replay
    decode steps from CUDA graphs captured at start (CUDA in bf16/fp16, on every rank;
    ignored elsewhere); off is for debugging. `overlap`: launch each decode step before the
    one in flight is read back, so the host's work of a step overlaps the device's work of
    the step before (one rank; `EngineCore.step`); off for debugging and comparison.
    `gdn_state_dtype`: the GDN recurrent state held per request, float32 or bfloat16 (half the
    memory of a state slot and of the decode step's state traffic; the state is rounded to
    bf16 after each step, while the update itself runs in fp32).
    """

    max_context: int = 4096
    max_concurrency: int = 8
    max_pending_requests: int = 64
    pending_timeout: float | None = None
    kv_capacity: int | Literal["auto"] = "auto"
    prefill_chunk: int = 1024
    idle_prefill_chunk: int | None = None
    default_max_tokens: int | None = None
    dtype: str | None = None
    device: str | None = None
    kv_headroom_bytes: int = 1 << 30
    tensor_parallel: int = 1
    expert_parallel: bool = False
    cuda_graph: bool = True
    overlap: bool = True
    gdn_state_dtype: str = "float32"

    def _check_types(self) -> None:
        """A `ConfigError` naming the first field whose value has the wrong type (a string of
        digits, a float where tokens are counted, a bool where a count is wanted)."""
        wanted = {
            "an integer": (
                "max_context", "max_concurrency", "max_pending_requests", "prefill_chunk",
                "kv_headroom_bytes", "tensor_parallel",
            ),
            "an integer or None": ("idle_prefill_chunk", "default_max_tokens"),
            "true or false": ("expert_parallel", "cuda_graph", "overlap"),
            "a string or None": ("dtype", "device"),
            "a string": ("gdn_state_dtype",),
        }  # fmt: skip
        checks = {
            "an integer": is_int,
            "an integer or None": lambda v: v is None or is_int(v),
            "true or false": lambda v: isinstance(v, bool),
            "a string or None": lambda v: v is None or isinstance(v, str),
            "a string": lambda v: isinstance(v, str),
        }
        for kind, names in wanted.items():
            for name in names:
                if not checks[kind](getattr(self, name)):
                    raise ConfigError(f"{name} = {getattr(self, name)!r} must be {kind}")
        timeout = self.pending_timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float))
        ):
            raise ConfigError(f"pending_timeout = {timeout!r} must be seconds or None")
        if self.kv_capacity != "auto" and not is_int(self.kv_capacity):
            raise ConfigError(f"kv_capacity = {self.kv_capacity!r} must be tokens or 'auto'")

    def __post_init__(self) -> None:
        self._check_types()
        if self.max_context < 2:
            raise ConfigError(f"max_context = {self.max_context} must be >= 2")
        if not 1 <= self.max_concurrency <= MAX_CONCURRENCY:
            raise ConfigError(
                f"max_concurrency = {self.max_concurrency} must be in 1..{MAX_CONCURRENCY}"
            )
        if self.max_pending_requests < 0:
            raise ConfigError(f"max_pending_requests = {self.max_pending_requests} must be >= 0")
        if self.pending_timeout is not None and self.pending_timeout <= 0:
            raise ConfigError(f"pending_timeout = {self.pending_timeout} must be > 0")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk = {self.prefill_chunk} must be >= 1")
        if self.idle_prefill_chunk is not None and self.idle_prefill_chunk < 1:
            raise ConfigError(f"idle_prefill_chunk = {self.idle_prefill_chunk} must be >= 1")
        if self.kv_capacity != "auto":
            if not isinstance(self.kv_capacity, int) or self.kv_capacity < 1:
                raise ConfigError(f"kv_capacity = {self.kv_capacity!r} must be tokens or 'auto'")
            if self.kv_capacity < self.max_context:
                raise ConfigError(
                    f"kv_capacity ({self.kv_capacity} tokens) must hold at least one request "
                    f"of max_context ({self.max_context} tokens)"
                )
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens = {self.default_max_tokens} must be >= 1")
        if self.tensor_parallel < 1:
            raise ConfigError(f"tensor_parallel = {self.tensor_parallel} must be >= 1")
        if self.expert_parallel and self.tensor_parallel < 2:
            raise ConfigError(
                "expert_parallel needs tensor_parallel >= 2 (experts split over ranks)"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype = {self.dtype!r} must be float32, bfloat16 or float16")
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            raise ConfigError(
                f"gdn_state_dtype = {self.gdn_state_dtype!r} must be float32 or bfloat16"
            )

    @property
    def idle_chunk(self) -> int:
        """The prompt tokens a step takes while no request decodes (`idle_prefill_chunk`)."""
        if self.idle_prefill_chunk is None:
            return IDLE_CHUNK_FACTOR * self.prefill_chunk
        return max(self.prefill_chunk, self.idle_prefill_chunk)


def parse_kv_capacity(text: str) -> int | Literal["auto"]:
    """`--kv-capacity` value: a token count or `auto`."""
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"kv_capacity {text!r} must be a number of tokens or 'auto'") from None
    return value

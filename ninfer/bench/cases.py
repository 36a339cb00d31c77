"""What a bench run measures (llama-bench style tests times concurrency levels) and how a row
is computed from the timed steps of its repetitions."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ninfer.bench.traffic import Traffic


@dataclass(frozen=True, slots=True)
class BenchCase:
    """`pp`: prefill `prompt` tokens; `tg`: generate `gen` tokens after a 1-token prompt;
    `pg`: prefill `prompt` then generate `gen`. Each of `concurrency` requests does it at once."""

    kind: str
    prompt: int
    gen: int
    concurrency: int

    @property
    def label(self) -> str:
        if self.kind == "pp":
            return f"pp{self.prompt}"
        if self.kind == "tg":
            return f"tg{self.gen}"
        return f"pp{self.prompt}+tg{self.gen}"

    @property
    def prompt_tokens(self) -> int:
        return 1 if self.kind == "tg" else self.prompt

    @property
    def decode_steps(self) -> int:
        return 0 if self.kind == "pp" else self.gen

    def counts_step(self, is_decode: bool) -> bool:
        """Whether a step is part of the test: `tg` counts its decode steps only (its 1-token
        prompt is not the test), `pp` its prefill, `pg` both."""
        if self.kind == "tg":
            return is_decode
        if self.kind == "pp":
            return not is_decode
        return True


def make_cases(
    prompts: list[int],
    gens: list[int],
    prompt_gens: list[tuple[int, int]],
    concurrency: list[int],
) -> list[BenchCase]:
    cases = [BenchCase("pp", p, 0, c) for p in prompts for c in concurrency]
    cases += [BenchCase("tg", 1, n, c) for n in gens for c in concurrency]
    cases += [BenchCase("pg", p, n, c) for p, n in prompt_gens for c in concurrency]
    return cases


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One timed engine step: what it ran, how long it took (host clock, device synced) and,
    for a decode step on CUDA, how long its device work took (CUDA events; None elsewhere)."""

    is_decode: bool
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    sampled: tuple[bool, ...]
    seconds: float
    device_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str


@dataclass(slots=True)
class Row:
    engine: str
    weights: str
    test: str
    concurrency: int
    tokens_per_s: float
    tokens_per_s_std: float
    speed_of_light: float  # floor time over measured time (1.0 = at the ceiling)
    bound: str  # "copy" (decode), "matmul" (prefill) or "both"
    decode_step_ms: float | None  # mean decode step
    decode_host_ms: float | None  # mean (step - device-busy time) of a decode step; None on CPU
    decode_host_share: float | None  # decode_host_ms / decode_step_ms
    decode_bytes_per_step: float | None  # mean over decode steps
    prefill_flops_per_s: float | None
    repetitions: int


def step_floor(record: StepRecord, traffic: Traffic, ceilings: Ceilings) -> float:
    """The shortest time the step could take: bytes over copy bandwidth for a decode step,
    FLOPs over the matmul rate for a prefill step."""
    if record.is_decode:
        return traffic.decode_bytes(record.context_lens).total / ceilings.copy_bytes_per_s
    flops = traffic.prefill_flops(record.context_lens, record.query_lens, record.sampled)
    return flops / ceilings.matmul_flops_per_s


def counted_steps(case: BenchCase, steps: list[StepRecord]) -> list[StepRecord]:
    return [s for s in steps if case.counts_step(s.is_decode)]


def host_time(decode_steps: list[StepRecord]) -> tuple[float, float] | None:
    """Mean host seconds of the decode steps (wall time minus device-busy time) and their share
    of the mean step; None when a step has no device time (CPU, the transformers peer)."""
    if not decode_steps or any(s.device_seconds is None for s in decode_steps):
        return None
    wall = sum(s.seconds for s in decode_steps)
    host = sum(s.seconds - s.device_seconds for s in decode_steps)
    return host / len(decode_steps), host / wall


def case_tokens(case: BenchCase) -> int:
    if case.kind == "pp":
        return case.concurrency * case.prompt
    if case.kind == "tg":
        return case.concurrency * case.gen
    return case.concurrency * (case.prompt + case.gen)


def summarize(
    engine: str,
    weights: str,
    case: BenchCase,
    repetitions: list[list[StepRecord]],
    traffic: Traffic,
    ceilings: Ceilings,
    ranks: int = 1,
) -> Row:
    """One row over a case's repetitions. Over `ranks` tensor-parallel GPUs the floor is the
    case's bytes or FLOPs over `ranks` times each ceiling (each GPU reads and computes its
    share), so speed of light stays a per-GPU ratio."""
    rates, ratios, decode_steps, decode_bytes, prefill_flops, prefill_seconds = (
        [],
        [],
        [],
        [],
        0.0,
        0.0,
    )
    for steps in repetitions:
        steps = counted_steps(case, steps)
        seconds = sum(s.seconds for s in steps)
        rates.append(case_tokens(case) / seconds)
        ratios.append(sum(step_floor(s, traffic, ceilings) for s in steps) / ranks / seconds)
        for s in steps:
            if s.is_decode:
                decode_steps.append(s)
                decode_bytes.append(traffic.decode_bytes(s.context_lens).total)
            else:
                prefill_flops += traffic.prefill_flops(s.context_lens, s.query_lens, s.sampled)
                prefill_seconds += s.seconds
    bound = {"pp": "matmul", "tg": "copy", "pg": "both"}[case.kind]
    host = host_time(decode_steps)
    return Row(
        engine=engine,
        weights=weights,
        test=case.label,
        concurrency=case.concurrency,
        tokens_per_s=statistics.fmean(rates),
        tokens_per_s_std=statistics.stdev(rates) if len(rates) > 1 else 0.0,
        speed_of_light=statistics.fmean(ratios),
        bound=bound,
        decode_step_ms=1e3 * statistics.fmean(s.seconds for s in decode_steps)
        if decode_steps
        else None,
        decode_host_ms=1e3 * host[0] if host else None,
        decode_host_share=host[1] if host else None,
        decode_bytes_per_step=statistics.fmean(decode_bytes) if decode_bytes else None,
        prefill_flops_per_s=prefill_flops / prefill_seconds if prefill_seconds else None,
        repetitions=len(repetitions),
    )

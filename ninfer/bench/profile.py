"""Per-kernel device time of a bench case (`ninfer bench --profile`): the case run once more
under `torch.profiler` with CUDA graphs off, so that each kernel is an event of its own, and the
kernels of its timed steps summed by name and by a few categories of name patterns. On the CPU
the kernels are torch operators, timed by their self time."""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ninfer.bench.cases import BenchCase
from ninfer.bench.targets import STEP_LABELS, NinferTarget

TOP_KERNELS = 15  # kernels the table lists per case; the JSON has them all
NAME_WIDTH = 90

# Substrings of lower-cased kernel names per category, space-separated: the first category with
# a match wins, a kernel with none is OTHER (elementwise work, rotary, sampling, ...). ninfer's
# Triton kernels are named after their functions (`_groupwise_gemv_kernel`, `_decode_split_kernel`,
# `_write_kernel` for the K/V write, ...), fla's GDN prefill kernels after their stages; on the
# CPU the names are torch operators (`aten::mm`, `aten::conv1d`, ...).
CATEGORIES: dict[str, str] = {
    "gemv": "groupwise_gemv _q4_tc_kernel _quantize_x_kernel",
    "matmul": "gemm gemv sm90_xmma cutlass nvjet dequant aten::mm addmm",
    "attention": "attention attn flash sdpa _decode_split _decode_merge _prefill_kernel "
    "_write_kernel",
    "gdn": "chunk_ recurrent gated_delta solve_tril merge_16x16 recompute_w_u gdn_gates",
    "conv": "conv1d convolution conv_and_gates",
    "moe": "_moe_",
    "norm": "norm",
    "copy": "memcpy memset",
}
OTHER = "other"


def category(name: str) -> str:
    lowered = name.lower()
    for label, patterns in CATEGORIES.items():
        if any(pattern in lowered for pattern in patterns.split()):
            return label
    return OTHER


def trim_name(name: str) -> str:
    """A kernel name without the `void ` and the parameter list of a demangled C++ name."""
    if not (name.startswith("void ") and name.endswith(")")):
        return name
    depth = 0
    for index in range(len(name) - 1, -1, -1):
        if name[index] == ")":
            depth += 1
        elif name[index] == "(":
            depth -= 1
            if depth == 0:
                return name[5:index].rstrip()
    return name[5:]


@dataclass(frozen=True, slots=True)
class KernelTime:
    name: str
    calls: int
    total_ms: float
    share: float  # of the case's device time
    step_ms: float | None  # total_ms per decode step of a `tg` case; None for the others


@dataclass(frozen=True, slots=True)
class CaseProfile:
    device_ms: float  # all kernels of the case's timed steps
    decode_steps: int | None  # the steps a `tg` case's times divide by; None for the others
    kernels: list[KernelTime]  # longest total first
    categories: dict[str, float]  # total ms per category, longest first

    def to_json(self) -> dict[str, Any]:
        """The row's profile fields in a JSON report."""
        return {
            "profile": [asdict(kernel) for kernel in self.kernels],
            "profile_device_ms": self.device_ms,
            "profile_decode_steps": self.decode_steps,
            "profile_categories": dict(self.categories),
        }


def profile_case(target: NinferTarget, case: BenchCase, seed: int) -> CaseProfile:
    """Run `case` once on `target` under the profiler (CUDA activity on CUDA, CPU activity on
    the CPU; the CPU activity is kept on CUDA for the step ranges) and sum its kernels."""
    on_cuda = target.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with warnings.catch_warnings():
        # torch 2.11 warns that events are cleared "at the end of each cycle" with no schedule
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
        with target.profiling(), profile(activities=activities) as prof:
            target.run_case(case, seed)
    labels = {STEP_LABELS[is_decode] for is_decode in (False, True) if case.counts_step(is_decode)}
    kernels = step_kernels(prof.events(), labels, on_cuda)
    return summarize_kernels(kernels, case.decode_steps if case.kind == "tg" else None)


def step_kernels(
    events: Iterable[Any], labels: set[str], on_cuda: bool
) -> Iterator[tuple[str, float]]:
    """(name, microseconds) of each kernel that starts inside a step range named in `labels`:
    device kernels and copies on CUDA, operators' self time on the CPU. Steps end on a host sync,
    so their ranges are disjoint and hold every kernel the step launched."""
    events = list(events)
    steps = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.name in labels and e.device_type == DeviceType.CPU
    )
    starts = [start for start, _ in steps]
    for e in events:
        if e.name in STEP_LABELS.values() or getattr(e, "is_user_annotation", False):
            continue
        if on_cuda:
            if e.device_type != DeviceType.CUDA:
                continue
            micros = e.time_range.elapsed_us()
        else:
            if e.device_type != DeviceType.CPU or e.is_async:
                continue
            micros = e.self_cpu_time_total
        index = bisect.bisect_right(starts, e.time_range.start) - 1
        if index >= 0 and e.time_range.start < steps[index][1]:
            yield e.name, micros


def summarize_kernels(
    kernels: Iterable[tuple[str, float]], decode_steps: int | None
) -> CaseProfile:
    """Kernels summed by name (longest total first) and by category."""
    calls: dict[str, int] = {}
    micros: dict[str, float] = {}
    for name, us in kernels:
        calls[name] = calls.get(name, 0) + 1
        micros[name] = micros.get(name, 0.0) + us
    total_ms = sum(micros.values()) / 1e3
    by_category: dict[str, float] = {}
    for name, us in micros.items():
        label = category(name)
        by_category[label] = by_category.get(label, 0.0) + us / 1e3
    kernels_out = [
        KernelTime(
            name=trim_name(name),
            calls=calls[name],
            total_ms=us / 1e3,
            share=us / 1e3 / total_ms if total_ms else 0.0,
            step_ms=us / 1e3 / decode_steps if decode_steps else None,
        )
        for name, us in sorted(micros.items(), key=lambda item: -item[1])
    ]
    categories = dict(sorted(by_category.items(), key=lambda item: -item[1]))
    return CaseProfile(total_ms, decode_steps, kernels_out, categories)


def format_profile(row: dict[str, Any]) -> list[str]:
    """A JSON row's profile as the indented block the table prints under the row."""
    device_ms, steps = row["profile_device_ms"], row["profile_decode_steps"]
    pad = " " * 4
    head = f"{pad}profile (CUDA graphs off): {device_ms:.3f} ms of kernels"
    if steps:
        head += f" in {steps} decode steps, {1e3 * device_ms / steps:.1f} us/step"
    share = {
        name: ms / device_ms if device_ms else 0.0 for name, ms in row["profile_categories"].items()
    }
    lines = [
        head,
        pad + "by category: " + ", ".join(f"{name} {s:.1%}" for name, s in share.items()),
        f"{pad}{'calls':>7} {'total ms':>9} {'share':>6} {'us/step':>8}  kernel",
    ]
    for kernel in row["profile"][:TOP_KERNELS]:
        per_step = f"{1e3 * kernel['step_ms']:.1f}" if kernel["step_ms"] is not None else "-"
        name = kernel["name"]
        if len(name) > NAME_WIDTH:
            name = name[: NAME_WIDTH - 3] + "..."
        lines.append(
            f"{pad}{kernel['calls']:>7} {kernel['total_ms']:>9.3f} {kernel['share']:>6.1%} "
            f"{per_step:>8}  {name}"
        )
    return lines

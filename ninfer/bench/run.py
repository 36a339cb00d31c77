"""A whole bench run: build the model (from a `.ninfer` file or random weights in a named
shape), measure the two ceilings, time every case on ninfer (and the transformers peer when
asked), profile ninfer's kernels per case when asked, and return the report that `ninfer bench`
prints as a table or JSON."""

from __future__ import annotations

import gc
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ninfer.bench.cases import BenchCase, Ceilings, Row, summarize
from ninfer.bench.ceilings import copy_bandwidth, matmul_rate
from ninfer.bench.profile import format_profile, profile_case
from ninfer.bench.shapes import SHAPES
from ninfer.bench.traffic import Traffic, artifact_formats, profile_formats
from ninfer.engine.config import GDN_STATE_DTYPES, IDLE_CHUNK_FACTOR
from ninfer.engine.engine import device_and_dtype
from ninfer.errors import ConfigError


@dataclass(slots=True)
class BenchOptions:
    cases: list[BenchCase]
    model_path: str | None = None
    shape: str | None = None
    weights: str = "q4"  # with --shape: the formats random weights stand for
    device: str | None = None
    dtype: str | None = None
    gdn_state_dtype: str = "float32"  # the GDN recurrent state's dtype (EngineConfig)
    repetitions: int = 3
    warmup: int = 1
    prefill_chunk: int = 1024
    idle_prefill_chunk: int | None = None  # None: 4 x prefill_chunk
    peers: list[str] = field(default_factory=list)
    seed: int = 0
    cuda_graph: bool = True
    overlap: bool = True  # decode steps launched before the one in flight is read back
    profile: bool = False  # per-kernel device time of each case on ninfer (profile.py)
    tensor_parallel: int = 1  # ranks the model is split over (one process and GPU each)
    expert_parallel: bool = False
    # called with each row (as a dict) as soon as it is timed, so a long run that is cut
    # short has still shown what it measured
    on_row: Callable[[dict[str, Any]], None] | None = None


# `git archive` writes the commit it archives into this file (export-subst, .gitattributes), so
# a tree unpacked from an archive, with no .git of its own, names its commit rather than that
# of whatever repository it was unpacked inside.
ARCHIVE_COMMIT = Path(__file__).with_name("ARCHIVE_COMMIT")


def _commit(root: Path | None = None) -> str | None:
    """The archived commit, or the checkout's HEAD with `-dirty` where tracked files differ
    from it (the figures are then not that commit's), or None outside both."""
    try:
        archived = ARCHIVE_COMMIT.read_text().strip()
    except OSError:
        archived = ""
    if archived and not archived.startswith("$Format"):
        return archived
    git = ["git", "-C", str(root or Path(__file__).resolve().parents[2])]
    try:
        out = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        clean = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    head = out.stdout.strip()
    if not head:
        return None
    return head if clean.returncode == 0 else f"{head}-dirty"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _time_cases(target, cases, options, traffic, ceilings, weights, ranks=1) -> list[Row]:
    rows = []
    for index, case in enumerate(cases):
        for rep in range(options.warmup):
            target.run_case(case, seed=options.seed + 1000 * index + 999 - rep)
        repetitions = [
            target.run_case(case, seed=options.seed + 1000 * index + rep)
            for rep in range(options.repetitions)
        ]
        rows.append(
            summarize(target.name, weights, case, repetitions, traffic, ceilings, ranks=ranks)
        )
        if options.on_row is not None:
            options.on_row(asdict(rows[-1]))
    return rows


def run_bench(options: BenchOptions) -> dict[str, Any]:
    from ninfer.bench.targets import (
        HFTarget,
        NinferTarget,
        RandomModel,
        RankSplit,
        executed_formats,
        random_model,
    )

    if (options.model_path is None) == (options.shape is None):
        raise ConfigError("give a .ninfer file or --shape, not both")
    if options.repetitions < 1 or options.warmup < 0:
        raise ConfigError("repetitions must be >= 1 and warmup >= 0")
    if options.shape is not None and options.shape not in SHAPES:
        raise ConfigError(f"unknown shape {options.shape!r} (known: {', '.join(SHAPES)})")
    if not options.cases:
        raise ConfigError("nothing to run: give -p, -n or -pg")
    ranks = options.tensor_parallel
    if ranks < 1:
        raise ConfigError(f"--tensor-parallel {ranks} must be >= 1")
    if options.expert_parallel and ranks < 2:
        raise ConfigError("--expert-parallel needs --tensor-parallel >= 2")
    if ranks > 1 and options.profile:
        raise ConfigError("--profile runs on one rank: leave out --tensor-parallel")
    device, dtype = device_and_dtype(options.device, options.dtype)
    if options.gdn_state_dtype not in GDN_STATE_DTYPES:
        raise ConfigError(
            f"gdn_state_dtype {options.gdn_state_dtype!r}: choose from {', '.join(GDN_STATE_DTYPES)}"
        )
    torch.manual_seed(options.seed)
    kv_itemsize = dtype.itemsize
    state_itemsize = getattr(torch, options.gdn_state_dtype).itemsize
    dense = "fp32" if dtype == torch.float32 else "bf16"
    model = source = None

    if options.model_path is not None:
        from ninfer.artifact import Artifact
        from ninfer.models.registry import load_model

        path = Path(options.model_path)
        if not path.is_file():
            raise ConfigError(f"model file not found: {path}")
        artifact = Artifact.open(path)
        config = artifact.config()
        traffic = Traffic(
            config,
            _as_run(artifact_formats(artifact), ranks, options.expert_parallel, dense),
            kv_itemsize=kv_itemsize,
            conv_itemsize=kv_itemsize,
            state_itemsize=state_itemsize,
        )
        weights = "artifact"
        if ranks == 1:
            model = load_model(artifact, config, device=device, dtype=dtype)
        else:
            from ninfer.parallel.launch import ArtifactModel

            source = ArtifactModel(path)
        model_label = str(path)
    else:
        config = SHAPES[options.shape]
        format_of = profile_formats(config, options.weights)
        traffic = Traffic(
            config,
            _as_run(format_of, ranks, options.expert_parallel, dense),
            kv_itemsize=kv_itemsize,
            conv_itemsize=kv_itemsize,
            state_itemsize=state_itemsize,
        )
        weights = options.weights
        if ranks == 1:
            model = random_model(config, device, dtype, options.seed, format_of=format_of)
        else:
            source = RandomModel(config, options.seed, options.weights)
        model_label = f"{options.shape} (random weights)"

    ceilings = Ceilings(
        copy_bandwidth(device), matmul_rate(device, dtype), str(dtype).removeprefix("torch.")
    )
    target = NinferTarget(
        model,
        options.cases,
        options.prefill_chunk,
        options.cuda_graph,
        idle_prefill_chunk=options.idle_prefill_chunk,
        overlap=options.overlap,
        gdn_state_dtype=options.gdn_state_dtype,
        parallel=RankSplit(source, ranks, options.expert_parallel, device, dtype)
        if ranks > 1
        else None,
    )
    executed = executed_formats(target.model)
    try:
        rows = _time_cases(target, options.cases, options, traffic, ceilings, weights, ranks)
    finally:
        target.close()
    profiles = []
    if options.profile:
        # Only once every case is timed: the profiler can leave CUPTI attached to the process,
        # and no timed step should pay for it. A seed of its own keeps each profiled run's
        # prompts out of the prefix cache.
        profiles = [
            profile_case(target, case, seed=options.seed + 1000 * index + options.repetitions)
            for index, case in enumerate(options.cases)
        ]
    del model, target
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for peer in options.peers:
        if peer != "hf":
            raise ConfigError(f"unknown peer {peer!r} (known: hf)")
        # transformers holds every weight in the run's dtype
        peer_traffic = Traffic(
            config, _all_dense(dense), kv_itemsize=kv_itemsize, conv_itemsize=kv_itemsize
        )
        target = HFTarget(config, device, dtype)
        rows += _time_cases(target, options.cases, options, peer_traffic, ceilings, dense)
        del target
        gc.collect()

    return {
        "model": model_label,
        "device": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "gdn_state_dtype": options.gdn_state_dtype,
        "executed_weights": executed,
        "commit": _commit(),
        "tensor_parallel": ranks,
        "torch": torch.__version__,
        "ceilings": asdict(ceilings),
        "weight_bytes_per_token": traffic.decode_bytes([0]).weights,
        "stored_weight_bytes": traffic.bytes_by_format(),
        "options": {
            "repetitions": options.repetitions,
            "warmup": options.warmup,
            "prefill_chunk": options.prefill_chunk,
            "idle_prefill_chunk": options.idle_prefill_chunk
            or IDLE_CHUNK_FACTOR * options.prefill_chunk,
            "seed": options.seed,
        },
        "rows": [  # ninfer's rows come first, one per case, in the order of the profiles
            asdict(row) | (profiles[index].to_json() if index < len(profiles) else {})
            for index, row in enumerate(rows)
        ],
    }


def _state_note(report: dict[str, Any]) -> str:
    """The header's note of a GDN state dtype other than the default."""
    state = report.get("gdn_state_dtype", "float32")
    return "" if state == "float32" else f"  gdn state {state}"


def _as_run(format_of, ranks: int, expert_parallel: bool, dense: str):
    """The formats the weights run in: as stored, except that MoE experts split by rows over
    tensor-parallel ranks (no expert parallelism) are held dense."""
    if ranks == 1 or expert_parallel:
        return format_of
    return lambda name, shape: dense if ".experts." in name else format_of(name, shape)


def _all_dense(dense: str):
    """Every weight stored in the dense format `dense` (a `FormatOf`)."""
    return lambda name, shape: dense


def si(value: float) -> str:
    """1.23G, 456M, 7.89k: a byte count in three significant digits."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


TABLE_HEADER = (
    f"{'engine':10} {'weights':8} {'test':14} {'C':>3} {'tok/s':>10} {'±':>8} "
    f"{'SoL':>6} {'bound':6} {'step ms':>8} {'host ms':>8} {'host%':>6} {'B/step':>8} "
    f"{'TFLOP/s':>8}"
)


def format_row(row: dict[str, Any]) -> str:
    """One row of the table (under TABLE_HEADER)."""
    step = f"{row['decode_step_ms']:.2f}" if row["decode_step_ms"] is not None else "-"
    host, share = "-", "-"
    if row["decode_host_ms"] is not None:
        host, share = f"{row['decode_host_ms']:.3f}", f"{row['decode_host_share']:.1%}"
    gb = si(row["decode_bytes_per_step"]) if row["decode_bytes_per_step"] is not None else "-"
    tflops = (
        f"{row['prefill_flops_per_s'] / 1e12:.2f}"
        if row["prefill_flops_per_s"] is not None
        else "-"
    )
    return (
        f"{row['engine']:10} {row['weights']:8} {row['test']:14} {row['concurrency']:>3} "
        f"{row['tokens_per_s']:>10.1f} {row['tokens_per_s_std']:>8.1f} "
        f"{row['speed_of_light']:>6.1%} {row['bound']:6} {step:>8} {host:>8} {share:>6} "
        f"{gb:>8} {tflops:>8}"
    )


def format_table(report: dict[str, Any]) -> str:
    """The report as a short text table: header lines, then one line per row (with its
    kernel profile under it when the run profiled)."""
    ceilings = report["ceilings"]
    ranks = report.get("tensor_parallel", 1)
    split = (
        f"  tensor-parallel {ranks} (SoL and ceilings per GPU; B/step over all)"
        if ranks > 1
        else ""
    )
    lines = [
        f"model   {report['model']}  device {report['device']}  dtype {report['dtype']}"
        f"{_state_note(report)}  commit {report['commit'] or '?'}{split}",
        f"ceilings  copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)"
        f"  matmul {ceilings['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s ({ceilings['matmul_dtype']})",
        f"weights read per decode token (C=1, stored formats): "
        f"{si(report['weight_bytes_per_token'])}B; "
        f"linears execute as {report['executed_weights']}",
        "",
        TABLE_HEADER,
    ]
    for row in report["rows"]:
        lines.append(format_row(row))
        if "profile" in row:
            lines += format_profile(row)
    return "\n".join(lines)

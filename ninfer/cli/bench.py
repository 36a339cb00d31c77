"""`ninfer bench`: llama-bench style throughput with each row's speed-of-light ratio, on a
`.ninfer` file or on random weights in a real model shape (docs/performance.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ninfer.bench.shapes import SHAPES
from ninfer.cli.config import add_config_argument, check_choice, settings_from
from ninfer.engine.config import GDN_STATE_DTYPES
from ninfer.errors import ConfigError

WEIGHTS = ("bf16", "q8", "q4")
DTYPES = ("bfloat16", "float16", "float32")
PEERS = ("hf",)
OUTPUTS = ("table", "json")


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def prompt_gen_pair(text: str) -> tuple[int, int]:
    values = int_list(text)
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: -pg takes PROMPT,GEN")
    return values[0], values[1]


def _as_text(value: object) -> str:
    """A file's list of integers in the flag's comma-separated form."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


@dataclass(slots=True)
class BenchSettings:
    """Settings of `ninfer bench` (flags or `--config` keys) with their defaults. The one-letter
    flags' keys are their long names: prompts (-p), gens (-n), prompt_gens (-pg), repetitions
    (-r), output (-o)."""

    file: str | None = None
    shape: str | None = None
    weights: str = "q4"
    prompts: list[int] = field(default_factory=list)
    gens: list[int] = field(default_factory=list)
    prompt_gens: list[tuple[int, int]] = field(default_factory=list)
    repetitions: int = 3
    warmup: int = 1
    concurrency: list[int] = field(default_factory=lambda: [1])
    prefill_chunk: int = 1024
    idle_prefill_chunk: int | None = None  # None: 4 x prefill_chunk
    device: str | None = None
    dtype: str | None = None
    gdn_state_dtype: str = "float32"
    peer: list[str] = field(default_factory=list)
    seed: int = 0
    no_cuda_graph: bool = False
    no_overlap: bool = False
    profile: bool = False
    tensor_parallel: int = 1
    expert_parallel: bool = False
    output: str = "table"
    output_file: str | None = None

    def __post_init__(self) -> None:
        if self.shape is not None:
            check_choice("shape", self.shape, list(SHAPES))
        check_choice("weights", self.weights, WEIGHTS)
        if self.dtype is not None:
            check_choice("dtype", self.dtype, DTYPES)
        check_choice("gdn-state-dtype", self.gdn_state_dtype, GDN_STATE_DTYPES)
        check_choice("output", self.output, OUTPUTS)
        for peer in self.peer:
            check_choice("peer", peer, PEERS)
        try:
            self.prompts = int_list(_as_text(self.prompts)) if self.prompts else []
            self.gens = int_list(_as_text(self.gens)) if self.gens else []
            self.concurrency = int_list(_as_text(self.concurrency))
            self.prompt_gens = [prompt_gen_pair(_as_text(pair)) for pair in self.prompt_gens]
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(str(exc)) from None


SETTINGS = BenchSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", nargs="?", help=".ninfer artifact")
    add_config_argument(parser)
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="random weights in this model shape, made on the device (no file)",
    )
    parser.add_argument(
        "--weights",
        choices=WEIGHTS,
        help="with --shape: the stored formats the speed-of-light bytes count (default q4)",
    )
    parser.add_argument(
        "-p",
        dest="prompts",
        metavar="LENGTHS",
        type=int_list,
        action="extend",
        help="prefill tests, prompt lengths (e.g. 512,4096)",
    )
    parser.add_argument(
        "-n",
        dest="gens",
        metavar="COUNTS",
        type=int_list,
        action="extend",
        help="decode tests, tokens generated (e.g. 128)",
    )
    parser.add_argument(
        "-pg",
        dest="prompt_gens",
        metavar="PROMPT,GEN",
        type=prompt_gen_pair,
        action="append",
        help="prefill then decode, PROMPT,GEN (repeatable)",
    )
    parser.add_argument(
        "-r",
        dest="repetitions",
        metavar="N",
        type=int,
        help="timed repetitions (default 3)",
    )
    parser.add_argument(
        "--warmup",
        metavar="N",
        type=int,
        help="untimed runs before each test (default 1)",
    )
    parser.add_argument(
        "--concurrency",
        metavar="LIST",
        type=int_list,
        help="requests run at once, a list (e.g. 1,2,4,8; default 1)",
    )
    parser.add_argument(
        "--prefill-chunk",
        metavar="N",
        type=int,
        help="prompt tokens per step while some request decodes (default 1024)",
    )
    parser.add_argument(
        "--idle-prefill-chunk",
        metavar="N",
        type=int,
        help="prompt tokens per step while nothing decodes (default 4 x --prefill-chunk)",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--gdn-state-dtype",
        choices=GDN_STATE_DTYPES,
        help="the GDN recurrent state: float32 (default) or bfloat16; the bytes a decode step "
        "moves count it in that dtype",
    )
    parser.add_argument(
        "--peer",
        action="append",
        choices=PEERS,
        help="also time transformers on the same tests (repeatable)",
    )
    parser.add_argument("--seed", type=int, help="seed of random weights and prompts (default 0)")
    parser.add_argument(
        "--no-cuda-graph",
        action="store_true",
        default=None,
        help="run decode steps eagerly (debugging)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        default=None,
        help="read each decode step back before launching the next (the host's share unhidden)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="split the model over N processes, one GPU each; speed of light per GPU "
        "(default 1; docs/parallel.md)",
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        default=None,
        help="MoE: split the experts whole over the tensor-parallel ranks",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        default=None,
        help="after timing, run each test once more under torch.profiler (CUDA graphs off) "
        "and report its top kernels by device time",
    )
    parser.add_argument(
        "-o",
        dest="output",
        choices=OUTPUTS,
        help="report on stdout as a table or JSON (default table)",
    )
    parser.add_argument("--output-file", metavar="FILE", help="also write the JSON report here")


class _Progress:
    """Each row on stderr as soon as it is timed (the report on stdout comes at the end), so
    a run that is cut short has still shown what it measured."""

    def __init__(self) -> None:
        self.started = False

    def __call__(self, row: dict) -> None:
        from ninfer.bench.run import TABLE_HEADER, format_row

        if not self.started:
            print(TABLE_HEADER, file=sys.stderr)
            self.started = True
        print(format_row(row), file=sys.stderr, flush=True)


def check_writable(path: str, flag: str) -> None:
    """A file `path` can be created or replaced: its folder exists and takes writes."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a directory")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: no directory {folder}")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path} cannot be written")


def run(inputs: argparse.Namespace) -> int:
    from ninfer.bench.cases import make_cases
    from ninfer.bench.run import BenchOptions, format_table, run_bench

    args = settings_from(BenchSettings, inputs, "bench")
    prompts = sorted(set(args.prompts))
    gens = sorted(set(args.gens))
    if not (prompts or gens or args.prompt_gens):
        prompts, gens = [512], [128]
    if args.file is None and args.shape is None:
        raise ConfigError("give a .ninfer file or --shape")
    if args.output_file:
        check_writable(args.output_file, "--output-file")  # before the run, not after it
    cases = make_cases(prompts, gens, args.prompt_gens, args.concurrency)
    progress = _Progress()
    report = run_bench(
        BenchOptions(
            cases=cases,
            model_path=args.file,
            shape=args.shape,
            weights=args.weights,
            device=args.device,
            dtype=args.dtype,
            gdn_state_dtype=args.gdn_state_dtype,
            repetitions=args.repetitions,
            warmup=args.warmup,
            prefill_chunk=args.prefill_chunk,
            idle_prefill_chunk=args.idle_prefill_chunk,
            peers=args.peer,
            seed=args.seed,
            cuda_graph=not args.no_cuda_graph,
            overlap=not args.no_overlap,
            profile=args.profile,
            tensor_parallel=args.tensor_parallel,
            expert_parallel=args.expert_parallel,
            on_row=progress,
        )
    )
    text = json.dumps(report, indent=1) if args.output == "json" else format_table(report)
    print(text)
    sys.stdout.flush()
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(report, f, indent=1)
    return 0

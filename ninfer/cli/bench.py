"""`ninfer bench`: llama-bench style throughput with each row's speed-of-light ratio, on a
`.ninfer` file or on random weights in a real model shape (docs/performance.md)."""

from __future__ import annotations

import argparse
import json
import sys

from ninfer.bench.shapes import SHAPES
from ninfer.errors import ConfigError


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", nargs="?", help=".ninfer artifact")
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="random weights in this model shape, made on the device (no file)",
    )
    parser.add_argument(
        "--weights",
        choices=("bf16", "q8", "q4"),
        default="q4",
        help="with --shape: the stored formats the speed-of-light bytes count (default q4)",
    )
    parser.add_argument(
        "-p",
        dest="prompts",
        metavar="LENGTHS",
        type=int_list,
        action="append",
        help="prefill tests, prompt lengths (e.g. 512,4096)",
    )
    parser.add_argument(
        "-n",
        dest="gens",
        metavar="COUNTS",
        type=int_list,
        action="append",
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
        default=3,
        help="timed repetitions (default 3)",
    )
    parser.add_argument(
        "--warmup",
        metavar="N",
        type=int,
        default=1,
        help="untimed runs before each test (default 1)",
    )
    parser.add_argument(
        "--concurrency",
        metavar="LIST",
        type=int_list,
        default=[1],
        help="requests run at once, a list (e.g. 1,2,4,8; default 1)",
    )
    parser.add_argument(
        "--prefill-chunk",
        metavar="N",
        type=int,
        default=1024,
        help="prompt tokens per step (default 1024)",
    )
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--peer",
        action="append",
        choices=("hf",),
        default=[],
        help="also time transformers on the same tests (repeatable)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of random weights and prompts (default 0)"
    )
    parser.add_argument(
        "--no-cuda-graph", action="store_true", help="run decode steps eagerly (debugging)"
    )
    parser.add_argument(
        "-o",
        dest="output",
        choices=("table", "json"),
        default="table",
        help="report on stdout as a table or JSON (default table)",
    )
    parser.add_argument("--output-file", metavar="FILE", help="also write the JSON report here")


def run(args: argparse.Namespace) -> int:
    from ninfer.bench.cases import make_cases
    from ninfer.bench.run import BenchOptions, format_table, run_bench

    prompts = sorted({p for group in args.prompts or [] for p in group})
    gens = sorted({n for group in args.gens or [] for n in group})
    if not (prompts or gens or args.prompt_gens):
        prompts, gens = [512], [128]
    if args.file is None and args.shape is None:
        raise ConfigError("give a .ninfer file or --shape")
    cases = make_cases(prompts, gens, args.prompt_gens or [], args.concurrency)
    report = run_bench(
        BenchOptions(
            cases=cases,
            model_path=args.file,
            shape=args.shape,
            weights=args.weights,
            device=args.device,
            dtype=args.dtype,
            repetitions=args.repetitions,
            warmup=args.warmup,
            prefill_chunk=args.prefill_chunk,
            peers=args.peer,
            seed=args.seed,
            cuda_graph=not args.no_cuda_graph,
        )
    )
    text = json.dumps(report, indent=1) if args.output == "json" else format_table(report)
    print(text)
    sys.stdout.flush()
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(report, f, indent=1)
    return 0

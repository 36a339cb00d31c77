"""The `ninfer` console script: one subcommand per module in ninfer/cli, imported lazily so that
`ninfer run` never pays for the server stack."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ninfer.errors import NinferError

# subcommand -> (module, one-line help). Each module defines add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": (
        "ninfer.cli.bench",
        "throughput (prefill, decode, concurrency) with each row's speed-of-light ratio",
    ),
    "convert": ("ninfer.cli.convert", "convert a Hugging Face checkpoint into a .ninfer artifact"),
    "inspect": ("ninfer.cli.inspect", "print or verify a .ninfer artifact"),
    "run": ("ninfer.cli.run", "run one request: answer on stdout, reasoning and timings on stderr"),
    "serve": (
        "ninfer.cli.serve",
        "HTTP server: OpenAI Chat Completions and Responses, Anthropic Messages",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ninfer", description="Inference engine for Qwen3.5 models."
    )
    from ninfer import __version__

    parser.add_argument("--version", action="version", version=f"ninfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except NinferError as exc:
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ninfer {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`ninfer inspect X | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as exc:  # a path the command was given: missing, a directory, not writable
        print(f"ninfer {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

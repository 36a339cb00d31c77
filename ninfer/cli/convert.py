"""`ninfer convert`: Hugging Face checkpoint directory -> `.ninfer` artifact."""

from __future__ import annotations

import argparse

from ninfer.errors import ConversionError

WEIGHT_PROFILES = ("bf16", "fp32", "groupwise-int")


def _byte_count(text: str) -> int:
    """An integer byte count; `32e9` style is accepted."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole byte count: {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        metavar="HF_DIR",
        help="checkpoint directory (config.json + *.safetensors)",
    )
    parser.add_argument(
        "--recipe",
        required=True,
        help="built-in recipe (qwen3_5, qwen3_5_moe) or a recipe .py file",
    )
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="artifact to write (never overwritten)"
    )
    parser.add_argument(
        "--weights", default="bf16", choices=WEIGHT_PROFILES, help="weight profile (default bf16)"
    )
    parser.add_argument(
        "--components",
        default=None,
        help="comma-separated: text[,mtp] (default: text, plus mtp when the checkpoint has mtp.* tensors)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="artifact name stored in metadata (default: the directory name)",
    )
    parser.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="ROLE=PATH",
        help="add or replace a resource (tokenizer, tokenizer_config, chat_template, generation_config)",
    )
    parser.add_argument(
        "--max-file-bytes",
        type=_byte_count,
        default=32_000_000_000,
        help="largest file size; more goes to .part-NNNN files",
    )


def run(args: argparse.Namespace) -> int:
    from ninfer.artifact.convert import convert, report_path

    resources = {}
    for item in args.resource:
        role, sep, path = item.partition("=")
        if not sep or not role or not path:
            raise ConversionError(f"--resource {item!r}: expected ROLE=PATH")
        resources[role] = path
    components = None
    if args.components:
        components = {c.strip() for c in args.components.split(",") if c.strip()}
    report = convert(
        args.model,
        args.recipe,
        args.out,
        weights=args.weights,
        components=components,
        name=args.name,
        resources=resources,
        max_file_bytes=args.max_file_bytes,
    )
    total = sum(f["bytes"] for f in report["files"])
    print(
        f"wrote {args.out}: {len(report['tensors'])} tensors, {total:,} bytes in {len(report['files'])} file(s); "
        f"report {report_path(args.out)}"
    )
    return 0

"""`ninfer convert`: Hugging Face checkpoint directory -> `.ninfer` artifact."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from ninfer.cli.config import add_config_argument, check_choice, require, settings_from
from ninfer.errors import ConfigError, ConversionError

WEIGHT_PROFILES = ("bf16", "fp32", "groupwise-int")


def _byte_count(text: str) -> int:
    """An integer byte count; `32e9` style is accepted."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None
    if not math.isfinite(value) or value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive whole byte count: {text!r}")
    return int(value)


@dataclass(slots=True)
class ConvertSettings:
    """Settings of `ninfer convert` (flags or `--config` keys) with their defaults."""

    model: str | None = None  # required, like recipe and out
    recipe: str | None = None
    out: str | None = None
    weights: str = "bf16"
    components: str | None = None  # default: text, plus mtp when the checkpoint has it
    name: str | None = None
    resource: list[str] = field(default_factory=list)
    max_file_bytes: int | str = 32_000_000_000  # a count, or its text (32e9)

    def __post_init__(self) -> None:
        check_choice("weights", self.weights, WEIGHT_PROFILES)
        if self.components is not None and not isinstance(self.components, str):
            raise ConfigError("components must be a comma-separated string: text[,mtp]")
        if not isinstance(self.resource, list):
            raise ConfigError("resource must be a list of ROLE=PATH strings")
        try:
            self.max_file_bytes = _byte_count(str(self.max_file_bytes))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"max-file-bytes: {exc}") from None


SETTINGS = ConvertSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="HF_DIR",
        help="checkpoint directory (config.json + *.safetensors); required",
    )
    parser.add_argument(
        "--recipe",
        help="built-in recipe (qwen3_5, qwen3_5_moe) or a recipe .py file; required",
    )
    parser.add_argument(
        "--out", metavar="FILE", help="artifact to write (never overwritten); required"
    )
    add_config_argument(parser)
    parser.add_argument("--weights", choices=WEIGHT_PROFILES, help="weight profile (default bf16)")
    parser.add_argument(
        "--components",
        help="comma-separated: text[,mtp] (default: text, plus mtp when the checkpoint has mtp.* tensors)",
    )
    parser.add_argument(
        "--name",
        help="artifact name stored in metadata (default: the directory name)",
    )
    parser.add_argument(
        "--resource",
        action="append",
        metavar="ROLE=PATH",
        help="add or replace a resource (tokenizer, tokenizer_config, chat_template, generation_config)",
    )
    parser.add_argument(
        "--max-file-bytes",
        type=_byte_count,
        help="largest file size; more goes to .part-NNNN files",
    )


def run(inputs: argparse.Namespace) -> int:
    from ninfer.artifact.convert import convert, report_path

    args = settings_from(ConvertSettings, inputs, "convert")
    require(args, model="--model", recipe="--recipe", out="--out")
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

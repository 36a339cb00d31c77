"""`--config FILE.toml` for every command: the file holds the same keys as the flags (dashes or
underscores), flat or under a `[COMMAND]` table; explicit flags win over the file, the file over
the built-in defaults.

Commands declare their flags with `default=None` (so "given" is visible) and keep the real
defaults in a settings dataclass; `settings_from(SettingsClass, args, "serve")` merges the three.
"""

from __future__ import annotations

import argparse
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from ninfer.errors import ConfigError

T = TypeVar("T")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read settings from a TOML file (same keys as the flags; flags win)",
    )


def read_config_file(path: str | Path, command: str) -> dict[str, Any]:
    """The file's settings for `command`: top-level keys plus a `[command]` table (which wins),
    with dashes in keys turned into underscores."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    values = {k: v for k, v in data.items() if not isinstance(v, dict)}
    section = data.get(command)
    if isinstance(section, dict):
        values.update(section)
    return {key.replace("-", "_"): value for key, value in values.items()}


def settings_from(cls: type[T], args: argparse.Namespace, command: str) -> T:
    """An instance of the dataclass `cls`: defaults < config file < flags given on the line."""
    names = {f.name for f in fields(cls)}
    from_file: dict[str, Any] = {}
    if getattr(args, "config", None):
        from_file = read_config_file(args.config, command)
        unknown = sorted(set(from_file) - names)
        if unknown:
            raise ConfigError(
                f"unknown key(s) in {args.config}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})"
            )
    values = dict(from_file)
    for name in names:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    return cls(**values)

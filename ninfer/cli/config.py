"""`--config FILE.toml` for every command: the file holds the same keys as the flags (dashes or
underscores), flat or under a `[COMMAND]` table; explicit flags win over the file, the file over
the built-in defaults.

Commands declare their flags with `default=None` (so "given" is visible) and keep the real
defaults in a settings dataclass, which the command's module names as `SETTINGS`;
`settings_from(SettingsClass, args, "serve")` merges the three.

One file can serve several commands: a command takes the top-level keys it knows and skips those
that only other registered commands know. A top-level key no command knows, a key in the
command's own `[COMMAND]` table that it does not know, and a table that is not a command's name
are errors.
"""

from __future__ import annotations

import argparse
import importlib
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


def command_keys() -> dict[str, set[str]]:
    """Each registered command's settings keys: the fields of its module's `SETTINGS`."""
    from ninfer.cli.main import COMMANDS

    return {
        name: {f.name for f in fields(importlib.import_module(module).SETTINGS)}
        for name, (module, _) in COMMANDS.items()
    }


def check_choice(key: str, value: Any, choices: tuple[str, ...] | list[str]) -> None:
    """A file value is checked as argparse checks the flag's: one of `choices`."""
    if value not in choices:
        raise ConfigError(f"{key} = {value!r}: choose from {', '.join(choices)}")


def require(settings: Any, **labels: str) -> None:
    """The settings a command cannot run without (given on the line or in the file), each with
    the label argparse would print for it: `require(s, out="--out")`."""
    missing = [label for name, label in labels.items() if getattr(settings, name) is None]
    if missing:
        raise ConfigError(f"the following arguments are required: {', '.join(missing)}")


def _key(name: str) -> str:
    return name.replace("-", "_")


def read_config_file(path: str | Path, command: str, known: set[str]) -> dict[str, Any]:
    """The file's settings for `command`, whose keys are `known`: its top-level keys plus its
    `[command]` table (which wins), with dashes in keys turned into underscores."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    keys = command_keys()
    others = set().union(*(k for name, k in keys.items() if name != command))
    known_list = ", ".join(sorted(known))
    tables = sorted(name for name, value in data.items() if isinstance(value, dict))
    strays = [name for name in tables if name not in keys and name != command]
    if strays:
        raise ConfigError(
            f"unknown table(s) in {path}: {', '.join(f'[{name}]' for name in strays)} "
            f"(tables are named after commands: {', '.join(sorted(keys))})"
        )
    values: dict[str, Any] = {}
    unknown = []
    for name, value in data.items():
        if isinstance(value, dict):
            continue
        if _key(name) in known:
            values[_key(name)] = value
        elif _key(name) not in others:
            unknown.append(name)
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)} (known: {known_list})")
    section = data.get(command)
    if not isinstance(section, dict):
        section = {}
    unknown = [name for name in section if _key(name) not in known]
    if unknown:
        raise ConfigError(
            f"unknown key(s) in [{command}] of {path}: {', '.join(unknown)} (known: {known_list})"
        )
    values.update({_key(name): value for name, value in section.items()})
    return values


def settings_from(cls: type[T], args: argparse.Namespace, command: str) -> T:
    """An instance of the dataclass `cls`: defaults < config file < flags given on the line."""
    names = {f.name for f in fields(cls)}
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values = read_config_file(args.config, command, names)
    for name in names:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    return cls(**values)

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
import types
import typing
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
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a directory") from None
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
        hints = typing.get_type_hints(cls)
        values = {name: file_value(name, value, hints[name]) for name, value in values.items()}
    for name in names:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = given
    return cls(**values)


def file_value(key: str, value: Any, hint: Any) -> Any:
    """A file's `value` for the setting `key` of type `hint`, checked as the flag's parser
    checks it: a bool must be true or false, an int an integer, a float a number (an integer
    is taken), a str a string (a number is taken as its text); a list of strings or integers
    takes one such value as a list of one, and integers also as comma-separated text. Other
    types are the command's to check."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]  # no TOML null
        if len(kinds) > 1:
            return value
        [hint] = kinds
    item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
    if hint is bool and not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: must be true or false")
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{key} = {value!r}: must be an integer")
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r}: must be a number")
        return float(value)
    if hint is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key} = {value!r}: must be a string")
        return str(value)
    if item is str:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key} = {value!r}: must be a string or a list of strings")
    if item is int:
        if isinstance(value, str):  # comma-separated, as on the command line
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ConfigError(
                    f"{key} = {value!r}: not a comma-separated list of integers"
                ) from None
        value = [value] if isinstance(value, int) and not isinstance(value, bool) else value
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{key} = {value!r}: must be an integer or a list of integers")
    return value

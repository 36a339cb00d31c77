"""docs/cli.md and the real `ninfer` parsers agree: every flag of a command is in that command's
section, every `--flag` the page names exists, and every flag has a help text."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ninfer.cli.main import COMMANDS, build_parser

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
LONG_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flag_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings]


def doc_sections() -> dict[str, str]:
    """The text under each `## `ninfer COMMAND`` heading, up to the next `## ` heading."""
    sections: dict[str, str] = {}
    parts = re.split(r"^## ", CLI_DOC.read_text(encoding="utf-8"), flags=re.M)
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        match = re.fullmatch(r"`ninfer (\w+)`", heading.strip())
        if match:
            sections[match.group(1)] = body
    return sections


def mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_registered_command_has_a_section():
    assert set(doc_sections()) == set(COMMANDS) == set(subparsers())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_a_command_is_in_its_section(command):
    section = doc_sections()[command]
    missing = [
        option
        for action in flag_actions(subparsers()[command])
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
        if not mentions(section, option)
    ]
    assert missing == [], f"docs/cli.md, section `ninfer {command}`, lacks {missing}"


def test_help_and_version_flags_are_documented():
    text = CLI_DOC.read_text(encoding="utf-8")
    for option in ("-h", "--help", "--version"):
        assert mentions(text, option), option


def test_every_flag_named_in_the_doc_exists_in_some_parser():
    known = {o for a in flag_actions(build_parser()) for o in a.option_strings}
    for parser in subparsers().values():
        known |= {o for a in flag_actions(parser) for o in a.option_strings}
    named = set(LONG_FLAG.findall(CLI_DOC.read_text(encoding="utf-8")))
    assert sorted(named - known) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_help_text(command):
    bare = [
        action.option_strings[0]
        for action in flag_actions(subparsers()[command])
        if not (action.help or "").strip()
    ]
    assert bare == [], f"`ninfer {command} --help` has flags without help: {bare}"

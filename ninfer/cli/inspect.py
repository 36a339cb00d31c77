"""`ninfer inspect`: print an artifact's summary, objects, bindings or raw JSON; verify checksums."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from ninfer.cli.config import add_config_argument, require, settings_from


@dataclass(slots=True)
class InspectSettings:
    """Settings of `ninfer inspect` (flags or `--config` keys) with their defaults."""

    file: str | None = None  # required
    objects: bool = False
    bindings: bool = False
    json: bool = False
    verify: bool = False


SETTINGS = InspectSettings


def _switch(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    parser.add_argument(name, action="store_true", default=None, help=help_text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", nargs="?", help=".ninfer artifact")
    add_config_argument(parser)
    _switch(parser, "--objects", "list every object")
    _switch(parser, "--bindings", "list logical name -> object bindings")
    _switch(parser, "--json", "print the header JSON")
    _switch(parser, "--verify", "check sizes and every object's xxh64 checksum")


def _summary(artifact) -> list[str]:
    container = artifact.container
    root = container.root
    lines = [f"file       {container.path}", f"id         {container.artifact_id.hex()}"]
    if root.get("metadata", {}).get("name"):
        lines.append(f"name       {root['metadata']['name']}")
    lines.append(f"files      {len(container.files)} ({container.payload_bytes:,} payload bytes)")
    for component, spec in root["components"].items():
        config = spec.get("config", {})
        text = config.get("text_config", config)
        desc = f"{config.get('model_type', '?')}"
        if "num_hidden_layers" in text:
            desc += f", {text['num_hidden_layers']} layers, hidden {text.get('hidden_size')}"
        if spec.get("target"):
            desc += f", target {spec['target']}"
        lines.append(f"component  {component}: {desc}")
        roles = sorted(spec.get("resources", {}))
        if roles:
            lines.append(f"resources  {component}: {', '.join(roles)}")
    formats: dict[str, list[int]] = {}
    for obj in root["objects"]:
        key = obj.get("format", "resource")
        count_bytes = formats.setdefault(key, [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += obj["bytes"]
    lines.append(f"objects    {len(root['objects'])}, bindings {len(root['bindings'])}")
    for key, (count, nbytes) in sorted(formats.items()):
        lines.append(f"  {key:<22} {count:>6} objects {nbytes:>16,} bytes")
    return lines


def run(inputs: argparse.Namespace) -> int:
    from ninfer.artifact import Artifact

    args = settings_from(InspectSettings, inputs, "inspect")
    require(args, file="FILE")
    artifact = Artifact.open(args.file)
    root = artifact.root
    if args.json:  # stdout stays one JSON document: the header holds objects and bindings
        print(json.dumps(root, indent=2))
    else:
        print("\n".join(_summary(artifact)))
    if args.objects and not args.json:
        for obj in root["objects"]:
            if obj["kind"] == "tensor":
                what = f"{obj['format']:<20} {str(obj['shape']):<20}"
            else:
                what = f"{'resource':<20} {'':<20}"
            print(f"{obj['offset']:>14} {obj['bytes']:>12} {what} {obj['id']}")
    if args.bindings and not args.json:
        for name, binding in root["bindings"].items():
            target = binding.get("object") or ", ".join(
                f"{p['object']}[{p['range'][0]}:{p['range'][1]}]" for p in binding["parts"]
            )
            print(f"{name} -> {target}")
    if args.verify:
        checked = artifact.verify()
        print(
            f"verified {checked} objects: checksums match", file=sys.stderr if args.json else None
        )
    return 0

"""Read-only access to a Hugging Face checkpoint directory: safetensors shards (through the
index, or from the shard headers when there is none), config.json and the tokenizer files.
Tensors are loaded one at a time, so memory stays bounded by the largest tensor."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ninfer.errors import ConversionError

INDEX_NAME = "model.safetensors.index.json"

# resource role -> file name in the checkpoint directory
RESOURCE_FILES = {
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
    "chat_template": "chat_template.jinja",
    "generation_config": "generation_config.json",
}


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConversionError(f"{self.dir}: not a checkpoint directory")
        self.config = self._read_json("config.json", required=True)
        self.key_to_file = self._map_keys()
        self._handles: dict[Path, object] = {}

    def _read_json(self, name: str, required: bool = False) -> dict | None:
        path = self.dir / name
        if not path.exists():
            if required:
                raise ConversionError(f"{path}: missing")
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{path}: invalid JSON ({exc})") from None
        except IsADirectoryError:
            raise ConversionError(f"{path}: a directory, not a JSON file") from None
        if not isinstance(data, dict):
            raise ConversionError(f"{path}: not a JSON object")
        return data

    def _map_keys(self) -> dict[str, Path]:
        index = self._read_json(INDEX_NAME)
        if index is not None:
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{self.dir / INDEX_NAME}: no 'weight_map'")
            files = {name: self.dir / name for name in set(weight_map.values())}
            for path in files.values():
                if not path.exists():
                    raise ConversionError(f"{path}: listed in {INDEX_NAME} but missing")
            return {key: files[name] for key, name in weight_map.items()}
        shards = sorted(self.dir.glob("*.safetensors"))
        if not shards:
            raise ConversionError(f"{self.dir}: no *.safetensors files")
        key_to_file: dict[str, Path] = {}
        for shard in shards:
            try:
                with safe_open(shard, framework="pt") as f:
                    for key in f.keys():
                        key_to_file[key] = shard
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise ConversionError(f"{shard}: unreadable safetensors header ({exc})") from None
        return key_to_file

    def keys(self) -> list[str]:
        return sorted(self.key_to_file)

    def has(self, key: str) -> bool:
        return key in self.key_to_file

    def _handle(self, key: str):
        try:
            path = self.key_to_file[key]
        except KeyError:
            raise ConversionError(f"{self.dir}: checkpoint has no tensor {key!r}") from None
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="pt")
            except Exception as exc:
                raise ConversionError(f"{path}: unreadable safetensors file ({exc})") from None
        return self._handles[path]

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._handle(key)
        try:
            return tuple(handle.get_slice(key).get_shape())
        except Exception as exc:  # e.g. an index that names the wrong shard for the key
            raise ConversionError(
                f"{self.key_to_file[key]}: cannot read tensor {key!r} ({exc})"
            ) from None

    def load(self, key: str) -> torch.Tensor:
        try:
            return self._handle(key).get_tensor(key)
        except ConversionError:
            raise
        except Exception as exc:
            raise ConversionError(
                f"{self.key_to_file[key]}: cannot read tensor {key!r} ({exc})"
            ) from None

    def resource_files(self) -> dict[str, Path]:
        return {
            role: self.dir / name
            for role, name in RESOURCE_FILES.items()
            if (self.dir / name).exists()
        }
